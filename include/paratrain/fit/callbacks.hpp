#pragma once
/// \file
/// The callbacks fit makes from its options (Note [Loop callbacks]): early stopping,
/// reduce-on-plateau, the best checkpoint, the time limit, and on_step / on_epoch.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <optional>
#include <string>
#include <utility>

#include "paratrain/core/error.hpp"
#include "paratrain/fit/callback.hpp"
#include "paratrain/fit/lr_schedule.hpp"
#include "paratrain/fit/monitor.hpp"
#include "paratrain/fit/options.hpp"

namespace paratrain {

namespace detail {

/// The value of a Monitor's name after an epoch: the same on every rank. Throws naming the
/// names there are for one there is not.
inline double monitored(const EpochInfo& info, const std::string& name, int rank) {
  if (name == "train_loss") return info.train_loss;
  if (name == "eval_loss") return info.eval_loss;
  if (name == "eval_accuracy") return info.eval_accuracy;
  if (name.starts_with("eval_"))
    if (const auto it = info.eval_metrics.find(name.substr(5)); it != info.eval_metrics.end()) return it->second;
  if (const auto it = info.metrics.find(name); it != info.metrics.end()) return it->second;
  std::string known = "train_loss, eval_loss, eval_accuracy";
  for (const auto& [m, v] : info.eval_metrics) known += ", eval_" + m;
  for (const auto& [m, v] : info.metrics) known += ", " + m;
  throw error("fit", rank, "the monitored value '" + name + "' is not one this epoch has (" + known + ")");
}

/// Refuses a monitored `eval_` value without an evaluation set.
inline void check_monitor(const Monitor& m, bool has_eval, int rank) {
  if (m.name.starts_with("eval_") && !has_eval)
    throw error("fit", rank, "the monitored value '" + m.name + "' needs an evaluation set (FitOptions::eval)");
}

/// Whether an epoch's values are ones a monitor may judge: it ran whole, and was evaluated
/// where an evaluation set was given (not when stopping for time skipped it).
inline bool judged(const EpochInfo& info) { return info.complete && !info.evaluation_skipped; }

/// The steady-clock time at which `limit` runs out for a run starting at `start`: the
/// sooner of its own seconds and the SLURM job's end; none without either.
inline std::optional<std::chrono::steady_clock::time_point> deadline_of(const TimeLimit& limit,
                                                                        std::chrono::steady_clock::time_point start,
                                                                        int rank) {
  if (limit.seconds < 0 || limit.reserve_seconds < 0)
    throw error("fit", rank, "time_limit.seconds and time_limit.reserve_seconds must be >= 0");
  std::optional<std::chrono::steady_clock::time_point> deadline;
  const auto sooner = [&](std::chrono::steady_clock::time_point t) { deadline = deadline ? std::min(*deadline, t) : t; };
  if (limit.seconds > 0)
    sooner(start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(limit.seconds)));
  if (const char* end = std::getenv("SLURM_JOB_END_TIME"); limit.slurm && end != nullptr && *end != '\0') {
    char* stop = nullptr;
    const double unix_end = std::strtod(end, &stop);
    if (stop == end || *stop != '\0' || !std::isfinite(unix_end))
      throw error("fit", rank, std::string("SLURM_JOB_END_TIME is '") + end + "', not a number of seconds");
    const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    sooner(std::chrono::steady_clock::now() +
           std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(unix_end - now)));
  }
  return deadline;
}

/// The reason fit reports when its time limit stops it.
inline constexpr const char* time_limit_reason = "time limit";
/// Why fit stops at a checkpoint where ranks wait to join an elastic job (elastic::fit).
inline constexpr const char* joining_reason = "ranks are waiting to join";

}  // namespace detail

namespace callbacks {

/// Stops when the monitored value has not improved by more than `min_delta` for `patience`
/// epochs in a row (FitOptions::early_stopping; Lightning's EarlyStopping).
class EarlyStopping {
 public:
  EarlyStopping(paratrain::EarlyStopping options, bool has_eval, int rank) : o_(std::move(options)) {
    if (o_.patience < 1 || o_.min_delta < 0)
      throw error("fit", rank, "early_stopping.patience must be >= 1 and min_delta >= 0");
    detail::check_monitor(o_.monitor, has_eval, rank);
    rank_ = rank;
  }
  void after_epoch(const EpochInfo& info, LoopControl& control) {
    if (!detail::judged(info)) return;
    const double v = detail::monitored(info, o_.monitor.name, rank_);
    if (detail::improves(o_.monitor.goal, v, best_, o_.min_delta)) best_ = v, bad_ = 0;
    else ++bad_;
    if (bad_ >= o_.patience) {
      char best[32];
      std::snprintf(best, sizeof best, "%.6g", best_);
      control.stop("early stopping: " + o_.monitor.name + " has not improved by more than " + number(o_.min_delta) +
                   " for " + std::to_string(o_.patience) + " epochs (best " + best + ")");
    }
  }
  void save(CallbackState& s) const { s["early_stopping.best"] = best_, s["early_stopping.bad"] = double(bad_); }
  void load(const CallbackState& s) {
    if (const auto it = s.find("early_stopping.best"); it != s.end()) best_ = it->second;
    if (const auto it = s.find("early_stopping.bad"); it != s.end()) bad_ = static_cast<std::int64_t>(it->second);
  }

 private:
  static std::string number(double x) {
    char text[32];
    std::snprintf(text, sizeof text, "%g", x);
    return text;
  }
  paratrain::EarlyStopping o_;
  int rank_ = 0;
  double best_ = std::numeric_limits<double>::quiet_NaN();
  std::int64_t bad_ = 0;
};

/// Cuts the learning rate by `factor` (down to `min_factor`) after more than `patience`
/// epochs without improvement, as PyTorch's ReduceLROnPlateau counts them, then counts
/// afresh (FitOptions::reduce_on_plateau).
class ReduceOnPlateau {
 public:
  ReduceOnPlateau(lr::ReduceOnPlateau options, bool has_eval, int rank) : o_(std::move(options)) {
    if (o_.patience < 0 || o_.min_delta < 0 || o_.factor <= 0 || o_.factor >= 1 || o_.min_factor < 0)
      throw error("fit", rank,
                  "reduce_on_plateau needs patience >= 0, min_delta >= 0, 0 < factor < 1 and min_factor >= 0");
    detail::check_monitor(o_.monitor, has_eval, rank);
    rank_ = rank;
  }
  void after_epoch(const EpochInfo& info, LoopControl&) {
    if (!detail::judged(info)) return;
    const double v = detail::monitored(info, o_.monitor.name, rank_);
    if (detail::improves(o_.monitor.goal, v, best_, o_.min_delta)) {
      best_ = v, bad_ = 0;
    } else if (++bad_ > o_.patience) {
      factor_ = std::max(factor_ * o_.factor, o_.min_factor);
      bad_ = 0;
    }
  }
  [[nodiscard]] double learning_rate_factor() const noexcept { return factor_; }
  void save(CallbackState& s) const {
    s["plateau.factor"] = factor_, s["plateau.best"] = best_, s["plateau.bad"] = double(bad_);
  }
  void load(const CallbackState& s) {
    if (const auto it = s.find("plateau.factor"); it != s.end()) factor_ = it->second;
    if (const auto it = s.find("plateau.best"); it != s.end()) best_ = it->second;
    if (const auto it = s.find("plateau.bad"); it != s.end()) bad_ = static_cast<std::int64_t>(it->second);
  }

 private:
  lr::ReduceOnPlateau o_;
  int rank_ = 0;
  double factor_ = 1;
  double best_ = std::numeric_limits<double>::quiet_NaN();
  std::int64_t bad_ = 0;
};

/// Keeps the checkpoint of the best epoch by a monitored value (CheckpointOptions::best).
class KeepBest {
 public:
  KeepBest(Monitor monitor, bool has_eval, int rank) : monitor_(std::move(monitor)), rank_(rank) {
    detail::check_monitor(monitor_, has_eval, rank);
  }
  void after_epoch(const EpochInfo& info, LoopControl& control) {
    if (!detail::judged(info)) return;
    const double v = detail::monitored(info, monitor_.name, rank_);
    if (detail::improves(monitor_.goal, v, best_)) {
      best_ = v;
      control.keep_as_best();
    }
  }
  void save(CallbackState& s) const { s["best.value"] = best_; }
  void load(const CallbackState& s) {
    if (const auto it = s.find("best.value"); it != s.end()) best_ = it->second;
  }

 private:
  Monitor monitor_;
  int rank_;
  double best_ = std::numeric_limits<double>::quiet_NaN();
};

// Note [Ending before the time limit]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A job killed by its scheduler loses everything since its last checkpoint, and a
// checkpoint cut off mid-write is no checkpoint. So fit ends itself first: after each step
// each rank asks whether the time left (to TimeLimit::seconds from fit's start, or to
// SLURM_JOB_END_TIME, whichever is sooner) still holds one more step (the longest so far),
// the evaluation if that step ends an epoch, a save (the longest save so far) and
// TimeLimit::reserve_seconds. If any rank says no, all stop after this step (one scalar
// all-reduce per step while a limit is set), save a checkpoint where they are (mid-epoch,
// with the epoch's running metrics) and return normally: the program exits 0 and the next
// job, run with the same options, resumes there. Evaluation is skipped when stopping for
// time. Clocks are read per rank; the decision is agreed, so no rank trains a step alone.
// The limit is a callback (Note [Loop callbacks]): callbacks::TimeLimit.

/// Stops after a step when the time left no longer holds one more step (the longest so
/// far), the evaluation if that step ends an epoch, a save and the reserve (Note [Ending
/// before the time limit]); each rank asks its own clock, the loop agrees.
class TimeLimit {
 public:
  TimeLimit(std::chrono::steady_clock::time_point deadline, double reserve_seconds)
      : deadline_(deadline), reserve_(reserve_seconds) {}
  void after_step(const StepInfo&, LoopControl& control) {
    const auto& t = control.times();
    const double need = (t.epoch_ends ? 0.0 : t.longest_step) + (t.epoch_ends || t.next_ends_epoch ? t.last_eval : 0.0) +
                        t.longest_save + reserve_;
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(need));
    if (until >= deadline_) control.stop(detail::time_limit_reason);
  }

 private:
  std::chrono::steady_clock::time_point deadline_;
  double reserve_;
};

/// FitOptions::on_step as a callback: its StepInfo::stop requests become the loop's.
class OnStep {
 public:
  explicit OnStep(std::function<void(const StepInfo&)> f) : f_(std::move(f)) {}
  void after_step(const StepInfo& info, LoopControl& control) {
    f_(info);
    if (info.stop != nullptr && info.stop->requested()) control.stop(info.stop->why());
  }

 private:
  std::function<void(const StepInfo&)> f_;
};

/// FitOptions::on_epoch as a callback: its EpochInfo::stop requests become the loop's.
class OnEpoch {
 public:
  explicit OnEpoch(std::function<void(const EpochInfo&)> f) : f_(std::move(f)) {}
  void after_epoch(const EpochInfo& info, LoopControl& control) {
    f_(info);
    if (info.stop != nullptr && info.stop->requested()) control.stop(info.stop->why());
  }

 private:
  std::function<void(const EpochInfo&)> f_;
};

}  // namespace callbacks
}  // namespace paratrain
