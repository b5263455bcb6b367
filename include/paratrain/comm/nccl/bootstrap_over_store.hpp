#pragma once
/// \file
/// comm::Nccl started without MPI: NCCL's unique id agreed over a comm::Rendezvous (Note [NCCL
/// bootstrap]), as torchrun starts PyTorch's NCCL process groups. With it included,
/// `comm::Nccl gpus(meeting);` takes a comm::Rendezvous: ranks launched by torchrun, by a
/// script that exports RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, or meeting
/// in a file (PARATRAIN_STORE_FILE).

#include <nccl.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "paratrain/comm/nccl/nccl.hpp"
#include "paratrain/comm/rendezvous.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain::comm {

/// Rank 0 makes NCCL's unique id and sets it in the store (or its failure, so that every rank
/// throws rather than waits); the others read it. Works without a GPU. Collective over the
/// meeting's ranks; each call agrees a fresh id.
[[nodiscard]] inline ncclUniqueId nccl_unique_id(Rendezvous& meeting) {
  std::string message;  // 'i' and the id's bytes, or 'e' and NCCL's error
  if (meeting.rank() == 0) {
    ncclUniqueId id{};
    const auto rc = ncclGetUniqueId(&id);
    message = rc == ncclSuccess ? "i" + std::string(reinterpret_cast<const char*>(&id), sizeof id)
                                : "e" + std::string(ncclGetErrorString(rc));
  }
  message = meeting.broadcast("nccl-unique-id", message, 0);
  if (message.empty() || message[0] != 'i' || message.size() != 1 + sizeof(ncclUniqueId))
    throw error("unique_id", meeting.rank(),
                message.size() > 1 && message[0] == 'e'
                    ? "NCCL failed on rank 0: " + message.substr(1)
                    : "the store at " + meeting.where() + " held something else than NCCL's unique id under its key");
  ncclUniqueId id{};
  std::memcpy(&id, message.data() + 1, sizeof id);
  return id;
}

/// Everything comm::Nccl needs from the meeting's ranks: the id, each rank's place in its node
/// and in the world; and the agreement that every rank has a GPU, so that a rank without one
/// makes every rank throw instead of leaving the others inside ncclCommInitRank. Collective.
[[nodiscard]] inline Nccl::Bootstrap nccl_bootstrap(Rendezvous& meeting) {
  Nccl::Bootstrap b;
  b.rank = meeting.rank();
  b.size = meeting.size();
  b.local_rank = meeting.local_rank();
  const int devices = Nccl::device_count();
  const auto counts = meeting.all_gather("nccl-devices", std::to_string(devices));
  int without = 0;
  for (const auto& c : counts) without += c == "0" ? 1 : 0;
  if (without > 0) throw Nccl::no_gpu_error(b.rank, devices, without, b.size, "comm::Gloo");
  b.id = nccl_unique_id(meeting);
  return b;
}

}  // namespace paratrain::comm

namespace paratrain::detail {
/// The bootstrap of the group the launcher describes (comm::Nccl()).
[[nodiscard]] inline comm::Nccl::Bootstrap launcher_bootstrap() {
  comm::Rendezvous meeting(comm::Rendezvous::Options{}, "comm::Nccl");
  return nccl_bootstrap(meeting);
}
}  // namespace paratrain::detail

namespace paratrain::comm {

inline Nccl::Nccl() : Nccl(Options{}) {}
inline Nccl::Nccl(Options options) : Nccl(detail::launcher_bootstrap(), std::move(options)) {}

}  // namespace paratrain::comm
