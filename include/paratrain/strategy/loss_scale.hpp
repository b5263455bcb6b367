#pragma once
/// \file
/// paratrain::LossScaling and paratrain::LossScaler — dynamic loss scaling for fp16, as
/// PyTorch's GradScaler does it, agreed on every rank.

#include <cmath>
#include <cstdint>
#include <string>

#include "paratrain/core/error.hpp"

namespace paratrain {

// Note [Loss scaling]
// ~~~~~~~~~~~~~~~~~~~
// fp16's smallest normal number is 6e-5: small gradients of an fp16 forward underflow to 0.
// So the loss is multiplied by a scale S before backward (every gradient is then S times
// larger), and the gradients divided by S again before anything reads them. What S
// multiplies is GradScaler's: the mean loss of the samples a backward pass sees (under
// PyTorch's DDP, the rank's own batch), so that the same S gives an fp16 backward the same
// gradients, and overflows where GradScaler's would.
// Each rank back-propagates its mean loss times n (its samples: Note [Exact averaging])
// times S / u, where u, the step's loss unit, is the largest power of two <= the samples of
// the rank's first backward pass in the step: per sample, S / u, which is GradScaler's S / n
// where the pass has those samples and they are a power of two, and at most twice it where
// they are not (one backoff more, at most; a later micro-batch larger than the first gets
// proportionally more). Before its buckets are summed, each rank multiplies them by its u
// (GradientBuckets::set_input_factor), so that the sums are S times the sums over the
// samples, as if u were 1, and they are divided by (global samples) x S in the one division
// they always get, before clipping and the NaN check. u is a power of two, so multiplying and
// dividing by it rounds nothing in fp32: a scaled step equals the unscaled one bit for bit,
// and ranks with different units (different batch sizes) give the sums the same bits, unless
// some fp16 value underflows or overflows at one unit and not at another, which is what the
// scale is there to prevent. Two exceptions: in deterministic mode each shard's pass takes the
// unit of its own samples, so that a shard computes the same whichever rank runs it (Note
// [Deterministic training]); under expert parallelism the unit is 1 (S scales the samples'
// sum), since an expert's gradient gathers tokens of every rank of its group inside backward,
// and their batches, so their units, may differ.
// A scale too large makes some gradient Inf or NaN: the step's existing check of the reduced
// gradients (GradientBuckets::totals, summed over every rank, shard and pipeline stage) finds
// it on every rank at once, every rank skips the optimizer step and halves S; after
// `growth_interval` clean steps in a row every rank doubles it. The decision depends only on
// agreed numbers, so the ranks' scales never differ. PyTorch's GradScaler keeps one scale
// per process and relies on DDP having averaged the gradients first; the result is the same.
// The gradients the scaled backward produces are fp32 (the parameters are), and the buckets
// are summed in fp32 or bf16 (Precision::reduce; fp16 is refused: its 65504 would overflow on
// sums of scaled gradients long before the scale needs to back off).
// Without the unit (n x S, the sum's scale), the first GPU run (an H200) found the fp16
// backward of a batch of 40 at S = 2^16 overflowing where GradScaler's did not: the logits'
// gradients reached (p - y) x 2^16 > 65504.

/// GradScaler's parameters (torch.amp.GradScaler's defaults).
struct LossScaling {
  double init_scale = 65536.0;  ///< 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  std::int64_t growth_interval = 2000;  ///< clean steps in a row before the scale grows
};

/// The scale and its update: torch._amp_update_scale_, step for step. The scale is kept in
/// fp32, as GradScaler's tensor is, so that it stops growing where PyTorch's does (below
/// fp32's largest number).
class LossScaler {
 public:
  /// Off: a scale of 1 that never changes.
  LossScaler() = default;
  explicit LossScaler(const LossScaling& s) : options_(s), active_(true), scale_(static_cast<float>(s.init_scale)) {
    if (!(s.init_scale > 0) || !std::isfinite(scale_) || !(s.growth_factor > 1) || !(s.backoff_factor > 0) ||
        !(s.backoff_factor < 1) || s.growth_interval < 1)
      throw error("LossScaling", -1,
                  "init_scale must be finite and > 0, growth_factor > 1, 0 < backoff_factor < 1 and growth_interval "
                  ">= 1");
  }

  [[nodiscard]] bool active() const noexcept { return active_; }
  /// What the loss is multiplied by before backward.
  [[nodiscard]] double scale() const noexcept { return scale_; }
  /// Clean steps in a row since the scale last changed.
  [[nodiscard]] std::int64_t growth_tracker() const noexcept { return tracker_; }

  /// After a step: backs off when its gradients held Inf or NaN (the step was skipped),
  /// else counts a clean step and grows the scale after `growth_interval` of them (unless
  /// the grown scale would be Inf).
  void update(bool found_nonfinite) {
    if (!active_) return;
    if (found_nonfinite) {
      scale_ *= static_cast<float>(options_.backoff_factor);
      tracker_ = 0;
      return;
    }
    if (++tracker_ == options_.growth_interval) {
      if (const float grown = scale_ * static_cast<float>(options_.growth_factor); std::isfinite(grown)) scale_ = grown;
      tracker_ = 0;
    }
  }

  /// Sets the state a checkpoint kept (scale(), growth_tracker()).
  void restore(double scale, std::int64_t tracker) {
    if (!active_) return;
    if (!(scale > 0) || !std::isfinite(static_cast<float>(scale)) || tracker < 0)
      throw error("LossScaler", -1, "a checkpoint's loss scale must be finite and > 0 and its growth tracker >= 0");
    scale_ = static_cast<float>(scale);
    tracker_ = tracker;
  }

 private:
  LossScaling options_{};
  bool active_ = false;
  float scale_ = 1.0F;
  std::int64_t tracker_ = 0;
};

namespace detail {
/// The loss unit of a step whose first backward pass has `samples` samples: the largest power
/// of two <= samples, at least 1 (Note [Loss scaling]).
inline double loss_unit(std::int64_t samples) {
  return samples < 1 ? 1.0 : std::ldexp(1.0, std::ilogb(static_cast<double>(samples)));
}
}  // namespace detail

}  // namespace paratrain
