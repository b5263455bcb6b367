#pragma once
/// \file
/// paratrain::guarded — run a program's body so that any error ends the whole job cleanly:
/// one "paratrain: …" line per failing rank, a non-zero exit, and the other ranks brought
/// down promptly. Note [Failing cleanly].

#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <type_traits>
#include <utility>

#include "paratrain/reliability/collective_signature.hpp"
#include "paratrain/reliability/watchdog.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain {

// Note [Failing cleanly]
// An exception that leaves main calls std::terminate: "terminate called after throwing",
// then SIGABRT, on which Open MPI prints a backtrace of every failing rank, while the
// other ranks wait in their next collective until mpirun notices. guarded() instead
// prints the error as one line (paratrain::error's what() already names the operation
// and rank; others are prefixed with the rank), then ends the job: through the
// watchdog's channel where there is one (MPI_Abort under MPI, which ends every rank at
// once; under a torchrun-style launch an exit, on which the peers' next operation fails
// naming this rank), else by returning the status for main to return. Mpi::Environment
// installs terminate_cleanly as the terminate handler, so an exception that escapes
// anyway ends the same way. PARATRAIN_BACKTRACE=1 keeps std::abort, and so the backtrace.

namespace detail {

/// This process's world rank as far as it is known: MPI's, else the launcher's.
inline int known_rank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "RANK", "SLURM_PROCID"})
    if (const char* v = std::getenv(name); v != nullptr && *v != '\0') return std::atoi(v);
  return -1;
}

/// The one line that reports `e`.
inline std::string failure_line(const std::exception& e) {
  std::string text = dynamic_cast<const c10::Error*>(&e) != nullptr
                         ? static_cast<const c10::Error&>(e).what_without_backtrace()
                         : std::string(e.what());
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  if (text.rfind("paratrain: ", 0) == 0) return text;
  const int rank = known_rank();
  return "paratrain: " + (rank >= 0 ? "rank " + std::to_string(rank) + ": " : std::string()) + text;
}

/// Reports the exception in flight and ends the job; returns the status where the caller
/// must end it (one process).
inline int report_failure(int status = 1) noexcept {
  try {
    throw;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", failure_line(e).c_str());
  } catch (...) {
    std::fprintf(stderr, "paratrain: rank %d: an exception that is not a std::exception\n", known_rank());
  }
  std::fflush(nullptr);
  Watchdog::instance().end_job(status);
  return status;
}

[[noreturn]] inline void terminate_cleanly() noexcept {
  if (env_flag("PARATRAIN_BACKTRACE")) std::abort();
  if (std::current_exception()) report_failure(1);
  else std::fprintf(stderr, "paratrain: rank %d: std::terminate called without an exception\n", known_rank());
  std::fflush(nullptr);
  Watchdog::instance().end_job(1);
  std::_Exit(1);
}

}  // namespace detail

/// Runs `body` (returning int, or void for 0) and returns its status; an exception it
/// throws is reported as one line and ends the whole job: Note [Failing cleanly].
///
/// \code
///   int main(int argc, char** argv) {
///     paratrain::comm::Mpi::Environment env(argc, argv);
///     return paratrain::guarded([&] { ... train ...; });
///   }
/// \endcode
template <class Body>
int guarded(Body&& body) noexcept {
  try {
    if constexpr (std::is_void_v<std::invoke_result_t<Body&>>) {
      std::forward<Body>(body)();
      return 0;
    } else {
      return static_cast<int>(std::forward<Body>(body)());
    }
  } catch (...) {
    return detail::report_failure(1);
  }
}

}  // namespace paratrain
