// expect: paratrain: LocalDataParallel copies the model into replicas with clone\(\); derive the module from
// DP replicates the model, so it must be cloneable; the message says how.
#include <torch/torch.h>

#include "paratrain/strategy/local_data_parallel.hpp"

struct NetImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x) { return x; }
};
TORCH_MODULE(Net);

paratrain::LocalDataParallel<Net, torch::optim::SGD> strategy(Net(), torch::optim::SGDOptions(0.1));
