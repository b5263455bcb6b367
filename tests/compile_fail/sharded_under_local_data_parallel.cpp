// expect: paratrain: LocalDataParallel keeps its replicas in one process and cannot shard them; for ZeRO use
// ZeRO shards across processes; DP in one process says where sharding lives instead.
#include <torch/torch.h>

#include "paratrain/strategy/local_data_parallel.hpp"
#include "paratrain/strategy/sharded.hpp"

struct NetImpl : torch::nn::Cloneable<NetImpl> {
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) { return x; }
};
TORCH_MODULE(Net);

paratrain::LocalDataParallel<Net, paratrain::Sharded<torch::optim::Adam, paratrain::zero::stage2>> strategy(
    Net(), torch::optim::AdamOptions(1e-3));
