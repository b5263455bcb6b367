// expect: paratrain: ZeRO stage 3 gathers parameters on a communicator of its own and needs `Comm split\(int color, int key\) const`; see docs/communicators\.md \(or use stage 2\)
// Stage 3 needs split() for its gather communicator; stages 1 and 2 do not.
#include <torch/torch.h>

#include "paratrain/comm/single_device.hpp"
#include "paratrain/strategy/data_parallel.hpp"

struct NetImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x) { return x; }
};
TORCH_MODULE(Net);

struct NoSplit : paratrain::comm::SingleDevice {
  void split() = delete;
};

paratrain::DataParallel<Net, NoSplit, paratrain::Sharded<torch::optim::SGD, paratrain::zero::stage2>> fine(
    Net(), NoSplit(), torch::optim::SGDOptions(0.1));
paratrain::DataParallel<Net, NoSplit, paratrain::Sharded<torch::optim::SGD, paratrain::zero::stage3>> strategy(
    Net(), NoSplit(), torch::optim::SGDOptions(0.1));
