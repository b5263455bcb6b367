// comm::Mpi made where MPI is not running starts it (Note [MPI started by the library]),
// paratrain::main ends it when the body returns, and a communicator made after that is
// refused with the reason. Run under mpirun with 2 ranks, with no Mpi::Environment anywhere.
#include <mpi.h>

#include <cstdio>
#include <string>

#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/program/main.hpp"

int main(int argc, char** argv) {
  int before = 1;
  MPI_Initialized(&before);
  int size = 0;
  const int status = paratrain::main(argc, argv, [&] {
    paratrain::comm::Mpi world;  // the first one: MPI starts here
    size = world.size();
    auto t = at::ones({1});
    world.all_reduce(t, paratrain::reduce_op::sum);
    int running = 0;
    MPI_Initialized(&running);
    const bool ok = running == 1 && size == 2 && t.item<float>() == 2.0f;
    if (!ok) std::printf("rank %d: MPI running %d, world of %d, sum %g\n", world.rank(), running, size, t.item<float>());
    return ok ? 0 : 1;
  });
  int finalised = 0;
  MPI_Finalized(&finalised);
  if (before != 0 || status != 0 || finalised != 1) {
    std::printf("before %d, status %d, finalised after paratrain::main %d\n", before, status, finalised);
    return 1;
  }
  try {
    paratrain::comm::Mpi late;
  } catch (const paratrain::error& e) {
    const std::string what = e.what();
    std::puts(e.what());
    return what.find("MPI is already finalised") != std::string::npos ? 0 : 1;
  }
  std::puts("comm::Mpi was made after MPI was finalised");
  return 1;
}
