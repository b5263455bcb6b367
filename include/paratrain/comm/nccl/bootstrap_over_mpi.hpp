#pragma once
/// \file
/// comm::Nccl started over comm::Mpi: NCCL's unique id broadcast from rank 0 (Note [NCCL
/// bootstrap]). Needs paratrain::mpi as well as paratrain::nccl. With it included,
/// `comm::Nccl gpus(world);` and `comm::Nccl::unique_id(world)` take a comm::Mpi.

#include <mpi.h>
#include <nccl.h>

#include <string>

#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/comm/nccl/nccl.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain::detail {
inline void check_bootstrap_mpi(int rc, const char* op, int rank) {
  if (rc != MPI_SUCCESS) throw error(op, rank, "MPI failed while broadcasting NCCL's unique id");
}
}  // namespace paratrain::detail

namespace paratrain::comm {

/// Rank 0 makes NCCL's unique id and broadcasts it over `mpi` (or its failure, so that
/// every rank throws rather than waits); works without a GPU, so the bootstrap is testable
/// on CPU machines. Collective over `mpi`.
[[nodiscard]] inline ncclUniqueId nccl_unique_id(Mpi& mpi) {
  struct {
    ncclUniqueId id;
    ncclResult_t rc;
  } message{{}, ncclSuccess};
  if (mpi.rank() == 0) message.rc = ncclGetUniqueId(&message.id);
  detail::check_bootstrap_mpi(MPI_Bcast(&message, sizeof message, MPI_BYTE, 0, mpi.native()), "unique_id", mpi.rank());
  if (message.rc != ncclSuccess)
    throw error("unique_id", mpi.rank(), std::string("NCCL failed: ") + ncclGetErrorString(message.rc));
  return message.id;
}

/// Everything comm::Nccl needs from `mpi`'s ranks: the id, each rank's place in its node and
/// in the world; and the agreement that every rank has a GPU, so that a rank without one
/// makes every rank throw instead of leaving the others inside ncclCommInitRank. Collective
/// over `mpi`.
[[nodiscard]] inline Nccl::Bootstrap nccl_bootstrap(Mpi& mpi) {
  Nccl::Bootstrap b;
  b.rank = mpi.rank();
  b.size = mpi.size();
  const int devices = Nccl::device_count();
  b.id = nccl_unique_id(mpi);
  int without = devices == 0 ? 1 : 0;
  detail::check_bootstrap_mpi(MPI_Allreduce(MPI_IN_PLACE, &without, 1, MPI_INT, MPI_SUM, mpi.native()), "comm::Nccl",
                              b.rank);
  if (without > 0) throw Nccl::no_gpu_error(b.rank, devices, without, b.size, "comm::Mpi");
  MPI_Comm node = MPI_COMM_NULL;
  detail::check_bootstrap_mpi(
      MPI_Comm_split_type(mpi.native(), MPI_COMM_TYPE_SHARED, mpi.rank(), MPI_INFO_NULL, &node), "comm::Nccl", b.rank);
  MPI_Comm_rank(node, &b.local_rank);
  MPI_Comm_free(&node);
  b.world_ranks = detail::world_ranks(mpi.native());
  return b;
}

}  // namespace paratrain::comm
