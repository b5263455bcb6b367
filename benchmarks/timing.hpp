#pragma once
// Timing with ranks in step, over any communicator: what driver.hpp does over MPI, for the
// benchmarks that start without MPI (a comm::Rendezvous: NCCL on GPUs, Gloo on the CPU).
//
// Each measurement is taken `trials` times, alternating the candidate with its reference
// so that drift (thermal, other load) hits both alike; the median trial is reported.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace paratrain::bench {

/// What timing needs of the ranks.
struct Ranks {
  std::function<void()> barrier;        ///< every rank arrives before any leaves
  std::function<void()> sync = [] {};   ///< waits for the work this rank enqueued (a GPU's)
  std::function<double(double)> max;    ///< the largest of every rank's value (collective)
};

/// The median of `v` (the upper one of an even count); 0 for none.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

/// Seconds per call of `candidate` in one trial of `iterations` calls, started together on
/// every rank, waited for (`ranks.sync`) and ended by the slowest.
inline double time_trial(const Ranks& ranks, int iterations, const std::function<void()>& candidate) {
  ranks.sync();
  ranks.barrier();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iterations; ++i) candidate();
  ranks.sync();
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return ranks.max(elapsed) / iterations;
}

/// Seconds per call of each candidate, the median over trials (time_trial), the candidates
/// in turn within each trial.
inline std::vector<double> time_alternating(const Ranks& ranks, int trials, int iterations,
                                            const std::vector<std::function<void()>>& candidates) {
  std::vector<std::vector<double>> seconds(candidates.size());
  for (auto& f : candidates) f();  // warm-up: first-touch pages, connections
  for (int t = 0; t < trials; ++t)
    for (std::size_t c = 0; c < candidates.size(); ++c) seconds[c].push_back(time_trial(ranks, iterations, candidates[c]));
  std::vector<double> medians;
  for (auto& s : seconds) medians.push_back(median(std::move(s)));
  return medians;
}

/// Every trial's seconds per call of each candidate (time_paired).
struct PairedTimes {
  std::vector<std::vector<double>> trials;  // [candidate][trial]

  /// Seconds per call of candidate `c`, the median over trials.
  [[nodiscard]] double seconds(std::size_t c) const { return median(trials[c]); }
  /// a's time over b's, the median over trials of the ratio within each trial: the machine's
  /// speed drifts from trial to trial (a VM's by up to 1.6x from one second to the next),
  /// and a ratio of two medians taken in different states shows that drift as a difference.
  [[nodiscard]] double ratio(std::size_t a, std::size_t b) const {
    std::vector<double> r;
    for (std::size_t t = 0; t < trials[a].size(); ++t) r.push_back(trials[a][t] / trials[b][t]);
    return median(std::move(r));
  }
};

/// Times the candidates as time_alternating does, in the reverse order every other trial
/// (so that no candidate always follows the same one), and keeps every trial's time.
inline PairedTimes time_paired(const Ranks& ranks, int trials, int iterations,
                               const std::vector<std::function<void()>>& candidates) {
  PairedTimes times{std::vector<std::vector<double>>(candidates.size())};
  for (auto& f : candidates) f();  // warm-up: first-touch pages, connections
  for (int t = 0; t < trials; ++t)
    for (std::size_t k = 0; k < candidates.size(); ++k) {
      const auto c = t % 2 == 0 ? k : candidates.size() - 1 - k;
      times.trials[c].push_back(time_trial(ranks, iterations, candidates[c]));
    }
  return times;
}

inline std::string human_bytes(double bytes) {
  const char* unit[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  while (bytes >= 1024 && u < 3) bytes /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g %s", bytes, unit[u]);
  return buf;
}

}  // namespace paratrain::bench
