#pragma once
/// \file
/// comm::MpiEnvironment (spelled comm::Mpi::Environment): MPI for the lifetime of main.

#include <boost/mpi/environment.hpp>
#include <mpi.h>

#include <exception>
#include <string>

#include "paratrain/comm/launch.hpp"
#include "paratrain/comm/mpi/detail/types.hpp"
#include "paratrain/comm/mpi/progress.hpp"
#include "paratrain/comm/mpi/watchdog.hpp"
#include "paratrain/core/error.hpp"
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
  MpiEnvironment() : env_(boost::mpi::threading::multiple) { set_up(); }
  MpiEnvironment(int& argc, char**& argv) : env_(argc, argv, boost::mpi::threading::multiple) { set_up(); }
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
    check_launch();
  }
  // Collective over the world: throws on every rank when some rank's launcher variables
  // contradict the MPI world (paratrain::contradiction_with_mpi).
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
  boost::mpi::environment env_;
};

}  // namespace paratrain::comm
