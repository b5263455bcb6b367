// expect: paratrain: name the update as DataParallel's third argument: an optimizer
// DataParallel<Net> used to mean SGD on one device, silently: the update must be named.
#include <torch/torch.h>

#include "paratrain/strategy/data_parallel.hpp"

struct NetImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x) { return x; }
};
TORCH_MODULE(Net);

using Unnamed = paratrain::DataParallel<Net>;
static_assert(sizeof(Unnamed) > 0);
