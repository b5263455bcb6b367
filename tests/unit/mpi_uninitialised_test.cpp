// comm::Mpi made before MPI starts must throw paratrain::error saying how to fix it.
#include <cstdio>
#include <string>

#include "paratrain/comm/mpi/mpi.hpp"

int main() {
  try {
    paratrain::comm::Mpi world;
  } catch (const paratrain::error& e) {
    const std::string what = e.what();
    std::puts(e.what());
    const bool ok = what.find("MPI is not initialised") != std::string::npos &&
                    what.find("Mpi::Environment") != std::string::npos;
    return ok ? 0 : 1;
  }
  std::puts("comm::Mpi was constructed without MPI being initialised");
  return 1;
}
