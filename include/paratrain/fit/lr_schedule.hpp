#pragma once
/// \file
/// Learning-rate schedules: paratrain::lr::Schedule (a multiplier at a place in training,
/// per step), the provided ones (warm-up with cosine or linear decay, step decay),
/// lr::ReduceOnPlateau, and paratrain::LrSchedule, fit's policy: the linear scaling rule with
/// warm-up (LrScaling) times the schedule, applied to every parameter group from the rates
/// it found.

#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cmath>
#include <concepts>
#include <cstdint>
#include <functional>
#include <numbers>
#include <string>
#include <utility>
#include <vector>

#include "paratrain/core/error.hpp"
#include "paratrain/fit/monitor.hpp"

namespace paratrain {

/// The linear scaling rule with gradual warm-up (Goyal et al. 2017, "Accurate, Large
/// Minibatch SGD"): the optimizer's learning rate was tuned for a global batch of
/// `reference_batch`; with a global batch of B it becomes lr * B / reference_batch,
/// reached linearly from lr over the first `warmup_epochs`.
struct LrScaling {
  std::int64_t reference_batch = 0;  ///< 0: off
  double warmup_epochs = 0;
};

namespace lr {

/// Where training is when a schedule is asked, before each optimizer step.
struct Clock {
  std::int64_t step = 0;         ///< this step, counted from 0 since the run began (a resumed run counts on)
  std::int64_t total_steps = 0;  ///< the run's steps: FitOptions::max_steps, or epochs × the longest epoch's steps
  double epoch = 0;              ///< the fractional epoch: 2.5 is half-way through the third
};

/// A multiplier of the learning rate at a place in training: a function of the Clock, or,
/// as before the Clock, of the fractional epoch alone (`[](double epoch) { ... }`). Empty:
/// constant. It must depend on nothing else, so that a resumed run sets the same rates.
class Schedule {
 public:
  Schedule() = default;
  template <class F>
    requires std::invocable<F&, const Clock&> && std::convertible_to<std::invoke_result_t<F&, const Clock&>, double>
  Schedule(F f)  // NOLINT(google-explicit-constructor): `.lr_schedule = lr::warmup_cosine(100)`
      : f_(empty(f) ? nullptr : std::function<double(const Clock&)>([f = std::move(f)](const Clock& c) mutable {
          return static_cast<double>(f(c));
        })) {}
  template <class F>
    requires(!std::invocable<F&, const Clock&>) && std::invocable<F&, double> &&
            std::convertible_to<std::invoke_result_t<F&, double>, double>
  Schedule(F f)  // NOLINT(google-explicit-constructor): `.lr_schedule = [](double epoch) { ... }`
      : f_(empty(f) ? nullptr : std::function<double(const Clock&)>([f = std::move(f)](const Clock& c) mutable {
          return static_cast<double>(f(c.epoch));
        })) {}

  [[nodiscard]] explicit operator bool() const noexcept { return bool(f_); }
  [[nodiscard]] double operator()(const Clock& c) const { return f_ ? f_(c) : 1.0; }

 private:
  template <class F>
  static bool empty(const F& f) {
    if constexpr (std::constructible_from<bool, const F&> && !std::is_class_v<F>) return !f;  // a null function pointer
    else if constexpr (requires { f == nullptr; }) return f == nullptr;                     // an empty std::function
    else return false;
  }
  std::function<double(const Clock&)> f_;
};

namespace detail {
/// How far step `s` is through the decay after `warmup` steps of `total`: 0 at its first
/// step, (total - 1 - warmup) / (total - warmup) at the run's last.
inline double decay_progress(const Clock& c, std::int64_t warmup) {
  if (c.total_steps <= warmup) return 0.0;
  return std::clamp(double(c.step - warmup) / double(c.total_steps - warmup), 0.0, 1.0);
}
inline void check_warmup(std::int64_t warmup_steps, double final_factor, const char* name) {
  if (warmup_steps < 0 || final_factor < 0)
    throw error(name, -1, "warmup_steps and final_factor must be >= 0");
}
}  // namespace detail

/// Linear warm-up over the first `warmup_steps` steps ((s + 1) / warmup_steps at step s,
/// so the first step is not wasted at rate 0), then a cosine from 1 down to `final_factor`
/// over the remaining steps of the run: final + (1 - final) · (1 + cos(π p)) / 2 with p =
/// (s - warmup) / (total_steps - warmup). Hugging Face's get_cosine_schedule_with_warmup,
/// with a floor.
inline Schedule warmup_cosine(std::int64_t warmup_steps, double final_factor = 0.0) {
  detail::check_warmup(warmup_steps, final_factor, "lr::warmup_cosine");
  return [=](const Clock& c) {
    if (c.step < warmup_steps) return double(c.step + 1) / double(warmup_steps);
    const double p = detail::decay_progress(c, warmup_steps);
    return final_factor + (1.0 - final_factor) * 0.5 * (1.0 + std::cos(std::numbers::pi * p));
  };
}

/// Linear warm-up as above, then a straight line from 1 down to `final_factor`:
/// final + (1 - final) · (1 - p).
inline Schedule warmup_linear(std::int64_t warmup_steps, double final_factor = 0.0) {
  detail::check_warmup(warmup_steps, final_factor, "lr::warmup_linear");
  return [=](const Clock& c) {
    if (c.step < warmup_steps) return double(c.step + 1) / double(warmup_steps);
    return final_factor + (1.0 - final_factor) * (1.0 - detail::decay_progress(c, warmup_steps));
  };
}

/// gamma^floor(s / every_steps): the rate multiplied by `gamma` every `every_steps` steps
/// (PyTorch's StepLR, counted in steps).
inline Schedule step_decay(std::int64_t every_steps, double gamma) {
  if (every_steps < 1 || gamma <= 0) throw error("lr::step_decay", -1, "every_steps must be >= 1 and gamma > 0");
  return [=](const Clock& c) { return std::pow(gamma, double(c.step / every_steps)); };
}

/// Multiply the rate by `factor` when the monitored value has not improved by more than
/// `min_delta` for more than `patience` epochs, then count afresh (PyTorch's
/// ReduceLROnPlateau with threshold_mode "abs", threshold min_delta, no cooldown), down to
/// `min_factor` of the scheduled rate. Decided after each epoch's evaluation from values
/// reduced over all ranks, so every rank decides alike; its state is in fit's checkpoints.
struct ReduceOnPlateau {
  Monitor monitor{};  ///< empty name: off
  double factor = 0.1;
  int patience = 10;
  double min_delta = 0;
  double min_factor = 0;
};

}  // namespace lr

/// The learning-rate factor of fit's schedule at a place in training, and its application.
///
/// The factor before optimizer step `c.step`, of epochs `steps_per_epoch` long, is
///   (1 + (B / reference_batch - 1) * min(1, step / (warmup_epochs * steps_per_epoch)))
///   * schedule(c)
/// with B the global batch (Goyal et al. 2017, section 2.2, gradual warm-up); each group's
/// rate is its base rate (the one it had when fit began) times the factor (and times
/// ReduceOnPlateau's, which fit keeps).
class LrSchedule {
 public:
  LrSchedule(const LrScaling& scaling, lr::Schedule schedule, double global_batch)
      : scaling_(scaling),
        schedule_(std::move(schedule)),
        target_(scaling.reference_batch > 0 ? global_batch / double(scaling.reference_batch) : 1.0) {}

  /// Whether it changes any rate: a scaling rule or a schedule is set.
  [[nodiscard]] bool active() const { return scaling_.reference_batch > 0 || bool(schedule_); }

  /// The factor before step `c.step`, with epochs of `steps_per_epoch` steps.
  [[nodiscard]] double factor(const lr::Clock& c, double steps_per_epoch) const {
    const double warm = scaling_.warmup_epochs * std::max(steps_per_epoch, 1.0);
    const double warmed = warm > 0 ? std::min(1.0, double(c.step) / warm) : 1.0;
    return (1.0 + (target_ - 1.0) * warmed) * schedule_(c);
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
  lr::Schedule schedule_;
  double target_ = 1;
};

}  // namespace paratrain
