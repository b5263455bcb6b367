// Uses paratrain's header-only core as a package consumer would: shards a data set
// with DistributedSampler and all-reduces with comm::SingleDevice. Prints OK.
#include <ATen/ops/ones.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include <paratrain/comm/single_device.hpp>
#include <paratrain/data/distributed_sampler.hpp>

int main() {
  paratrain::comm::SingleDevice world;
  auto gradient = at::ones({3});
  world.all_reduce(gradient, paratrain::reduce_op::average);

  // Rank 1 of 4 over 10 samples: ceil(10 / 4) = 3 indices, padded like PyTorch.
  paratrain::data::DistributedSampler sampler(10, {.num_replicas = 4, .rank = 1, .shuffle = false});
  const auto indices = sampler.indices();
  const bool ok = gradient.eq(1).all().item<bool>() && indices == std::vector<std::int64_t>{1, 5, 9};

  std::puts(ok ? "paratrain test_package: OK" : "paratrain test_package: WRONG");
  return ok ? 0 : 1;
}
