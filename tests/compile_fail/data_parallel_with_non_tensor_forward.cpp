// expect: paratrain: the model's forward must take one or more torch::Tensor and return a torch::Tensor
// A model whose forward takes something other than tensors is told which signature is needed.
#include <torch/torch.h>

#include "paratrain/strategy/data_parallel.hpp"

struct ScaledImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor a, double scale) { return a * scale; }
};
TORCH_MODULE(Scaled);

paratrain::DataParallel<Scaled> strategy(Scaled(), torch::optim::SGDOptions(0.1));
