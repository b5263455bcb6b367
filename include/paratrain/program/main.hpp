#pragma once
/// \file
/// paratrain::main — what every training program's main does first, in one call: the heap's
/// settings, clean failures, one intra-op thread per process, the same seed on every rank;
/// and at its end, what the library started (MPI) is ended.

#include <torch/utils.h>

#include <cstdint>
#include <exception>
#include <type_traits>
#include <utility>

#include "paratrain/core/error.hpp"
#include "paratrain/core/process.hpp"
#include "paratrain/memory/allocator.hpp"
#include "paratrain/reliability/failure.hpp"

namespace paratrain {

/// What paratrain::main sets up.
struct RuntimeOptions {
  /// LibTorch's generators are seeded with it on every rank, so that every replica draws
  /// the same initial weights; fit's sample order (FitOptions::seed) defaults to it too.
  std::uint64_t seed = 0;
  /// LibTorch's intra-op threads per process (torch::set_num_threads). 1: one process per
  /// core (or GPU), as launchers start them, where more threads would fight over the cores;
  /// 0 leaves LibTorch's default (one per core), for a single process that has them all.
  int threads = 1;
};

// Note [paratrain::main]
// Every program repeated the same first lines: an Mpi::Environment, torch::set_num_threads(1),
// torch::manual_seed on every rank, guarded around the body. paratrain::main does them in
// the order they must happen: the heap's settings before anything is allocated (Note
// [Allocator]), the terminate handler (an exception that escapes anyway ends the job with one
// line), then the threads and the seed, then the body under guarded (Note [Failing
// cleanly]). It starts no communicator: comm::Mpi starts MPI the first time one is made
// (Note [MPI started by the library]), comm::Gloo and comm::Nccl meet through the launcher's
// variables; so the same main serves every strategy alias. What the library started is ended
// when the body returns (MPI finalised), before main's own return; an error ends the whole
// job from inside guarded, as it always did.

/// Runs `body` (returning int, or void for 0) as a training program's main, set up as
/// RuntimeOptions says, and returns the exit status: 0, the body's, or 1 where it threw
/// (after one "paratrain: ..." line, the whole job ended).
///
/// \code
///   int main(int argc, char** argv) {
///     return paratrain::main(argc, argv, [] {
///       Strategy strategy(torch::optim::AdamOptions(1e-3));
///       paratrain::fit(strategy, train, {.epochs = 5});
///     });
///   }
/// \endcode
template <class Body>
  requires std::is_invocable_v<Body&>
int main(int argc, char** argv, Body&& body, RuntimeOptions options = {}) {
  static_cast<void>(argc);  // for symmetry with main's; MPI takes none of them (MPI-2 and later)
  static_cast<void>(argv);
  memory::install();
  std::set_terminate(detail::terminate_cleanly);
  const int status = guarded([&]() -> int {
    if (options.threads < 0)
      throw error("paratrain::main", detail::known_rank(),
                  "RuntimeOptions::threads is " + std::to_string(options.threads) +
                      "; give the intra-op threads per process (1 by default), or 0 for LibTorch's default");
    if (options.threads > 0) torch::set_num_threads(options.threads);
    detail::set_seed(options.seed);
    torch::manual_seed(options.seed);
    if constexpr (std::is_void_v<std::invoke_result_t<Body&>>) {
      body();
      return 0;
    } else {
      return static_cast<int>(body());
    }
  });
  detail::end_runtime();
  return status;
}

}  // namespace paratrain
