// expect: paratrain: this gradient hook sums whole buckets, and this strategy keeps a shard of each \(ZeRO stages 2 and 3\): use it with DDP or zero::stage1
// PowerSGD compresses whole gradient matrices; ZeRO-2 reduce-scatters each bucket into shards.
#include <torch/torch.h>

#include "paratrain/comm/single_device.hpp"
#include "paratrain/strategy/buckets/powersgd.hpp"
#include "paratrain/strategy/data_parallel.hpp"

struct NetImpl : torch::nn::Module {
  NetImpl() { fc = register_module("fc", torch::nn::Linear(4, 4)); }
  torch::Tensor forward(torch::Tensor x) { return fc(x); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Net);

using Zero2 = paratrain::DataParallel<Net, paratrain::comm::SingleDevice,
                                      paratrain::Sharded<torch::optim::SGD, paratrain::zero::stage2>>;
void compress(Zero2& s) { s.register_gradient_hook(paratrain::PowerSgd()); }
