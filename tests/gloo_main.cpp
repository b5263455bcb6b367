// The driver of paratrain_gloo_tests (the GPU suite's cases included), which needs no MPI: tests/launch/torchrun_style.sh
// starts N copies with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as torchrun does, and
// fails when any copy fails, stopping the others. Every rank runs the whole suite; rank 0
// reports in full, the others only their failures. A failed check on one rank of several
// ends that rank at once (support/abort_on_failure.hpp), so the launcher stops the job then,
// not at its timeout.
#define DOCTEST_CONFIG_IMPLEMENT
#include <ATen/Parallel.h>
#include <torch/cuda.h>

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string_view>

#include "paratrain/comm/gloo/gloo.hpp"
#include "support/abort_on_failure.hpp"
#include "support/case_count.hpp"
#include "support/doctest.hpp"
#include "support/gloo_world.hpp"

namespace {
std::optional<paratrain::comm::Gloo> world;
}

paratrain::comm::Gloo& gloo_world() { return *world; }

namespace paratrain_test {
int job_rank() { return world ? world->rank() : 0; }
int job_size() { return world ? world->size() : 1; }
void end_job() { std::_Exit(1); }  // torchrun_style.sh sees the failure and stops the other ranks
}  // namespace paratrain_test

REGISTER_LISTENER("abort_on_failure", 1, paratrain_test::AbortOnFailure);
REGISTER_LISTENER("count_cases", 2, paratrain_test::CountCases);

int main(int argc, char** argv) {
  // fit's deadline (Note [Ending before the time limit]) must not come from a Slurm job that
  // happens to run the tests; the tests that want one set SLURM_JOB_END_TIME themselves.
  ::unsetenv("SLURM_JOB_END_TIME");
  at::set_num_threads(1);  // ranks share 2 cores; intra-op threads would oversubscribe them
  // --requires-gpu (the GPU suite, tests/gpu/): where LibTorch sees no GPU every rank
  // exits 77, which ctest reports as skipped (SKIP_RETURN_CODE), not as passed; unless
  // PARATRAIN_TEST_DEVICE=cpu asks for the suite's checks on the CPU.
  bool requires_gpu = false;
  for (int i = 1; i < argc; ++i)
    if (std::string_view(argv[i]) == "--requires-gpu") {
      requires_gpu = true;
      if (!torch::cuda::is_available() &&
          std::string_view(std::getenv("PARATRAIN_TEST_DEVICE") ? std::getenv("PARATRAIN_TEST_DEVICE") : "") != "cpu") {
        std::printf("skipped: LibTorch sees no GPU (--requires-gpu)\n");
        return 77;
      }
    }
  doctest::Context context(argc, argv);
  try {
    world.emplace();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  if (world->rank() != 0) context.setOption("minimal", true);
  const int failed = context.run() != 0 ? 1 : 0;
  const int rank = world->rank();
  // Leave together: rank 0 holds the store the others still use until their last test.
  world->barrier();
  world.reset();
  if (requires_gpu) {
    // The GPU suite checked something, or it did not pass: every case skipped (or none
    // matched the filter) is a failure. Skips are decided alike on every rank.
    const auto& n = paratrain_test::case_count();
    if (rank == 0)
      std::printf("GPU suite: %d case(s) ran, %d of them skipped, %d checked\n", n.entered, n.skipped,
                  n.entered - n.skipped);
    if (failed == 0 && n.entered == n.skipped) {
      std::fprintf(stderr, "GPU suite: every case was skipped (or none matched): nothing was checked\n");
      return 3;
    }
  }
  return failed;
}
