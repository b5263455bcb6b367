// expect: paratrain: the optimizer must be a class derived from torch::optim::Optimizer
// The third argument is an optimizer type; anything else is named as the mistake.
#include <torch/torch.h>

#include "paratrain/strategy/data_parallel.hpp"

struct NetImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x) { return x; }
};
TORCH_MODULE(Net);

using Wrong = paratrain::DataParallel<Net, paratrain::comm::SingleDevice, torch::optim::SGDOptions>;
Wrong* strategy = nullptr;
static_assert(sizeof(Wrong) > 0);
