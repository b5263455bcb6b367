#pragma once
/// \file
/// paratrain::strategy — what the one training loop, paratrain::fit, asks of a strategy.

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <concepts>
#include <cstdint>
#include <span>
#include <type_traits>

#include "paratrain/core/reduce_op.hpp"
#include "paratrain/core/batch.hpp"
#include "paratrain/core/step_result.hpp"
#include "paratrain/core/timeline.hpp"
#include "paratrain/concepts/loss.hpp"

namespace paratrain {

/// A way of training one model on one or more ranks: DataParallel (DDP, ZeRO), a
/// pipeline of stages, LocalDataParallel, ...
///
/// - `output_type`: what predict returns and a batch_loss reads: a model_output;
/// - `step(micro_batches, loss, has_next)`: one optimizer step over this replica's
///   micro-batches (a span of Batch; empty for a replica that has none this step) and
///   those of every other replica, equal to one step of single-device training on all
///   of them together. A pipeline runs its schedule over them; DDP accumulates them.
/// - `join(has_next)`: for a replica that has run out of batches while others have not;
/// - `predict(batch)`: the model's output for the batch's inputs (a tensor, or a tuple of
///   them: what the model returns), without gradients, in evaluation mode; undefined
///   tensors on a rank that has no output (a pipeline's stages before the last).
///   Collective over the ranks of one replica.
/// - `data_shard()`: which replica's samples this rank trains on (DataShard);
/// - `all_reduce(t, op)`: reduce a tensor over all the strategy's ranks (for metrics);
/// - `synchronize()`: make every rank's model evaluate alike (buffers); collective;
/// - `device()`: where the strategy moves this rank's batches (its model's device; Note
///   [One move per batch]): where it is a GPU, fit's loader pins the batches and copies them
///   there beside the step (Note [Copies beside the step]).
template <class S>
concept strategy = requires(S& s, const S& cs, std::span<const Batch> micro_batches, const Batch& b, at::Tensor& t,
                            at::Tensor (*loss)(const typename S::output_type&, const Batch&)) {
  typename S::model_type;
  requires model_output<typename S::output_type>;
  { s.rank() } -> std::same_as<int>;
  { s.world_size() } -> std::same_as<int>;
  { cs.data_shard() } -> std::same_as<DataShard>;
  { s.step(micro_batches, loss, true) } -> std::same_as<StepResult>;
  { s.join(false) } -> std::same_as<StepResult>;
  { s.predict(b) } -> std::same_as<typename S::output_type>;
  s.all_reduce(t, reduce_op::sum);
  s.synchronize();
  { cs.device() } -> std::same_as<at::Device>;
  requires std::derived_from<std::remove_cvref_t<decltype(s.optimizer())>, torch::optim::Optimizer>;
};

// What some strategies offer beyond `strategy`, and the parts of paratrain that use it when
// there (fit, its observers, checkpoints): each a refinement, so that a strategy of one's
// own opts in by having the members, and a reader finds the whole interface here.

/// A strategy that scales its loss (Note [Loss scaling]): `loss_scaler()` with the scale,
/// whether it is active, its growth tracker, and restore(scale, tracker). fit keeps the
/// scale in its checkpoints and resumes it.
template <class S>
concept loss_scaled_strategy = strategy<S> && requires(S& s, double scale, std::int64_t tracker) {
  { s.loss_scaler().scale() } -> std::convertible_to<double>;
  { s.loss_scaler().active() } -> std::convertible_to<bool>;
  { s.loss_scaler().growth_tracker() } -> std::convertible_to<std::int64_t>;
  s.loss_scaler().restore(scale, tracker);
};

/// A strategy that reports each step's phases into a timeline (Note [Zero-cost timeline]):
/// fit's trace gives it one for the run and takes it back after.
template <class S>
concept traced_strategy = strategy<S> && requires(S& s, StepTimeline* timeline) {
  s.set_timeline(timeline);
};

/// A strategy that says how long its last step blocked on communication compute did not
/// hide: fit's step times and straggler report show it.
template <class S>
concept communication_timed_strategy = strategy<S> && requires(const S& s) {
  { s.exposed_communication_seconds() } -> std::convertible_to<double>;
};

/// A strategy that counts its optimizer steps (deterministic mode keys its random draws on
/// them): checkpoint::load sets the count to the checkpoint's step.
template <class S>
concept step_counted_strategy = strategy<S> && requires(S& s, const S& cs, std::int64_t steps) {
  { cs.step_count() } -> std::convertible_to<std::int64_t>;
  s.set_step_count(steps);
};

}  // namespace paratrain
