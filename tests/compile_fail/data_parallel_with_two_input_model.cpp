// expect: paratrain: the model's forward must take one torch::Tensor and return a torch::Tensor
// A model whose forward has another signature is told which one is needed.
#include <torch/torch.h>

#include "paratrain/strategy/data_parallel.hpp"

struct PairImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor a, torch::Tensor b) { return a + b; }
};
TORCH_MODULE(Pair);

paratrain::DataParallel<Pair> strategy(Pair(), torch::optim::SGDOptions(0.1));
