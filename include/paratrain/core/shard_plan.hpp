#pragma once
/// \file
/// paratrain::ShardPlan — how deterministic mode cuts a global batch into
/// virtual shards and shares them out (Note [Deterministic training]), and the seed of each
/// shard's random draws: the vocabulary the strategy and its sampler share.

#include <algorithm>
#include <cstdint>

namespace paratrain {

/// How a global batch of `samples` is cut into `shards` virtual shards and shared out
/// among `ranks` (Note [Deterministic training]).
class ShardPlan {
 public:
  ShardPlan(std::int64_t samples, std::int64_t shards) : samples_(samples), shards_(shards) {}

  /// The samples of shard k: samples / shards, one more for the first samples % shards.
  [[nodiscard]] std::int64_t size(std::int64_t k) const noexcept {
    return samples_ / shards_ + (k < samples_ % shards_ ? 1 : 0);
  }
  /// Where shard k begins in the global batch.
  [[nodiscard]] std::int64_t offset(std::int64_t k) const noexcept {
    return k * (samples_ / shards_) + std::min(k, samples_ % shards_);
  }
  /// The samples rank r of `ranks` gets: those of shards r, r + ranks, ...
  [[nodiscard]] std::int64_t rank_samples(std::int64_t r, std::int64_t ranks) const noexcept {
    std::int64_t n = 0;
    for (auto k = r; k < shards_; k += ranks) n += size(k);
    return n;
  }
  [[nodiscard]] std::int64_t samples() const noexcept { return samples_; }
  [[nodiscard]] std::int64_t shards() const noexcept { return shards_; }

 private:
  std::int64_t samples_, shards_;
};

/// The seed of shard k's random draws in step `step` (the optimizer steps taken before
/// it): splitmix64 over the three, so that neighbouring steps and shards draw unrelated
/// streams. Public, so that a reference written without paratrain can draw the same.
[[nodiscard]] inline std::uint64_t shard_seed(std::uint64_t seed, std::int64_t step, std::int64_t shard) noexcept {
  auto mix = [](std::uint64_t z) {
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  };
  return mix(mix(mix(seed) ^ static_cast<std::uint64_t>(step)) ^ static_cast<std::uint64_t>(shard));
}

/// The old spellings, paratrain::deterministic::ShardPlan and ::shard_seed, for one release.
namespace deterministic {
using paratrain::ShardPlan;
using paratrain::shard_seed;
}  // namespace deterministic

}  // namespace paratrain
