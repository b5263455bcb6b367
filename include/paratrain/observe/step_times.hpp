#pragma once
/// \file
/// paratrain::observe::StepTimes — per-rank step-time statistics, reduced over the
/// ranks, and the ranks that hold the others back (stragglers).

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "paratrain/core/reduce_op.hpp"
#include "paratrain/util/group_size.hpp"

namespace paratrain::observe {

// Note [Finding stragglers]
// In synchronous data parallelism every rank's step takes as long as the slowest
// rank's: the others wait for it in the gradient all-reduce. Step times alone cannot
// name the straggler, so each step is split into
//   step = from this step's start to the next step's start (everything the rank does
//          per step: data, compute, fit's bookkeeping, the user's callbacks);
//   wait = the time the step blocked for communication that compute did not hide: the
//          gradients' after backward, ZeRO's parameter gathers
//          (DataParallel::exposed_communication_seconds; 0 for a strategy without it);
//   busy = step - wait: the rank's own work.
// A straggler has the largest busy time (and the smallest wait). A rank is named when
// its median busy time exceeds the median over ranks (the lower median for an even
// count, so that with 2 ranks the slower one is compared with the faster one) by more
// than the threshold. Medians, not means, so that a few slow steps (a metric
// reduction every log_every steps, a page fault) do not name a rank.

/// One rank's step times, in seconds.
struct RankStepTimes {
  int rank = 0;
  std::int64_t steps = 0;
  double mean = 0, p50 = 0, p95 = 0;  ///< step: start to the next step's start
  double wait_mean = 0;               ///< blocked on communication not hidden by compute
  double busy_p50 = 0, busy_p95 = 0;  ///< step - wait
};

/// Every rank's step times and the stragglers among them; the same on every rank.
struct StepTimeReport {
  std::vector<RankStepTimes> ranks;  ///< indexed by rank
  double median_busy = 0;            ///< the (lower) median over ranks of busy_p50
  double threshold = 0;              ///< a fraction: 0.2 names ranks more than 20% slower
  std::vector<int> stragglers;       ///< ranks whose busy_p50 > median_busy * (1 + threshold)

  /// The table and verdict that fit prints on rank 0.
  [[nodiscard]] std::string text() const {
    std::string out =
        "paratrain: step times per rank (ms; step = start to next start, wait = communication not hidden, "
        "busy = step - wait)\n"
        "  rank  steps  step mean    p50    p95  wait mean  busy p50    p95\n";
    char line[160];
    for (const auto& r : ranks) {
      std::snprintf(line, sizeof line, "  %4d %6lld %10.2f %6.2f %6.2f %10.2f %9.2f %6.2f\n", r.rank,
                    static_cast<long long>(r.steps), 1e3 * r.mean, 1e3 * r.p50, 1e3 * r.p95, 1e3 * r.wait_mean,
                    1e3 * r.busy_p50, 1e3 * r.busy_p95);
      out += line;
    }
    for (int s : stragglers) {
      const auto& r = ranks[static_cast<std::size_t>(s)];
      std::snprintf(line, sizeof line, "paratrain: straggler: rank %d is busy %.2f ms per step, %.0f%% more than the median rank (%.2f ms)\n",
                    s, 1e3 * r.busy_p50, 100 * (r.busy_p50 / median_busy - 1), 1e3 * median_busy);
      out += line;
    }
    if (stragglers.empty()) {
      std::snprintf(line, sizeof line, "paratrain: no straggler (no rank busy more than %.0f%% above the median, %.2f ms)\n",
                    100 * threshold, 1e3 * median_busy);
      out += line;
    }
    return out;
  }
};

/// Collects this rank's step and wait times; `report` reduces them over the ranks.
class StepTimes {
 public:
  void add(double step_seconds, double wait_seconds) {
    step_.push_back(step_seconds);
    wait_.push_back(std::min(wait_seconds, step_seconds));
  }

  [[nodiscard]] std::size_t size() const noexcept { return step_.size(); }

  /// Collective over `group`: every rank's statistics and the stragglers. Note [Finding stragglers].
  template <class Group>
  StepTimeReport report(Group& group, double threshold) const {
    const int n = paratrain::detail::group_size(group), rank = group.rank();
    constexpr std::int64_t fields = 7;
    auto table = at::zeros({n, fields}, at::kDouble);
    auto* t = table.data_ptr<double>() + rank * fields;
    std::vector<double> busy(step_.size());
    double wait_sum = 0, step_sum = 0;
    for (std::size_t i = 0; i < step_.size(); ++i) {
      busy[i] = step_[i] - wait_[i];
      wait_sum += wait_[i];
      step_sum += step_[i];
    }
    const auto count = static_cast<double>(step_.size());
    t[0] = count;
    t[1] = count > 0 ? step_sum / count : 0;
    t[2] = percentile(step_, 0.50);
    t[3] = percentile(step_, 0.95);
    t[4] = count > 0 ? wait_sum / count : 0;
    t[5] = percentile(busy, 0.50);
    t[6] = percentile(busy, 0.95);
    group.all_reduce(table, reduce_op::sum);
    StepTimeReport r;
    r.threshold = threshold;
    const auto* all = table.data_ptr<double>();
    std::vector<double> busy_p50;
    for (int k = 0; k < n; ++k) {
      const double* row = all + k * fields;
      r.ranks.push_back({k, static_cast<std::int64_t>(row[0]), row[1], row[2], row[3], row[4], row[5], row[6]});
      busy_p50.push_back(row[5]);
    }
    std::sort(busy_p50.begin(), busy_p50.end());
    r.median_busy = busy_p50[(busy_p50.size() - 1) / 2];
    for (const auto& k : r.ranks)
      if (k.steps > 0 && k.busy_p50 > r.median_busy * (1 + threshold)) r.stragglers.push_back(k.rank);
    return r;
  }

 private:
  // Nearest-rank percentile: the smallest value with at least p of the values at or below it.
  static double percentile(std::vector<double> v, double p) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    const auto k = static_cast<std::size_t>(std::ceil(p * static_cast<double>(v.size())));
    return v[std::clamp<std::size_t>(k, 1, v.size()) - 1];
  }

  std::vector<double> step_, wait_;
};

}  // namespace paratrain::observe
