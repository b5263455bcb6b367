#pragma once
// fit's reference, shared by tests/unit/fit_test.cpp (over MPI) and tests/gpu/gpu_test.cpp (on
// the GPU): a small classifier, labelled samples, and the hand-written single-device loop that
// fit over `world` ranks must equal: each step on the union of the ranks' DistributedSampler
// batches, in rank order.
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "paratrain/data/distributed_sampler.hpp"
#include "paratrain/data/tensor_dataset.hpp"

namespace paratrain_test::fit_reference {

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 12));
    fc2 = register_module("fc2", torch::nn::Linear(12, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

/// The same weights on every call.
inline Net make_net() {
  torch::manual_seed(7);
  return Net();
}

/// `n` samples of 6 features, labels of 3 classes that depend on them.
inline paratrain::data::TensorDataset make_data(std::int64_t n, std::uint64_t seed) {
  torch::manual_seed(seed);
  auto x = torch::randn({n, 6});
  auto y = (x.narrow(1, 0, 3).argmax(1) + (x.narrow(1, 3, 1).squeeze(1) > 1.5).to(torch::kLong)) % 3;
  return {x, y};
}

/// Trains `net` (on `device`) as fit trains over `world` ranks with batches of `batch` per
/// rank, `epochs` epochs, the sampler's `seed`, cross-entropy and SGD with `sgd`; only the
/// first `max_steps` optimizer steps where that is > 0.
inline void train(Net& net, const paratrain::data::TensorDataset& data, int world, int epochs, std::int64_t batch,
                  std::uint64_t seed, const torch::optim::SGDOptions& sgd, const torch::Device& device,
                  std::int64_t max_steps = 0) {
  torch::optim::SGD optim(net->parameters(), sgd);
  const auto per_rank = static_cast<std::size_t>(batch);
  std::int64_t steps = 0;
  for (int epoch = 0; epoch < epochs; ++epoch) {
    std::vector<std::vector<std::int64_t>> shards;
    for (int r = 0; r < world; ++r) {
      paratrain::data::DistributedSampler sampler(data.size(), {.num_replicas = world, .rank = r, .seed = seed});
      sampler.set_epoch(epoch);
      shards.push_back(sampler.indices());
    }
    for (std::size_t first = 0; first < shards[0].size(); first += per_rank) {
      if (max_steps > 0 && steps++ == max_steps) return;
      std::vector<std::int64_t> step;
      for (auto& shard : shards)
        step.insert(step.end(), shard.begin() + first, shard.begin() + std::min(first + per_rank, shard.size()));
      const auto b = data.get(torch::tensor(step)).to(device);
      optim.zero_grad();
      torch::nn::functional::cross_entropy(net->forward(b.input()), b.target).backward();
      optim.step();
    }
  }
}

}  // namespace paratrain_test::fit_reference
