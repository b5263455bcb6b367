#pragma once
/// \file
/// comm::SingleDevice — a world of one.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <span>

#include "paratrain/core/reduce_op.hpp"
#include "paratrain/comm/detail/tensor_checks.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain::comm {

/// The communicator of a single process: rank 0 of 1.
///
/// Every collective is the identity: in-place ones (all_reduce, broadcast) touch
/// nothing, and the out-of-place ones copy only when `out` does not already hold `in`
/// (same storage, same first element). The non-blocking forms (`iall_reduce`,
/// `ibroadcast`, `ireduce_scatter`, `iall_gather`, `iall_to_all`) do the same and return a completed
/// Request.
/// Arguments are checked exactly as comm::Mpi checks them, so a mistake shows up
/// on one process before it costs a cluster job.
///
/// Any strategy instantiated with it is plain single-device training, which is
/// how the equivalence tests obtain their reference.
///
/// Choose it for: debugging a strategy without a launcher, and for the reference run.
/// Choose `comm::Mpi` for CPU ranks and `comm::Nccl` for GPU ranks.
class SingleDevice {
 public:
  /// A completed request: returned by the non-blocking forms.
  struct Request {
    void wait() noexcept {}
    [[nodiscard]] bool test() noexcept { return true; }
  };

  [[nodiscard]] int rank() const noexcept { return 0; }
  [[nodiscard]] int size() const noexcept { return 1; }

  void all_reduce(at::Tensor& t, reduce_op op) const { detail::check_reduction("all_reduce", 0, t, op); }
  Request iall_reduce(at::Tensor& t, reduce_op op) const {
    all_reduce(t, op);
    return {};
  }

  void broadcast(at::Tensor& t, int root) const {
    detail::check_buffer("broadcast", 0, t);
    if (root != 0) no_peer("broadcast", root);
  }
  Request ibroadcast(at::Tensor& t, int root) const {
    broadcast(t, root);
    return {};
  }

  void reduce_scatter(const at::Tensor& in, at::Tensor& out, reduce_op op) const {
    detail::check_reduce_scatter(0, 1, in, out, op);
    if (out.data_ptr() != in.data_ptr()) out.copy_(in.reshape(out.sizes()));
  }
  Request ireduce_scatter(const at::Tensor& in, at::Tensor& out, reduce_op op) const {
    reduce_scatter(in, out, op);
    return {};
  }
  /// In place when `in` is part rank() of `out` (here: all of it), as comm::Mpi allows;
  /// nothing is copied then.
  void all_gather(const at::Tensor& in, at::Tensor& out) const {
    detail::check_all_gather(0, 1, in, out);
    if (out.data_ptr() != in.data_ptr()) out.copy_(in.reshape(out.sizes()));
  }
  Request iall_gather(const at::Tensor& in, at::Tensor& out) const {
    all_gather(in, out);
    return {};
  }

  /// The one part of `in` goes to this rank: copied into `out`. The uneven form's counts
  /// have one entry each, as comm::Mpi's have one per rank.
  void all_to_all(const at::Tensor& in, at::Tensor& out) const { all_to_all(in, {}, out, {}); }
  void all_to_all(const at::Tensor& in, std::span<const std::int64_t> in_counts, at::Tensor& out,
                  std::span<const std::int64_t> out_counts) const {
    (void)detail::check_all_to_all(0, 1, in, in_counts, out, out_counts);
    if (in.numel() > 0) out.view({-1}).copy_(in.view({-1}));
  }
  Request iall_to_all(const at::Tensor& in, at::Tensor& out) const {
    all_to_all(in, out);
    return {};
  }
  Request iall_to_all(const at::Tensor& in, std::span<const std::int64_t> in_counts, at::Tensor& out,
                      std::span<const std::int64_t> out_counts) const {
    all_to_all(in, in_counts, out, out_counts);
    return {};
  }

  /// A world of one has no peer: sending to or receiving from anyone is a bug in
  /// the caller's rank arithmetic, so it throws rather than deadlocks.
  [[noreturn]] void send(const at::Tensor&, int peer, int = 0) const { no_peer("send", peer); }
  [[noreturn]] void recv(at::Tensor&, int peer, int = 0) const { no_peer("recv", peer); }

  void barrier() const noexcept {}

  /// Splitting one rank yields one rank, whatever the colour.
  [[nodiscard]] SingleDevice split(int /*color*/, int /*key*/ = 0) const noexcept { return {}; }

 private:
  [[noreturn]] static void no_peer(const char* op, int peer) {
    throw error(op, 0,
                "rank " + std::to_string(peer) +
                    " is not in this communicator of 1 ranks: comm::SingleDevice has no peers; use comm::Mpi "
                    "under mpirun for several ranks");
  }
};

}  // namespace paratrain::comm
