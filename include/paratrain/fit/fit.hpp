#pragma once
/// \file
/// paratrain::fit — the one training loop, the same for every strategy. Its parts: options.hpp
/// (what it is told and reports), evaluate.hpp, lr_schedule.hpp, checkpoints.hpp,
/// progress.hpp, metrics.hpp, trainer.hpp (the loop).

#include <concepts>
#include <cstdint>
#include <string>
#include <utility>

#include "paratrain/concepts/dataset.hpp"
#include "paratrain/concepts/sampler.hpp"
#include "paratrain/concepts/strategy.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/data/deterministic_sampler.hpp"
#include "paratrain/data/distributed_sampler.hpp"
#include "paratrain/data/tensor_dataset.hpp"
#include "paratrain/fit/evaluate.hpp"
#include "paratrain/fit/global_batch.hpp"
#include "paratrain/fit/options.hpp"
#include "paratrain/fit/preflight.hpp"
#include "paratrain/fit/trainer.hpp"

namespace paratrain {

namespace detail {

/// fit's loop with the sampler fit builds (deterministic mode's, or `Sampler`), keeping
/// `journal` where given (elastic::fit's).
template <class Sampler, strategy S, class D, class Loss>
FitResult fit_built(S& s, const D& train, const FitOptions& options, Loss& loss, Journal* journal) {
  FitOptions o = resolved(s, options);  // Note [fit's defaults]
  check_same_data(s, train);
  auto from = resume_point(s, o.checkpoint);
  o = dealt(s, o, from, deterministic_mode(s));  // Note [The global batch]
  const auto n = static_cast<std::int64_t>(train.size());
  if constexpr (deterministic_strategy<S>) {
    if (deterministic_mode(s)) {
      if constexpr (!std::same_as<Sampler, data::DistributedSampler>) {
        throw error("fit", s.rank(),
                    "the strategy is in deterministic mode, whose global batches fit deals itself "
                    "(data::DeterministicSampler); leave fit's Sampler at its default");
      } else {
        auto order = deterministic_sampler(s, n, o);
        o.batch_size = order.batch_size();
        return Trainer<S, D, Loss>(s, train, AnySampler(std::move(order)), o, loss, std::move(from), journal).run();
      }
    }
  }
  return Trainer<S, D, Loss>(s, train, AnySampler(Sampler(n, sampler_options(s, o))), o, loss, std::move(from), journal)
      .run();
}

}  // namespace detail

/// Trains `s` on `train`, any paratrain::dataset, for `options.epochs` epochs: the same
/// loop for every strategy (Note [One loop for every strategy]).
///
/// Each data-parallel replica visits its shard of the training set as the `Sampler` type
/// deals it, built from the set's size and data::SamplerOptions (the strategy's replicas,
/// FitOptions' shuffle, seed and drop_last): by default DistributedSampler, PyTorch's
/// sharding, so results match a PyTorch run with the same seed; data::SequentialSampler
/// reads each replica's block in order. `options.accumulation` micro-batches of
/// `options.batch_size` make an optimizer step, all given to the strategy's step at once;
/// replicas that run out of batches join the others. A data::Loader with
/// `options.loader.workers` threads reads the next batches while a step computes. After
/// each epoch the evaluation set, if any, is sharded exactly (every sample once) and loss
/// and accuracy are reduced over all ranks.
///
/// Collective: every rank calls fit with the same options.
///
/// \code
///   auto result = paratrain::fit(strategy, train, {.epochs = 5, .batch_size = 64, .eval = &test});
///   auto blocks = paratrain::fit<paratrain::data::SequentialSampler>(strategy, train, options);
/// \endcode
template <class Sampler = data::DistributedSampler, strategy S, class D, class Loss = CrossEntropy>
FitResult fit(S& s, const D& train, const FitOptions& options, Loss loss = {}) {
  static_assert(dataset<D>,
                "paratrain::fit: the training set is not a paratrain::dataset; give it `std::int64_t size() const` and "
                "`paratrain::Batch get(const at::Tensor& indices) const`, or hold the data in a data::TensorDataset");
  static_assert(detail::explain_loss<S, Loss>());
  static_assert(sampler<Sampler>,
                "paratrain::fit<Sampler>: Sampler is not a paratrain::sampler; give it `indices() const` (a range of "
                "integers), `size() const` and `set_epoch(std::int64_t)`");
  static_assert(std::constructible_from<Sampler, std::int64_t, data::SamplerOptions>,
                "paratrain::fit<Sampler>: fit builds the sampler as Sampler(dataset_size, data::SamplerOptions); give "
                "it that constructor, or build the sampler yourself and pass it: fit(strategy, train, sampler, options)");
  if constexpr (dataset<D> && sampler<Sampler> && detail::loss_of_strategy<Loss, S> &&
                std::constructible_from<Sampler, std::int64_t, data::SamplerOptions>)
    return detail::fit_built<Sampler>(s, train, options, loss, nullptr);
  else
    return {};  // unreachable: the assertions above failed
}

/// Trains as above, each replica visiting what `sampler` gives it: a sampler built by the
/// caller, already sharded over the strategy's replicas (`s.data_shard()`), such as a
/// data::WeightedSampler. fit calls its set_epoch at the start of each epoch. Its indices
/// must lie in [0, train.size()).
///
/// \code
///   const auto shard = strategy.data_shard();
///   paratrain::data::WeightedSampler balanced(weights, {.num_replicas = shard.count, .rank = shard.index});
///   auto result = paratrain::fit(strategy, train, balanced, {.epochs = 5});
/// \endcode
template <strategy S, class D, class Sampler, class Loss = CrossEntropy>
FitResult fit(S& s, const D& train, Sampler order, const FitOptions& options, Loss loss = {}) {
  static_assert(dataset<D>,
                "paratrain::fit: the training set is not a paratrain::dataset; give it `std::int64_t size() const` and "
                "`paratrain::Batch get(const at::Tensor& indices) const`, or hold the data in a data::TensorDataset");
  static_assert(detail::explain_loss<S, Loss>());
  static_assert(sampler<Sampler>,
                "paratrain::fit: the third argument is not a paratrain::sampler; give it `indices() const` (a range "
                "of integers), `size() const` and `set_epoch(std::int64_t)`");
  if constexpr (dataset<D> && sampler<Sampler> && detail::loss_of_strategy<Loss, S>) {
    FitOptions o = detail::resolved(s, options);  // Note [fit's defaults]
    detail::check_same_data(s, train);
    detail::agree(s, "fit", detail::sampler_mismatch(s, train, order));
    if constexpr (std::same_as<Sampler, data::DeterministicSampler>) {
      // Its global batch is the run's; each rank takes its shards' samples in one batch.
      if (o.global_batch_size == 0) o.global_batch_size = order.options().global_batch;
      o.accumulation = 1;
    } else if (detail::deterministic_mode(s)) {
      throw error("fit", s.rank(),
                  "the strategy is in deterministic mode, whose steps cut each global batch into virtual shards: "
                  "give fit no sampler (it deals them itself) or a data::DeterministicSampler");
    }
    auto from = detail::resume_point(s, o.checkpoint);
    constexpr bool sharded = std::same_as<Sampler, data::DeterministicSampler>;
    o = detail::dealt(s, o, from, sharded);  // Note [The global batch]
    if constexpr (sharded) {
      if (o.global_batch_size != order.options().global_batch)
        throw error("fit", s.rank(),
                    "the DeterministicSampler deals global batches of " +
                        std::to_string(order.options().global_batch) + ", but the run's is " +
                        std::to_string(o.global_batch_size) + " (FitOptions::global_batch_size or the checkpoint's)");
      o.batch_size = order.batch_size();
    }
    return detail::Trainer<S, D, Loss>(s, train, detail::AnySampler(std::move(order)), o, loss, std::move(from)).run();
  } else {
    return {};  // unreachable: the assertions above failed
  }
}

}  // namespace paratrain
