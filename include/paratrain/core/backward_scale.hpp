#pragma once
/// \file
/// paratrain::BackwardScale — the factor the running strategy multiplies a loss by before its
/// backward pass: what a layer that adds a loss of its own in backward scales that loss by
/// (Note [Auxiliary loss in backward], experts/mixture_of_experts.hpp).

namespace paratrain {

/// While one exists on this thread, the forwards it encloses belong to a loss that will be
/// multiplied by `factor` before backward: a strategy's sample count times its loss scale (Note
/// [Exact averaging], Note [Loss scaling]). Outside any, 1: the loss's backward as the user
/// calls it. Scopes nest; the innermost counts.
class BackwardScale {
 public:
  explicit BackwardScale(double factor) noexcept : outer_(current_) { current_ = factor; }
  BackwardScale(const BackwardScale&) = delete;
  BackwardScale& operator=(const BackwardScale&) = delete;
  ~BackwardScale() { current_ = outer_; }

  /// The innermost scope's factor on this thread; 1 outside any.
  [[nodiscard]] static double current() noexcept { return current_; }

 private:
  double outer_;
  static inline thread_local double current_ = 1.0;
};

}  // namespace paratrain
