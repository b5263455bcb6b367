#pragma once
/// \file
/// paratrain::data::SamplerOptions — how fit asks a sampler type to shard a dataset.

#include <cstdint>

namespace paratrain::data {

/// The arguments a sampler type gets, with the dataset's size, when paratrain::fit builds
/// it (`fit<data::SequentialSampler>(…)`): which data-parallel replica this rank is, of
/// how many, and FitOptions' shuffle, seed and drop_last. DistributedSampler's Options.
///
/// num_replicas and rank have no usable default: a forgotten one would silently give
/// every process the same shard, so samplers reject the sentinels below.
struct SamplerOptions {
  /// The number of replicas sharing the dataset (the world size, for DDP); at least 1.
  std::int64_t num_replicas = 0;
  /// This replica, in [0, num_replicas).
  std::int64_t rank = -1;
  /// Whether to draw a fresh permutation each epoch, as PyTorch's default does.
  bool shuffle = true;
  /// The same on every rank. PyTorch takes `seed + epoch` modulo 2^64 (a negative
  /// Python seed s is the same as `std::uint64_t(s)` here).
  std::uint64_t seed = 0;
  /// Drop the tail so no index repeats, instead of padding so none is lost.
  bool drop_last = false;
};

}  // namespace paratrain::data
