#pragma once
// The shared benchmark driver over MPI: timing with ranks in step (timing.hpp), and the
// side-by-side table. Only rank 0 prints.
#include <mpi.h>

#include <functional>
#include <vector>

#include "timing.hpp"

namespace paratrain::bench {

/// The largest of every rank's `v`; collective over `comm`.
inline double max_over_ranks(MPI_Comm comm, double v) {
  MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MAX, comm);
  return v;
}

/// The ranks of `comm`, for timing.hpp.
inline Ranks ranks_of(MPI_Comm comm) {
  return {.barrier = [comm] { MPI_Barrier(comm); }, .max = [comm](double v) { return max_over_ranks(comm, v); }};
}

/// time_alternating (timing.hpp) over the ranks of `comm`.
inline std::vector<double> time_alternating(MPI_Comm comm, int trials, int iterations,
                                            const std::vector<std::function<void()>>& candidates) {
  return time_alternating(ranks_of(comm), trials, iterations, candidates);
}

/// time_paired (timing.hpp) over the ranks of `comm`.
inline PairedTimes time_paired(MPI_Comm comm, int trials, int iterations,
                               const std::vector<std::function<void()>>& candidates) {
  return time_paired(ranks_of(comm), trials, iterations, candidates);
}

}  // namespace paratrain::bench
