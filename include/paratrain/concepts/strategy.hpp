#pragma once
/// \file
/// paratrain::strategy — what the one training loop, paratrain::fit, asks of a strategy.

#include <ATen/core/Tensor.h>
#include <torch/optim/optimizer.h>

#include <concepts>
#include <cstdint>
#include <type_traits>

#include "paratrain/comm/reduce_op.hpp"
#include "paratrain/data/batch.hpp"

namespace paratrain {

/// What one training step did, as seen from this rank.
struct StepResult {
  double loss = 0;             ///< mean loss over this rank's samples (0 if it had none)
  std::int64_t samples = 0;    ///< this rank's samples
  double global_samples = 0;   ///< samples over all ranks: the step's effective batch
  int ranks_with_next = 0;     ///< ranks that have another batch (see join)
  double grad_norm = 0;        ///< global gradient 2-norm before clipping, when clipping is on
};

/// The loss a strategy is given: mean loss of a batch from the model's output and the targets.
template <class L>
concept loss_function = std::invocable<L&, const at::Tensor&, const at::Tensor&> &&
    std::convertible_to<std::invoke_result_t<L&, const at::Tensor&, const at::Tensor&>, at::Tensor>;

/// A way of training one model on one or more ranks: DataParallel, LocalDataParallel, ...
///
/// - `step(batch, loss, has_next)`: forward, backward and one optimizer step over the
///   samples of every rank, equal to one step of single-device training on all of them;
/// - `accumulate(batch, loss)`: forward and backward only, no communication, for
///   gradient accumulation (the next `step` includes these samples);
/// - `join(has_next)`: for a rank that has run out of batches while others have not;
/// - `predict(input)`: the model's output, without gradients, in evaluation mode;
/// - `all_reduce(t, op)`: reduce a tensor over the strategy's ranks (for metrics);
/// - `synchronize()`: make every rank's model evaluate alike (buffers); collective.
template <class S>
concept strategy = requires(S& s, const Batch& b, const at::Tensor& x, at::Tensor& t,
                            at::Tensor (*loss)(const at::Tensor&, const at::Tensor&)) {
  typename S::model_type;
  { s.rank() } -> std::same_as<int>;
  { s.world_size() } -> std::same_as<int>;
  { s.step(b, loss, true) } -> std::same_as<StepResult>;
  { s.accumulate(b, loss) } -> std::same_as<double>;
  { s.join(false) } -> std::same_as<StepResult>;
  { s.predict(x) } -> std::same_as<at::Tensor>;
  s.all_reduce(t, reduce_op::sum);
  s.synchronize();
  requires std::derived_from<std::remove_cvref_t<decltype(s.optimizer())>, torch::optim::Optimizer>;
};

}  // namespace paratrain
