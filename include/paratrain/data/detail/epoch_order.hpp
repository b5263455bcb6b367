#pragma once
/// \file
/// The order in which an epoch visits a dataset: PyTorch's DistributedSampler's.

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/randperm.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace paratrain::detail {

/// 0, 1, ..., dataset_size - 1, or with `shuffle` `torch.randperm(dataset_size)` drawn from a
/// CPU generator seeded with `seed + epoch`. Python's Generator.manual_seed(seed + epoch)
/// keeps the sum modulo 2^64, which is what unsigned arithmetic does; the CPU generator and
/// randperm kernel are the ones Python calls, so the permutation is the same.
inline std::vector<std::int64_t> epoch_order(std::int64_t dataset_size, bool shuffle, std::uint64_t seed,
                                             std::int64_t epoch) {
  std::vector<std::int64_t> order(static_cast<std::size_t>(dataset_size));
  if (!shuffle) {
    std::iota(order.begin(), order.end(), std::int64_t{0});
    return order;
  }
  const auto generator = at::make_generator<at::CPUGeneratorImpl>(seed + static_cast<std::uint64_t>(epoch));
  const auto permutation = at::randperm(dataset_size, generator, at::kLong);
  const auto* data = permutation.data_ptr<std::int64_t>();
  std::copy(data, data + dataset_size, order.begin());
  return order;
}

}  // namespace paratrain::detail
