#pragma once
/// \file
/// paratrain::data::DeterministicSampler — the global batches of deterministic mode, each
/// rank given the samples of its virtual shards.

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "paratrain/core/error.hpp"
#include "paratrain/core/shard_plan.hpp"
#include "paratrain/data/detail/epoch_order.hpp"
#include "paratrain/data/detail/shard_checks.hpp"

namespace paratrain::data {

/// The sampler of deterministic mode (Note [Deterministic training]): the epoch's order
/// (DistributedSampler's: `randperm(dataset_size)` seeded with `seed + epoch`, or 0, 1, ...)
/// is cut into global batches of `global_batch` samples, the same at every world size; each
/// into `shards` virtual shards (ShardPlan), and rank r gets, step after step,
/// the samples of shards r, r + num_replicas, ... in that order: batch_size() of them
/// (ranks may differ by a few). The order is padded by repeating it from the start to a
/// whole number of global batches, or with `drop_last` truncated to one.
///
/// \code
///   const data::DeterministicSampler sampler(dataset.size(), {.global_batch = 96, .shards = 12,
///       .num_replicas = world, .rank = rank, .seed = 42});
///   const auto mine = sampler.indices();
///   for (auto batch : data::batches(mine, sampler.batch_size())) s.step(dataset.get(batch), loss);
/// \endcode
class DeterministicSampler {
 public:
  struct Options {
    /// Samples of each step over all ranks: the same whatever the world size.
    std::int64_t global_batch = 0;
    /// DataParallelOptions::deterministic.shards: a multiple of num_replicas, at most global_batch.
    std::int64_t shards = 0;
    std::int64_t num_replicas = 0;
    std::int64_t rank = -1;
    bool shuffle = true;
    std::uint64_t seed = 0;
    bool drop_last = false;
  };

  /// Throws paratrain::error on a size, world or plan that cannot be.
  DeterministicSampler(std::int64_t dataset_size, Options options) : dataset_size_(dataset_size), options_(options) {
    detail::check_shard("DeterministicSampler", dataset_size, options.num_replicas, options.rank);
    const auto fail = [&](const std::string& why) {
      throw error("DeterministicSampler", static_cast<int>(options.rank), why);
    };
    if (options.shards < 1 || options.shards % options.num_replicas != 0)
      fail("shards is " + std::to_string(options.shards) + "; it must be a positive multiple of num_replicas (" +
           std::to_string(options.num_replicas) + ")");
    if (options.global_batch < options.shards)
      fail("global_batch is " + std::to_string(options.global_batch) + "; it must be at least shards (" +
           std::to_string(options.shards) + "), one sample a shard");
    set_epoch(0);
  }

  /// The next indices() are epoch `epoch`'s, from position `start` of its order (a
  /// resumed run: the samples every rank visited before, a multiple of global_batch).
  void set_epoch(std::int64_t epoch, std::int64_t start = 0) {
    if (start < 0 || start % options_.global_batch != 0)
      throw error("DeterministicSampler", static_cast<int>(options_.rank),
                  "start is " + std::to_string(start) + "; it must be a multiple of global_batch (" +
                      std::to_string(options_.global_batch) + ")");
    epoch_ = epoch;
    start_ = start;
  }
  [[nodiscard]] std::int64_t epoch() const noexcept { return epoch_; }

  /// Global batches (steps) in an epoch, from start.
  [[nodiscard]] std::int64_t steps() const noexcept {
    const auto b = options_.global_batch;
    const auto whole = options_.drop_last ? dataset_size_ / b : (dataset_size_ + b - 1) / b;
    return std::max<std::int64_t>(0, whole - start_ / b);
  }
  /// This rank's samples in each step.
  [[nodiscard]] std::int64_t batch_size() const noexcept {
    return ShardPlan(options_.global_batch, options_.shards)
        .rank_samples(options_.rank, options_.num_replicas);
  }
  /// This rank's indices this epoch: batch_size() for each of steps().
  [[nodiscard]] std::int64_t size() const noexcept { return steps() * batch_size(); }

  [[nodiscard]] std::vector<std::int64_t> indices() const {
    const auto order = epoch_order();
    const ShardPlan plan(options_.global_batch, options_.shards);
    std::vector<std::int64_t> mine;
    mine.reserve(static_cast<std::size_t>(size()));
    const auto n = static_cast<std::int64_t>(order.size());
    for (std::int64_t step = 0; step < steps(); ++step) {
      const auto base = start_ + step * options_.global_batch;
      for (auto k = options_.rank; k < options_.shards; k += options_.num_replicas)
        for (std::int64_t i = 0; i < plan.size(k); ++i)
          mine.push_back(order[static_cast<std::size_t>((base + plan.offset(k) + i) % n)]);  // padded: from the start
    }
    return mine;
  }
  [[nodiscard]] std::int64_t dataset_size() const noexcept { return dataset_size_; }
  [[nodiscard]] const Options& options() const noexcept { return options_; }

 private:
  [[nodiscard]] std::vector<std::int64_t> epoch_order() const {
    return detail::epoch_order(dataset_size_, options_.shuffle, options_.seed, epoch_);
  }

  std::int64_t dataset_size_;
  Options options_;
  std::int64_t epoch_ = 0;
  std::int64_t start_ = 0;
};

}  // namespace paratrain::data
