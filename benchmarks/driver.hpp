#pragma once
// The shared benchmark driver: timing with ranks in step, and the side-by-side table.
//
// Each measurement is taken `trials` times, alternating the candidate with its
// reference so that drift (thermal, other load) hits both alike; the median trial
// is reported. Only rank 0 prints.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

namespace paratrain::bench {

/// The largest of every rank's `v`; collective over `comm`.
inline double max_over_ranks(MPI_Comm comm, double v) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MAX, comm);
  return v;
}

/// The median of `v` (the upper one of an even count); 0 for none.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

/// Seconds per call of `f`, the median over trials of `iterations` calls each,
/// started together on every rank and ended by the slowest.
inline std::vector<double> time_alternating(MPI_Comm comm, int trials, int iterations,
                                            const std::vector<std::function<void()>>& candidates) {
  std::vector<std::vector<double>> seconds(candidates.size());
  for (auto& f : candidates) f();  // warm-up: first-touch pages, connections
  for (int t = 0; t < trials; ++t)
    for (std::size_t c = 0; c < candidates.size(); ++c) {
      MPI_Barrier(comm);
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < iterations; ++i) candidates[c]();
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      seconds[c].push_back(max_over_ranks(comm, elapsed) / iterations);
    }
  std::vector<double> medians;
  for (auto& s : seconds) medians.push_back(median(std::move(s)));
  return medians;
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
