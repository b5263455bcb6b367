#pragma once
/// \file
/// paratrain::Monitor — a value fit watches after each epoch, for early stopping and for
/// keeping the best checkpoint.

#include <cmath>
#include <string>

namespace paratrain {

/// Whether a monitored value is better when lower (a loss) or higher (an accuracy).
enum class Goal { minimize, maximize };

/// A value fit watches after each epoch's evaluation: "train_loss", "eval_loss",
/// "eval_accuracy", "eval_" + an evaluation metric's name ("eval_top5_accuracy"), or a
/// name logged through StepInfo::metrics (its epoch mean). Every rank reads the same
/// reduced value, so decisions on it agree without communication.
struct Monitor {
  std::string name{};  ///< empty: nothing monitored
  Goal goal = Goal::minimize;
};

namespace detail {

/// Whether `value` improves on `best` (NaN: nothing seen yet) by more than `min_delta`.
inline bool improves(Goal goal, double value, double best, double min_delta = 0) {
  if (std::isnan(value)) return false;
  if (std::isnan(best)) return true;
  return goal == Goal::minimize ? value < best - min_delta : value > best + min_delta;
}

}  // namespace detail
}  // namespace paratrain
