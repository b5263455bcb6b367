// expect: paratrain: DataParallel overlaps communication with backward and needs a communicator with `iall_reduce\(at::Tensor&, reduce_op\)` returning a request; see docs/communicators\.md
// A communicator with a blocking all-reduce only cannot overlap DDP's gradient reduction with
// backward: the message names the member and the page that says which communicators have it.
#include <torch/torch.h>

#include "paratrain/comm/single_device.hpp"
#include "paratrain/strategy/data_parallel.hpp"

struct NetImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x) { return x; }
};
TORCH_MODULE(Net);

struct BlockingAllReduce : paratrain::comm::SingleDevice {
  void iall_reduce() = delete;
};

paratrain::DataParallel<Net, BlockingAllReduce, torch::optim::SGD> strategy(Net(), BlockingAllReduce(),
                                                                           torch::optim::SGDOptions(0.1));
