#pragma once
/// \file
/// comm::MpiEnvironment (spelled comm::Mpi::Environment): MPI for the lifetime of main.

#include <boost/mpi/environment.hpp>
#include <mpi.h>

#include <exception>
#include <optional>
#include <string>

#include "paratrain/comm/launch.hpp"
#include "paratrain/comm/mpi/detail/types.hpp"
#include "paratrain/comm/mpi/progress.hpp"
#include "paratrain/comm/mpi/watchdog.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/core/process.hpp"
#include "paratrain/memory/allocator.hpp"
#include "paratrain/reliability/failure.hpp"
#include "paratrain/reliability/watchdog.hpp"

namespace paratrain::comm {

/// Initialises MPI for the lifetime of this object, asking for MPI_THREAD_MULTIPLE
/// (strategies that communicate from a second thread need it, and so does the
/// watchdog's channel: Note [Watchdog]), tunes Open MPI's non-blocking all-reduce
/// (Note [Non-blocking all-reduce algorithm]) and the heap (memory::install: Note
/// [Allocator]), and makes an exception that escapes main
/// end the job with one line instead of a backtrace on every rank (Note [Failing cleanly]).
class MpiEnvironment {
 public:
  MpiEnvironment() : env_(boost::mpi::threading::multiple) {
    set_up();
    check_launch();
  }
  MpiEnvironment(int& argc, char**& argv) : env_(argc, argv, boost::mpi::threading::multiple) {
    set_up();
    check_launch();
  }
  /// MPI started, its launch not yet checked: the caller calls check_launch() once this object
  /// is whole, so that its refusal, thrown then, leaves MPI to be ended as usual (boost's
  /// environment aborts the job without a word when an exception unwinds through it).
  struct LaunchCheckedLater {};
  explicit MpiEnvironment(LaunchCheckedLater) : env_(boost::mpi::threading::multiple) { set_up(); }
  MpiEnvironment(const MpiEnvironment&) = delete;
  MpiEnvironment& operator=(const MpiEnvironment&) = delete;
  ~MpiEnvironment() {  // before MPI_Finalize
    detail::MpiProgress::instance().stop();
    detail::Watchdog::instance().retire_channel();
  }
  [[nodiscard]] bool thread_multiple() const { return env_.thread_level() >= boost::mpi::threading::multiple; }

 private:
  static void set_up() {
    memory::install();  // Note [Allocator]: before anything is allocated
    detail::prefer_reduce_scatter_iallreduce();
    std::set_terminate(detail::terminate_cleanly);
  }

 public:
  /// Collective over the world: throws on every rank when some rank's launcher variables
  /// contradict the MPI world (paratrain::contradiction_with_mpi).
  static void check_launch() {
    int rank = 0, size = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    std::string mine;
    try {
      mine = contradiction_with_mpi(detect_placement(), rank, size);
    } catch (const error&) {
      // Malformed launcher variables: detect_placement reports them where it is called.
    }
    int first = mine.empty() ? size : rank;
    MPI_Allreduce(MPI_IN_PLACE, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (first == size) return;
    throw error("Mpi::Environment", rank,
                first == rank ? mine
                              : "rank " + std::to_string(first) +
                                    "'s launcher variables contradict the MPI world (its message says how)");
  }

 private:
  boost::mpi::environment env_;
};

// Note [MPI started by the library]
// comm::Mpi made where MPI is not running starts it: an MpiEnvironment the library owns,
// ended when paratrain::main returns (detail::at_runtime_end) or, in a program without it,
// at exit. So `comm::Mpi()` needs no line in main, and one strategy alias switches between
// MPI and the communicators that meet without it. (What its destructor stops, the progress
// thread and the watchdog's channel, belong to singletons that are never destroyed, so the
// order of destruction at exit cannot reach them gone.)
// A program that scopes MPI itself (Mpi::Environment in main) is left alone: MPI is running.

}  // namespace paratrain::comm

namespace paratrain::detail {

inline std::optional<comm::MpiEnvironment>& library_mpi() {
  static std::optional<comm::MpiEnvironment> environment;
  return environment;
}

/// Starts MPI where it is not running (Note [MPI started by the library]); throws where it
/// was finalised already.
inline void start_mpi_if_needed() {
  int initialised = 0, finalised = 0;
  MPI_Initialized(&initialised);
  MPI_Finalized(&finalised);
  if (finalised)
    throw error("comm::Mpi", -1,
                "MPI is already finalised (paratrain::main has returned, or the Mpi::Environment is gone); make "
                "communicators inside paratrain::main's body, or keep the Mpi::Environment alive while they exist");
  if (initialised) return;
  library_mpi().emplace(comm::MpiEnvironment::LaunchCheckedLater{});
  at_runtime_end([] { library_mpi().reset(); });
  comm::MpiEnvironment::check_launch();  // a refusal is thrown with MPI running, and ended as usual
}

}  // namespace paratrain::detail
