#pragma once
/// \file
/// How fit deals out its samples: the sampler options it builds a sampler with, the check
/// of a sampler built by the caller, and which samplers resume part-way through an epoch.

#include <cstdint>
#include <string>

#include "paratrain/concepts/strategy.hpp"
#include "paratrain/data/sampler_options.hpp"
#include "paratrain/fit/options.hpp"

namespace paratrain::detail {

/// The options fit builds a sampler type with: the strategy's replicas, FitOptions' order.
template <strategy S>
data::SamplerOptions sampler_options(S& s, const FitOptions& o) {
  const auto shard = s.data_shard();
  return {.num_replicas = shard.count, .rank = shard.index, .shuffle = o.shuffle, .seed = o.seed.value_or(0),
          .drop_last = o.drop_last};
}

/// Why a sampler built by the caller does not fit this rank's replica or the training set,
/// as far as it says (options() with num_replicas and rank, dataset_size()); "" when it does.
template <strategy S, class D, class Sampler>
std::string sampler_mismatch(S& s, const D& train, const Sampler& order) {
  const auto shard = s.data_shard();
  if constexpr (requires { order.options().num_replicas; order.options().rank; }) {
    if (order.options().num_replicas != shard.count || order.options().rank != shard.index)
      return "the sampler was built for replica " + std::to_string(order.options().rank) + " of " +
             std::to_string(order.options().num_replicas) + ", but this rank trains replica " +
             std::to_string(shard.index) + " of " + std::to_string(shard.count) +
             "; build it with {.num_replicas = s.data_shard().count, .rank = s.data_shard().index}";
  }
  if constexpr (requires { order.dataset_size(); }) {
    if (static_cast<std::int64_t>(order.dataset_size()) != static_cast<std::int64_t>(train.size()))
      return "the sampler deals out indices of " + std::to_string(order.dataset_size()) +
             " samples, but the training set holds " + std::to_string(train.size());
  }
  return {};
}

/// A sampler whose epoch can begin part-way through its order (DistributedSampler,
/// WeightedSampler): a resumed run then starts where the whole job stopped, at any world
/// size. Other samplers resume by skipping what this replica visited, at the same number
/// of replicas (Note [Resuming mid-epoch]).
template <class T>
concept resumable_sampler = requires(T& t, std::int64_t n) { t.set_epoch(n, n); };

}  // namespace paratrain::detail
