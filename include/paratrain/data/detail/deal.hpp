#pragma once
/// \file
/// detail::Deal — how DistributedSampler (and WeightedSampler after it) share an epoch's
/// order out among replicas.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace paratrain::detail {

/// The places of an order of `n` that the replicas take, from place `start` on: each
/// takes `per_replica` of them, replica r the places start + r, start + r + N, ... below
/// `end`, place i being order[i % n]. PyTorch's DistributedSampler formulas over what
/// remains of the order: padded (ceil) or, with drop_last, truncated (floor).
struct Deal {
  std::int64_t start = 0;
  std::int64_t per_replica = 0;
  std::int64_t end = 0;  ///< start + per_replica * replicas (PyTorch's total_size when start is 0)

  static Deal of(std::int64_t n, std::int64_t start, std::int64_t replicas, bool drop_last) {
    const auto rest = std::max<std::int64_t>(n - start, 0);
    const auto per_replica = drop_last ? rest / replicas : (rest + replicas - 1) / replicas;
    return {start, per_replica, start + per_replica * replicas};
  }

  // Note [Padding]
  // PyTorch pads by appending the order to itself (several times when the
  // padding is longer than the order) and cuts it to total_size, which puts order[i % n]
  // at place i. Truncated, end <= n, where i % n == i. An empty order has end == start, so
  // the loop never divides by n == 0 (PyTorch yields nothing there too).
  /// Replica `rank`'s indices, from `order` (n values).
  [[nodiscard]] std::vector<std::int64_t> mine(const std::int64_t* order, std::int64_t n, std::int64_t rank,
                                               std::int64_t replicas) const {
    std::vector<std::int64_t> out;
    out.reserve(static_cast<std::size_t>(per_replica));
    for (auto i = start + rank; i < end; i += replicas) out.push_back(order[i % n]);
    return out;
  }
};

}  // namespace paratrain::detail
