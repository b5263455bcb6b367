// A downstream program built against an installed paratrain (find_package): it
// all-reduces with comm::SingleDevice and with comm::Mpi and checks the sums.
// Exit status 0 when both are right, 1 otherwise.
#include <ATen/ops/full.h>

#include <cstdio>

#include <paratrain/comm/mpi/mpi.hpp>
#include <paratrain/comm/single_device.hpp>
#include <paratrain/core/config.hpp>

static_assert(PARATRAIN_HAS_MPI == 1, "linking paratrain::mpi must define PARATRAIN_HAS_MPI=1");

int main(int argc, char** argv) {
  paratrain::comm::Mpi::Environment env(argc, argv);

  // A world of one leaves the values as they are.
  const paratrain::comm::SingleDevice single;
  auto local = at::full({4}, 3.0F);
  single.all_reduce(local, paratrain::reduce_op::sum);

  // Every rank contributes its rank + 1: the sum is n (n + 1) / 2.
  paratrain::comm::Mpi world;
  auto global = at::full({4}, static_cast<float>(world.rank() + 1));
  world.all_reduce(global, paratrain::reduce_op::sum);
  const float expected = static_cast<float>(world.size() * (world.size() + 1) / 2);

  const bool ok = local.eq(3.0F).all().item<bool>() && global.eq(expected).all().item<bool>();
  std::printf("rank %d of %d: SingleDevice %.1f (want 3.0), Mpi %.1f (want %.1f): %s\n", world.rank(),
              world.size(), local[0].item<float>(), global[0].item<float>(), expected, ok ? "OK" : "WRONG");
  return ok ? 0 : 1;
}
