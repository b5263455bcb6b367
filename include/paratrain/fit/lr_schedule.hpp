#pragma once
/// \file
/// paratrain::LrSchedule — fit's learning-rate policy: the linear scaling rule with warm-up
/// (LrScaling) times the user's schedule (FitOptions::lr_schedule), applied to every
/// parameter group from the rates it found.

#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "paratrain/fit/options.hpp"

namespace paratrain {

/// The learning-rate factor of fit's schedule at a place in training, and its application.
///
/// The factor at optimizer step `step` (counted from the start of training), a fractional
/// `epoch` into it, of epochs `steps_per_epoch` long is
///   (1 + (B / reference_batch - 1) * min(1, step / (warmup_epochs * steps_per_epoch)))
///   * lr_schedule(epoch)
/// with B the global batch (Goyal et al. 2017, section 2.2, gradual warm-up); each group's
/// rate is its base rate (the one it had when fit began) times the factor.
class LrSchedule {
 public:
  LrSchedule(const LrScaling& scaling, std::function<double(double epoch)> schedule, double global_batch)
      : scaling_(scaling),
        schedule_(std::move(schedule)),
        target_(scaling.reference_batch > 0 ? global_batch / double(scaling.reference_batch) : 1.0) {}

  /// Whether it changes any rate: a scaling rule or a schedule is set.
  [[nodiscard]] bool active() const { return scaling_.reference_batch > 0 || bool(schedule_); }

  /// The factor at optimizer step `step`, `epoch` (fractional) into training, with epochs of
  /// `steps_per_epoch` steps.
  [[nodiscard]] double factor(std::int64_t step, double epoch, double steps_per_epoch) const {
    const double warm = scaling_.warmup_epochs * std::max(steps_per_epoch, 1.0);
    const double warmed = warm > 0 ? std::min(1.0, double(step) / warm) : 1.0;
    return (1.0 + (target_ - 1.0) * warmed) * (schedule_ ? schedule_(epoch) : 1.0);
  }

  /// Sets every group's rate to its entry of `base` times `factor`.
  static void apply(torch::optim::Optimizer& o, const std::vector<double>& base, double factor) {
    auto& groups = o.param_groups();
    for (std::size_t i = 0; i < groups.size(); ++i) groups[i].options().set_lr(base[i] * factor);
  }

  /// Every group's rate, in order: the base rates when fit begins.
  [[nodiscard]] static std::vector<double> rates(torch::optim::Optimizer& o) {
    std::vector<double> lrs;
    for (auto& g : o.param_groups()) lrs.push_back(g.options().get_lr());
    return lrs;
  }

 private:
  LrScaling scaling_;
  std::function<double(double)> schedule_;
  double target_ = 1;
};

}  // namespace paratrain
