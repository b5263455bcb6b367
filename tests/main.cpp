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

#include "paratrain/comm/mpi.hpp"
#include "support/doctest.hpp"

#include <cstdio>

namespace {

int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

int world_size() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

// Listeners run before the console reporter, so this one prints the failure itself.
struct AbortOnFailure : doctest::IReporter {
  explicit AbortOnFailure(const doctest::ContextOptions&) {}
  void log_assert(const doctest::AssertData& a) override {
    if (!a.m_failed || world_size() == 1) return;
    std::fprintf(stderr, "rank %d: %s:%d: %s( %s ) failed, with %s%s%s%s\nrank %d: ending the whole job (MPI_Abort)\n",
                 world_rank(), a.m_file, a.m_line, doctest::assertString(a.m_at), a.m_expr, a.m_decomp.c_str(),
                 a.m_threw ? " (threw: " : "", a.m_threw ? a.m_exception.c_str() : "", a.m_threw ? ")" : "",
                 world_rank());
    std::fflush(nullptr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  void test_case_exception(const doctest::TestCaseException& e) override {
    if (world_size() == 1) return;
    std::fprintf(stderr, "rank %d: test case threw: %s\nrank %d: ending the whole job (MPI_Abort)\n", world_rank(),
                 e.error_string.c_str(), world_rank());
    std::fflush(nullptr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
REGISTER_LISTENER("abort_on_failure", 1, AbortOnFailure);

}  // namespace

int main(int argc, char** argv) {
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
  return any_failed;
}
