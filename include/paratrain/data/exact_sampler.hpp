#pragma once
/// \file
/// paratrain::data::ExactSampler — every sample once, for evaluation.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "paratrain/data/detail/shard_checks.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain::data {

/// Splits the indices 0..dataset_size-1 among `num_replicas` processes so that, over
/// all ranks, every index appears exactly once: rank r gets r, r + N, r + 2N, ... below
/// dataset_size. Nothing is padded, dropped or shuffled, so metrics summed over ranks
/// are the metrics of the whole dataset (DistributedSampler, which pads, would count a
/// few samples twice).
///
/// The price is that ranks may get different counts (the first dataset_size % N ranks
/// get one more), so an evaluation loop must not run a collective per batch; reduce
/// sums and counts once at the end instead.
///
/// \code
/// auto sampler = paratrain::data::ExactSampler(test_size, {.num_replicas = world_size, .rank = rank});
/// const auto indices = sampler.indices();
/// for (auto batch : paratrain::data::batches(indices, 256)) { ... }
/// \endcode
class ExactSampler {
 public:
  /// Both fields are required; the sentinel defaults are rejected, since a forgotten
  /// one would give every process the same shard.
  struct Options {
    /// The number of processes sharing the dataset (the world size); at least 1.
    std::int64_t num_replicas = 0;
    /// This process's rank, in [0, num_replicas).
    std::int64_t rank = -1;
  };

  /// Throws paratrain::error if dataset_size < 0, num_replicas < 1, or rank lies
  /// outside [0, num_replicas).
  ExactSampler(std::int64_t dataset_size, Options options)
      : dataset_size_(dataset_size), options_(options) {
    validate();
  }

  /// Does nothing: the shards do not depend on the epoch. It exists so ExactSampler
  /// satisfies paratrain::sampler and drops into the same loop as DistributedSampler.
  void set_epoch(std::int64_t /*epoch*/) noexcept {}

  /// This rank's indices, in increasing order: rank, rank + N, ... < dataset_size.
  [[nodiscard]] std::vector<std::int64_t> indices() const {
    std::vector<std::int64_t> mine;
    mine.reserve(static_cast<std::size_t>(size()));
    for (auto i = options_.rank; i < dataset_size_; i += options_.num_replicas) {
      mine.push_back(i);
    }
    return mine;
  }

  /// The number of indices this rank gets; it differs between ranks by at most one.
  [[nodiscard]] std::int64_t size() const noexcept {
    const auto remaining = dataset_size_ - options_.rank;
    return remaining > 0 ? (remaining + options_.num_replicas - 1) / options_.num_replicas : 0;
  }
  [[nodiscard]] std::int64_t dataset_size() const noexcept { return dataset_size_; }
  [[nodiscard]] const Options& options() const noexcept { return options_; }

 private:
  void validate() const {
    detail::check_shard("ExactSampler", dataset_size_, options_.num_replicas, options_.rank);
  }

  std::int64_t dataset_size_;
  Options options_;
};

}  // namespace paratrain::data
