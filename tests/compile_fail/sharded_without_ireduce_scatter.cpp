// expect: paratrain: this communicator cannot overlap sharding: it needs `ireduce_scatter\(const at::Tensor& in, at::Tensor& out, paratrain::reduce_op\)` returning a request; see docs/communicators\.md
// A communicator with blocking reduce-scatter and all-gather only cannot overlap ZeRO's
// gradient reduction with backward: the message names the member and the page that says who
// has it.
#include <torch/torch.h>

#include "paratrain/comm/single_device.hpp"
#include "paratrain/strategy/data_parallel.hpp"

struct NetImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x) { return x; }
};
TORCH_MODULE(Net);

struct BlockingOnly : paratrain::comm::SingleDevice {
  void ireduce_scatter() = delete;
  void iall_gather() = delete;
};

paratrain::DataParallel<Net, BlockingOnly, paratrain::Sharded<torch::optim::SGD, paratrain::zero::stage2>> strategy(
    Net(), BlockingOnly(), torch::optim::SGDOptions(0.1));
