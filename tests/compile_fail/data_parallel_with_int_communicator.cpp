// expect: paratrain: not a communicator: it needs `int rank\(\) const`
// A strategy given something that is not a communicator says so at its boundary.
#include <torch/torch.h>

#include "paratrain/strategy/data_parallel.hpp"

struct NetImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x) { return x; }
};
TORCH_MODULE(Net);

paratrain::DataParallel<Net, int, torch::optim::SGD> strategy(Net(), 0, torch::optim::SGDOptions(0.1));
