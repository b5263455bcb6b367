#pragma once
/// \file
/// paratrain::StepResult and paratrain::DataShard — what a step reports, and which part of
/// the data a rank trains on.

#include <cstdint>

namespace paratrain {

/// What one training step did, as seen from this rank.
struct StepResult {
  double loss = 0;             ///< mean loss over this rank's samples, when has_loss
  std::int64_t samples = 0;    ///< this rank's samples (its data replica's, for a pipeline stage)
  double global_samples = 0;   ///< samples over all replicas: the step's effective batch
  int ranks_with_next = 0;     ///< ranks that have another batch (see join)
  double grad_norm = 0;        ///< global gradient 2-norm before clipping, when clipping is on
  /// Whether this rank computed a loss: false on a pipeline's stages before the last,
  /// and on a rank that had no samples. A rank without one reports none: fit leaves it
  /// out of the mean rather than counting it as 0.
  bool has_loss = true;
  /// The optimizer step was skipped on every rank: the averaged gradients held NaN or Inf
  /// and DataParallelOptions::nonfinite_gradients is NonFinite::skip, or loss scaling is on
  /// (Note [Loss scaling]: its scale backs off then).
  bool skipped = false;
};

/// Which part of the data a rank trains on: its data-parallel replica `index` of `count`.
/// Ranks are not replicas: every stage of one pipeline is the same replica and sees the
/// same samples, so the sampler shards over replicas, not over ranks.
struct DataShard {
  int index = 0;
  int count = 1;
};

}  // namespace paratrain
