// The test driver: one binary that ctest runs under mpirun with 1, 2, 3 and 4 ranks.
// Debian's doctest has no doctest_mpi.h, so: every rank runs the whole suite, rank 0
// reports in full, the others only their failures, and the exit status is the
// maximum over ranks, so a failure on any rank fails the test.
//
// A failed check on one rank of several ends the whole job at once (MPI_Abort) after
// printing where: the other ranks might otherwise wait in a collective that the failing
// rank, now on another path, never joins, until ctest's timeout.
#define DOCTEST_CONFIG_IMPLEMENT
#include <torch/torch.h>

#include "paratrain/comm/mpi/mpi.hpp"
#include "support/abort_on_failure.hpp"
#include "support/doctest.hpp"

#include <cstdlib>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

namespace paratrain_test {

int job_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

int job_size() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

void end_job() {
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();  // not reached: MPI_Abort does not return
}

}  // namespace paratrain_test

REGISTER_LISTENER("abort_on_failure", 1, paratrain_test::AbortOnFailure);

int main(int argc, char** argv) {
  // fit's deadline (Note [Ending before the time limit]) must not come from a Slurm job that
  // happens to run the tests; the tests that want one set SLURM_JOB_END_TIME themselves.
  ::unsetenv("SLURM_JOB_END_TIME");
  paratrain::comm::Mpi::Environment env(argc, argv);
  torch::set_num_threads(1);  // ranks share 2 cores; intra-op threads would oversubscribe them
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);

  doctest::Context context(argc, argv);
  if (rank != 0) context.setOption("minimal", true);
  int failed = context.run() != 0 ? 1 : 0;
  if (context.shouldExit()) return failed;

  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
#if defined(__SANITIZE_ADDRESS__)
  // Note [Leak check before MPI_Finalize]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // Under AddressSanitizer (scripts/sanitize.sh) leaks are checked here, once, after every
  // case and before Mpi::Environment finalizes MPI: every paratrain object the cases made is
  // gone, so what is unreachable now is a leak, while Open MPI's state is still reachable
  // and not one (MPI_Finalize drops much of it on purpose, which an exit-time check reports).
  // A leak ends this rank with LeakSanitizer's report and status, and so the job.
  __lsan_do_leak_check();  // also turns the exit-time check off
#endif
  return any_failed;
}
