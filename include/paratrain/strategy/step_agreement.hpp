#pragma once
/// \file
/// paratrain::StepAgreement — the one small status vector that the ranks sum at the end of
/// every step to decide together what each does next (Note [Step agreement]).

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "paratrain/collectives/all_reduce_on.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/core/reduce_op.hpp"

namespace paratrain {

// Note [Step agreement]
// At the end of a step every rank must take the same decision (average by how many
// samples, stop the loop, throw, skip a parameter) although each knows only its own
// facts. The facts are packed into one vector of doubles and summed over the ranks in one
// all-reduce, after the gradients' collectives; then every rank reads the same sums:
//
//   [0] samples            this rank's samples this step (Note [Exact averaging])
//   [1] has_next           1 when this rank has another batch after this step (join)
//   [2] unused             1 when this rank found a parameter without gradient although
//                          find_unused_parameters is off (every rank throws)
//   [3] failed             1 when this rank could not take part (Note [Unusable batches]);
//                          when any rank failed, nothing else in the vector is valid
//   [4 + i] used by        with find_unused_parameters only: 1 when this rank produced a
//                          gradient for parameter i (0 everywhere: no rank used it)
//
// Sums of 0/1 entries count ranks, exactly, in a double up to 2^53 of them.

/// Collective facts about one step, the same on every rank.
struct StepStatus {
  double samples = 0;       ///< samples across all ranks this step
  int ranks_with_next = 0;  ///< ranks that have another batch after this one
  int ranks_failed = 0;     ///< ranks that could not take part (finish's `failed`); nothing else is valid then
};

/// Builds one rank's status vector (Note [Step agreement]) and, once the caller has summed
/// it over the ranks in place (`values()`, reduce_op::sum), reads the sums.
///
/// \code
///   StepAgreement a(params, find_unused);
///   a.set(samples, has_next, unused, failed);
///   a.mark_used(i);                                   // per parameter, when tracked
///   all_reduce(a.values(), reduce_op::sum);
///   if (a.ranks_failed() > 0) ...; a.samples(); a.used_anywhere(i);
/// \endcode
class StepAgreement {
 public:
  static constexpr std::int64_t fixed = 4;  ///< entries before the per-parameter ones

  /// A vector for `parameters` parameters, with an entry each when `track_use`.
  StepAgreement(std::size_t parameters, bool track_use)
      : track_use_(track_use),
        values_(at::zeros({fixed + (track_use ? static_cast<std::int64_t>(parameters) : 0)}, at::kDouble)) {}

  /// This rank's facts.
  void set(double samples, bool has_next, bool unused, bool failed) {
    auto* s = data();
    s[0] = samples;
    s[1] = has_next ? 1 : 0;
    s[2] = unused ? 1 : 0;
    s[3] = failed ? 1 : 0;
  }
  /// This rank produced a gradient for parameter `i` (ignored unless tracked).
  void mark_used(std::size_t i) {
    if (track_use_) data()[fixed + static_cast<std::int64_t>(i)] = 1;
  }

  /// The vector to sum over the ranks, in place (a CPU double tensor).
  [[nodiscard]] at::Tensor& values() noexcept { return values_; }

  // After the sum:
  [[nodiscard]] double samples() const { return data()[0]; }
  [[nodiscard]] int ranks_with_next() const { return static_cast<int>(data()[1]); }
  [[nodiscard]] int ranks_with_unused() const { return static_cast<int>(data()[2]); }
  [[nodiscard]] int ranks_failed() const { return static_cast<int>(data()[3]); }
  /// Whether any rank used parameter `i`; always true when use is not tracked.
  [[nodiscard]] bool used_anywhere(std::size_t i) const {
    return !track_use_ || data()[fixed + static_cast<std::int64_t>(i)] > 0;
  }
  /// What every rank acts on: samples and ranks with a next batch, or only the failures.
  [[nodiscard]] StepStatus status() const {
    if (ranks_failed() > 0) return {samples(), ranks_with_next(), ranks_failed()};
    return {samples(), ranks_with_next()};
  }

 private:
  [[nodiscard]] double* data() { return values_.data_ptr<double>(); }
  [[nodiscard]] const double* data() const { return values_.data_ptr<double>(); }

  bool track_use_;
  at::Tensor values_;
};

/// One rank's facts about a step (Note [Step agreement]).
struct StepFacts {
  double samples = 0;     ///< this rank's samples (Note [Exact averaging])
  bool has_next = false;  ///< this rank has another batch after this step
  bool joined = false;    ///< this rank ran no backward (join, or a batch it could not use)
  bool failed = false;    ///< this rank could not take part (Note [Unusable batches])
  bool find_unused_parameters = false;
};

/// Sums every rank's facts over `group` (on `device`, where it reduces): Note [Step
/// agreement]. `used(i)` says whether this rank produced a gradient for parameter i of
/// `parameters`, `name(i)` its name. Collective. Throws on every rank when a rank found a
/// parameter without gradient although find_unused_parameters is off (unless some rank
/// failed: then the failure is what every rank reports).
template <class Comm, class Used, class Name>
StepAgreement agree_on_step(Comm& group, const at::Device& device, std::size_t parameters, const StepFacts& facts,
                            Used&& used, Name&& name) {
  StepAgreement agreement(parameters, facts.find_unused_parameters);
  std::optional<std::string> unused;
  for (std::size_t i = 0; i < parameters; ++i) {
    if (used(i)) agreement.mark_used(i);
    else if (!facts.joined && !facts.find_unused_parameters && !unused) unused = name(i);
  }
  agreement.set(facts.samples, facts.has_next, unused.has_value(), facts.failed);
  detail::all_reduce_on(group, agreement.values(), device, reduce_op::sum);
  if (agreement.ranks_failed() == 0 && agreement.ranks_with_unused() > 0)
    throw error("DataParallel", group.rank(),
                unused ? "parameter '" + *unused +
                             "' received no gradient in this step; enable "
                             "DataParallel::Options::find_unused_parameters if some parameters are legitimately "
                             "unused in some steps, or make every parameter take part in the loss"
                       : std::to_string(agreement.ranks_with_unused()) +
                             " other rank(s) found a parameter without gradient (see their message); enable "
                             "DataParallel::Options::find_unused_parameters if that is expected");
  return agreement;
}

}  // namespace paratrain
