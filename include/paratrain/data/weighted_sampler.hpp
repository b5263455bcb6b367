#pragma once
/// \file
/// paratrain::data::WeightedSampler — PyTorch's WeightedRandomSampler, sharded over replicas.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "paratrain/data/detail/deal.hpp"
#include "paratrain/data/detail/shard_checks.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain::data {

/// Draws `num_samples` indices per epoch with probability proportional to `weights` (one
/// non-negative weight per sample; they need not sum to 1), with or without replacement,
/// and deals them out among the replicas as DistributedSampler deals its order: replica r
/// takes draws r, r + N, r + 2N, ..., the draws padded by repeating them from the start
/// so that every replica gets ceil(num_samples / N).
///
/// The draws are PyTorch's: `torch.multinomial(weights.double(), num_samples, replacement,
/// generator)` from a CPU generator seeded with `seed + epoch`, which is what
/// `torch.utils.data.WeightedRandomSampler(weights, num_samples, replacement, generator)`
/// yields for a generator seeded so; with one replica the indices are that sampler's, index
/// for index (tests/data/sampler_reference.json). Every rank draws the same, so no
/// communication is needed.
///
/// \code
/// // class-balanced: each sample weighted by 1 / (its class's count)
/// paratrain::data::WeightedSampler sampler(weights, {.num_replicas = shard.count, .rank = shard.index,
///                                                    .num_samples = train.size(), .seed = 7});
/// auto result = paratrain::fit(strategy, train, sampler, options);
/// \endcode
class WeightedSampler {
 public:
  struct Options {
    /// The number of data-parallel replicas (strategy.data_shard().count); at least 1.
    std::int64_t num_replicas = 0;
    /// This replica (strategy.data_shard().index).
    std::int64_t rank = -1;
    /// Draws per epoch over all replicas; 0: as many as there are weights.
    std::int64_t num_samples = 0;
    /// Whether an index may be drawn more than once in an epoch.
    bool replacement = true;
    std::uint64_t seed = 0;
  };

  /// Throws paratrain::error if the weights are not a 1-D tensor of finite non-negative
  /// numbers with at least one positive, or without replacement num_samples exceeds the
  /// number of positive weights, or the shard is invalid.
  WeightedSampler(const at::Tensor& weights, Options options)
      : weights_(weights.defined() ? weights.to(at::kCPU, at::kDouble).contiguous() : weights), options_(options) {
    const auto fail = [&](const std::string& what) { throw error("WeightedSampler", -1, what); };
    if (!weights_.defined() || weights_.dim() != 1) fail("weights must be a 1-D tensor, one weight per sample");
    detail::check_shard("WeightedSampler", weights_.size(0), options_.num_replicas, options_.rank);
    if (options_.num_samples == 0) options_.num_samples = weights_.size(0);
    if (options_.num_samples < 0) fail("num_samples must be >= 0");
    const auto finite = at::isfinite(weights_).all().item<bool>();
    if (!finite || (weights_ < 0).any().item<bool>())
      fail("weights must be finite and non-negative; they are relative probabilities");
    const auto positive = (weights_ > 0).sum().item<std::int64_t>();
    if (options_.num_samples > 0 && positive == 0) fail("at least one weight must be positive");
    if (!options_.replacement && options_.num_samples > positive)
      fail("without replacement at most " + std::to_string(positive) + " samples (those of positive weight) can be "
           "drawn, not " + std::to_string(options_.num_samples));
    set_epoch(0);
  }

  /// Chooses the epoch's draws, and where in them this epoch's indices begin: `start`
  /// draws were already visited by all replicas together (a run resumed mid-epoch).
  void set_epoch(std::int64_t epoch, std::int64_t start = 0) {
    if (start < 0) throw error("WeightedSampler", static_cast<int>(options_.rank), "start must be >= 0");
    epoch_ = epoch;
    deal_ = detail::Deal::of(options_.num_samples, start, options_.num_replicas, /*drop_last=*/false);
  }
  [[nodiscard]] std::int64_t epoch() const noexcept { return epoch_; }
  [[nodiscard]] std::int64_t start() const noexcept { return deal_.start; }

  [[nodiscard]] std::vector<std::int64_t> indices() const {
    const auto n = options_.num_samples;
    if (n == 0) return {};
    const auto generator = at::make_generator<at::CPUGeneratorImpl>(options_.seed + static_cast<std::uint64_t>(epoch_));
    const auto draws = at::multinomial(weights_, n, options_.replacement, generator);
    return deal_.mine(draws.data_ptr<std::int64_t>(), n, options_.rank, options_.num_replicas);
  }

  /// Indices per replica this epoch: ceil((num_samples - start) / num_replicas).
  [[nodiscard]] std::int64_t size() const noexcept { return deal_.per_replica; }
  [[nodiscard]] const Options& options() const noexcept { return options_; }
  [[nodiscard]] std::int64_t dataset_size() const { return weights_.size(0); }

 private:
  at::Tensor weights_;
  Options options_;
  std::int64_t epoch_ = 0;
  detail::Deal deal_;
};

}  // namespace paratrain::data
