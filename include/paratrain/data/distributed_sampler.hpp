#pragma once
/// \file
/// paratrain::data::DistributedSampler — PyTorch's DistributedSampler, index for index.

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "paratrain/data/sampler_options.hpp"
#include "paratrain/data/detail/deal.hpp"
#include "paratrain/data/detail/epoch_order.hpp"
#include "paratrain/data/detail/shard_checks.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain::data {

/// Splits the indices 0..dataset_size-1 among `num_replicas` processes for training,
/// yielding exactly what PyTorch 1.13's `torch.utils.data.DistributedSampler` yields
/// for the same arguments, so a run can move between Python and C++ and see the same
/// samples on the same ranks in the same order.
///
/// Every rank gets `size()` indices, the same count on all ranks (collectives such as
/// the gradient all-reduce need every rank to take the same number of steps):
/// - `drop_last == false`: size() = ceil(dataset_size / num_replicas); the order is
///   padded by repeating it from the start, so a few samples appear twice in an epoch.
/// - `drop_last == true`: size() = floor(dataset_size / num_replicas); the tail of the
///   (shuffled) order is dropped.
/// Rank r takes positions r, r + num_replicas, r + 2 num_replicas, ... of that order.
///
/// With `shuffle`, the order is `torch.randperm(dataset_size)` drawn from a CPU
/// generator seeded with `seed + epoch`; call set_epoch() at the start of each epoch
/// (as in PyTorch) or every epoch repeats the same order. For evaluation, where no
/// sample may be repeated or lost, use ExactSampler.
///
/// \code
/// auto sampler = paratrain::data::DistributedSampler(
///     dataset_size, {.num_replicas = world_size, .rank = rank, .seed = 42});
/// for (std::int64_t epoch = 0; epoch < epochs; ++epoch) {
///   sampler.set_epoch(epoch);
///   const auto indices = sampler.indices();
///   for (auto batch : paratrain::data::batches(indices, 32)) { ... }
/// }
/// \endcode
class DistributedSampler {
 public:
  /// The replicas to shard over, shuffle, seed and drop_last (data::SamplerOptions).
  using Options = SamplerOptions;

  /// Throws paratrain::error if dataset_size < 0, num_replicas < 1, or rank lies
  /// outside [0, num_replicas).
  DistributedSampler(std::int64_t dataset_size, Options options)
      : dataset_size_(dataset_size), options_(options) {
    validate();
    set_epoch(0);
  }

  /// Chooses the permutation of the next indices() call (a no-op unless shuffling), and
  /// where in it they begin: `start` positions of the epoch's order were already visited
  /// by all ranks together, as when a run resumes from a checkpoint (Note [Resuming
  /// mid-epoch]). Throws paratrain::error if start < 0.
  void set_epoch(std::int64_t epoch, std::int64_t start = 0) {
    if (start < 0) throw error("DistributedSampler", static_cast<int>(options_.rank), "start must be >= 0");
    epoch_ = epoch;
    deal_ = detail::Deal::of(dataset_size_, start, options_.num_replicas, options_.drop_last);
  }
  [[nodiscard]] std::int64_t epoch() const noexcept { return epoch_; }
  /// The position in the epoch's order where this epoch's indices begin (set_epoch's start).
  [[nodiscard]] std::int64_t start() const noexcept { return deal_.start; }

  /// This rank's indices for the current epoch: size() of them, each in
  /// [0, dataset_size). Costs O(dataset_size), since every rank draws the whole
  /// permutation and keeps its share.
  [[nodiscard]] std::vector<std::int64_t> indices() const {
    const auto order = epoch_order();
    return deal_.mine(order.data(), dataset_size_, options_.rank, options_.num_replicas);  // Note [Padding]
  }

  /// The number of indices each rank gets this epoch (PyTorch's `num_samples`, `len()`).
  [[nodiscard]] std::int64_t size() const noexcept { return deal_.per_replica; }
  /// Where the padded or truncated order shared out among ranks ends (PyTorch's
  /// `total_size` when start is 0): start() + size() * num_replicas.
  [[nodiscard]] std::int64_t total_size() const noexcept { return deal_.end; }
  [[nodiscard]] std::int64_t dataset_size() const noexcept { return dataset_size_; }
  [[nodiscard]] const Options& options() const noexcept { return options_; }

 private:
  void validate() const {
    detail::check_shard("DistributedSampler", dataset_size_, options_.num_replicas, options_.rank);
  }

  // The whole epoch's order, before padding or truncation.
  [[nodiscard]] std::vector<std::int64_t> epoch_order() const {
    return detail::epoch_order(dataset_size_, options_.shuffle, options_.seed, epoch_);
  }

  std::int64_t dataset_size_;
  Options options_;
  std::int64_t epoch_ = 0;
  detail::Deal deal_;
};

}  // namespace paratrain::data
