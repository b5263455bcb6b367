// The driver of paratrain_gloo_tests, which needs no MPI: tests/launch/torchrun_style.sh
// starts N copies with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, as torchrun does, and
// fails when any copy fails. Every rank runs the whole suite; rank 0 reports in full, the
// others only their failures.
#define DOCTEST_CONFIG_IMPLEMENT
#include <ATen/Parallel.h>

#include <cstdio>
#include <optional>

#include "paratrain/comm/gloo.hpp"
#include "support/doctest.hpp"
#include "support/gloo_world.hpp"

namespace {
std::optional<paratrain::comm::Gloo> world;
}

paratrain::comm::Gloo& gloo_world() { return *world; }

int main(int argc, char** argv) {
  at::set_num_threads(1);  // ranks share 2 cores; intra-op threads would oversubscribe them
  doctest::Context context(argc, argv);
  try {
    world.emplace();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
  if (world->rank() != 0) context.setOption("minimal", true);
  const int failed = context.run() != 0 ? 1 : 0;
  // Leave together: rank 0 holds the store the others still use until their last test.
  world->barrier();
  world.reset();
  return failed;
}
