#pragma once
/// \file
/// comm::Nccl — collectives over NCCL on CUDA device buffers.

#include <ATen/core/Tensor.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "paratrain/core/reduce_op.hpp"
#include "paratrain/comm/detail/skeleton.hpp"
#include "paratrain/comm/nccl/detail/state.hpp"
#include "paratrain/comm/nccl/options.hpp"
#include "paratrain/comm/detail/tensor_checks.hpp"
#include "paratrain/reliability/collective_signature.hpp"
#include "paratrain/reliability/watchdog.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain::comm {

// Note [NCCL without CUDA-enabled LibTorch]
// Debian's LibTorch (and many others) is built without CUDA, so this header uses no
// LibTorch CUDA API: it works on raw device pointers (the `void*` overloads) and
// takes at::Tensor only to read data_ptr(), numel() and dtype from a tensor whose
// device is CUDA. It thus compiles and links wherever the CUDA toolkit and NCCL are
// installed, and runs wherever a GPU is.

// Note [NCCL bootstrap]
// NCCL's ranks meet through a 128-byte unique id that one rank makes (ncclGetUniqueId, which
// needs no GPU) and every other rank receives before ncclCommInitRank. How it travels is not
// NCCL's business, so it is not comm::Nccl's either: Nccl is made from a Bootstrap, the id
// already agreed plus this rank's place, and needs no MPI. comm/nccl/bootstrap_over_mpi.hpp agrees
// one over a comm::Mpi (a broadcast); comm/nccl/bootstrap_over_store.hpp over a
// comm::Rendezvous (torchrun's TCPStore at MASTER_ADDR:MASTER_PORT, or a file: rank 0 sets
// the bytes, the others get them), so that torchrun-style launches need no MPI. A bootstrap
// also agrees that every rank has a GPU: a rank that throws before ncclCommInitRank would
// leave the others waiting inside it until their timeout.

/// A group of GPU ranks, one device each, communicating through NCCL.
///
/// It is made collectively from NCCL's unique id, agreed by a bootstrap (Note [NCCL
/// bootstrap]): `Nccl(Nccl::Bootstrap{...})`, or `Nccl(world)` over a comm::Mpi with
/// comm/nccl/bootstrap_over_mpi.hpp included. Each rank takes the GPU `Options::device`, by
/// default its rank among the processes of its node modulo the node's GPU count. Operations
/// are enqueued on the communicator's own stream, after the work already on the default
/// stream (Note [Stream order]); the blocking forms wait for them, the `i` forms return a
/// Request. Like comm::Mpi and comm::Gloo, every operation checks its arguments before any
/// CUDA or NCCL call, is counted and watched (Note [Watchdog]), its collectives' fingerprint
/// compared every 256 (Note [Collective fingerprint]), and checked in full across ranks when
/// Options::validate is set (Note [Collective validation]).
///
/// Choose it for: CUDA tensors. Choose comm::Mpi for CPU tensors.
class Nccl {
  using State = detail::NcclState;  // the communicator, its stream and its watch: shared by copies and requests

 public:
  using Options = NcclOptions;  // comm/nccl/options.hpp
  using Handles = detail::NcclHandles;  // comm/nccl/detail/state.hpp

  /// Every operation takes CUDA buffers only: a strategy moves what it reduces to the model's
  /// device (collectives/all_reduce_on.hpp), a pipeline sends its headers from there.
  static constexpr bool device_buffers_only = true;

  /// What a rank needs to join: NCCL's unique id, the same on every rank, and its place.
  /// Made by a bootstrap: Note [NCCL bootstrap].
  struct Bootstrap {
    ncclUniqueId id{};
    int rank = 0;
    int size = 1;
    /// This rank among the processes of its node: picks the GPU when Options::device is -1.
    int local_rank = 0;
    /// The members' ranks in the job's world, in this group's rank order, for the watchdog's
    /// reports; empty: 0 .. size-1.
    std::vector<int> world_ranks;
  };

  /// Completion of operations enqueued so far, through a CUDA event: wait() returns once
  /// the operation is complete on the GPU, or throws paratrain::error when NCCL reports an
  /// error meanwhile (Note [NCCL errors]). Dropping one waits for it, except during stack
  /// unwinding (Note [Dropped requests]).
  using Request = detail::BasicRequest<Handles>;

  /// NCCL's unique id through a bootstrap found by argument-dependent lookup, as
  /// `nccl_unique_id(comm::Mpi&)` in comm/nccl/bootstrap_over_mpi.hpp. Collective over its ranks.
  template <class B>
    requires requires(B& b) {
      { nccl_unique_id(b) } -> std::same_as<ncclUniqueId>;
    }
  [[nodiscard]] static ncclUniqueId unique_id(B& bootstrap) {
    return nccl_unique_id(bootstrap);
  }

  /// A bootstrap's error where `without` of `size` ranks see no GPU, this one seeing
  /// `devices`; `alternative` names the communicator for CPU tensors.
  [[nodiscard]] static error no_gpu_error(int rank, int devices, int without, int size, const char* alternative) {
    return error("comm::Nccl", rank,
                 (devices == 0 ? std::string("no CUDA device is visible (cudaGetDeviceCount failed or found none)")
                               : "no CUDA device is visible on " + std::to_string(without) + " of the " +
                                     std::to_string(size) + " ranks") +
                     "; use " + alternative + " for CPU tensors, or check CUDA_VISIBLE_DEVICES and the driver");
  }

  /// The number of CUDA devices this process sees; 0 where there is no GPU or driver.
  [[nodiscard]] static int device_count() noexcept {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
  }

  /// Joins the group whose id `b` carries. Collective over its ranks (they all block in
  /// ncclCommInitRank until every one has joined). Checks `b` before any CUDA call, and
  /// throws paratrain::error where there is no GPU.
  explicit Nccl(const Bootstrap& b) : Nccl(b, Options{}) {}
  Nccl(const Bootstrap& b, Options options) : state_(std::make_shared<State>()) {
    if (b.size < 1)
      throw error("comm::Nccl", b.rank, "Bootstrap::size " + std::to_string(b.size) + " is not at least 1");
    if (b.rank < 0 || b.rank >= b.size)
      throw error("comm::Nccl", b.rank,
                  "Bootstrap::rank " + std::to_string(b.rank) + " is not in a world of " + std::to_string(b.size) +
                      " (0.." + std::to_string(b.size - 1) + ")");
    if (!b.world_ranks.empty() && b.world_ranks.size() != static_cast<std::size_t>(b.size))
      throw error("comm::Nccl", b.rank,
                  "Bootstrap::world_ranks names " + std::to_string(b.world_ranks.size()) + " ranks but size is " +
                      std::to_string(b.size) + "; give one per rank, or none");
    auto& s = *state_;
    const int devices = device_count();
    if (devices == 0)
      throw error("comm::Nccl", b.rank,
                  "no CUDA device is visible (cudaGetDeviceCount failed or found none); use comm::Mpi for CPU "
                  "tensors, or check CUDA_VISIBLE_DEVICES and the driver");
    s.device = options.device >= 0 ? options.device : b.local_rank % devices;
    cuda_check(cudaSetDevice(s.device), "comm::Nccl", b.rank);
    cuda_check(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking), "comm::Nccl", b.rank);
    cuda_check(cudaEventCreateWithFlags(&s.ready, cudaEventDisableTiming), "comm::Nccl", b.rank);
    nccl_check(ncclCommInitRank(&s.comm, b.size, b.id, b.rank), "comm::Nccl", b.rank);
    auto members = b.world_ranks;
    if (members.empty())
      for (int r = 0; r < b.size; ++r) members.push_back(r);
    s.skeleton =
        detail::Skeleton(b.rank, b.size, options.validate, detail::Watched("nccl", std::move(members), b.rank, options.timeout));
    s.options = std::move(options);
  }

  /// Joins the group the launcher describes, through a comm::Rendezvous: torchrun's
  /// RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT, or SLURM's ranks with
  /// MASTER_ADDR and MASTER_PORT exported (docs/gpu-cluster.md); the GPU is the local rank's.
  /// So `DataParallel<Net, comm::Nccl, ...>` is made like every other strategy. Collective.
  /// Defined in comm/nccl/bootstrap_over_store.hpp, which this header includes at its end.
  Nccl();
  explicit Nccl(Options options);

  /// Joins through a bootstrap found by argument-dependent lookup: `nccl_bootstrap(b)`
  /// returning a Bootstrap, as comm/nccl/bootstrap_over_mpi.hpp gives for comm::Mpi. Collective
  /// over its ranks.
  template <class B>
    requires requires(B& b) {
      { nccl_bootstrap(b) } -> std::same_as<Bootstrap>;
    }
  explicit Nccl(B& bootstrap, Options options = {}) : Nccl(nccl_bootstrap(bootstrap), std::move(options)) {}

  [[nodiscard]] int rank() const noexcept { return state_->skeleton.rank(); }
  [[nodiscard]] int size() const noexcept { return state_->skeleton.size(); }
  [[nodiscard]] int device() const noexcept { return state_->device; }
  [[nodiscard]] cudaStream_t stream() const noexcept { return state_->stream; }
  /// NCCL's communicator, for what paratrain does not wrap.
  [[nodiscard]] ncclComm_t native() const noexcept { return state_->comm; }

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
  /// The ranks that pass the same `color`, ordered by `key` (then by rank), as a new group on
  /// the same devices (ncclCommSplit: no new unique id, no bootstrap). Collective: every rank
  /// of this group calls it. ZeRO-3's gathers, pipelines and hybrid sharding need it.
  [[nodiscard]] Nccl split(int color, int key = 0) const {
    if (color < 0) skeleton().fail("split", "color must be >= 0 (got " + std::to_string(color) + ")");
    auto& self = const_cast<Nccl&>(*this);  // the word collectives enqueue on this group's stream
    self.check_async_error("split");
    const auto watch = skeleton().collective("split");
    // Every rank's (color, key), for the new group's members in the world's numbering (the
    // watchdog's reports); NCCL orders them the same way (key, then rank).
    auto mine = at::empty({2}, at::kLong);
    mine.data_ptr<std::int64_t>()[0] = color;
    mine.data_ptr<std::int64_t>()[1] = key;
    auto all = at::empty({2 * size()}, at::kLong);
    Words{self}.all_gather("split", mine, all);
    const auto* v = all.data_ptr<std::int64_t>();
    std::vector<std::pair<std::int64_t, int>> members;
    for (int r = 0; r < size(); ++r)
      if (v[2 * r] == color) members.emplace_back(v[2 * r + 1], r);
    std::sort(members.begin(), members.end());
    const auto me = std::find(members.begin(), members.end(), std::pair<std::int64_t, int>{key, rank()});
    const auto new_rank = static_cast<int>(me - members.begin());

    auto s = std::make_shared<State>();
    s->device = state_->device;
    s->options = state_->options;
    cuda_check(cudaSetDevice(s->device), "split", rank());
    cuda_check(cudaStreamCreateWithFlags(&s->stream, cudaStreamNonBlocking), "split", rank());
    cuda_check(cudaEventCreateWithFlags(&s->ready, cudaEventDisableTiming), "split", rank());
    nccl_check(ncclCommSplit(state_->comm, color, key, &s->comm, nullptr), "split", rank());
    const auto& parent = skeleton().watched().ledger();
    std::vector<int> world;
    for (const auto& [k, r] : members) world.push_back(parent.members()[static_cast<std::size_t>(r)]);
    s->skeleton = detail::Skeleton(
        new_rank, static_cast<int>(members.size()), s->options.validate,
        detail::Watched("split " + std::to_string(color) + " of " + parent.name(), std::move(world), new_rank,
                        s->options.timeout));
    return Nccl(std::move(s));
  }
#endif

  // ---- raw device buffers (Note [NCCL without CUDA-enabled LibTorch]) ----------
  Request iall_reduce(void* data, std::size_t count, at::ScalarType dtype, reduce_op op) {
    check_reduce_dtype("all_reduce", dtype, op);
    auto watch = begin("all_reduce", dtype, count, static_cast<int>(op));
    nccl_check(ncclAllReduce(data, data, count, nccl_type("all_reduce", dtype), nccl_op(op), state_->comm,
                             after_default_stream("all_reduce")),
               "all_reduce", rank());
    return record("all_reduce", std::move(watch));
  }
  Request ibroadcast(void* data, std::size_t count, at::ScalarType dtype, int root) {
    check_dtype("broadcast", dtype);
    skeleton().check_peer("broadcast", root);
    auto watch = begin("broadcast", dtype, count, root);
    nccl_check(ncclBroadcast(data, data, count, nccl_type("broadcast", dtype), root, state_->comm,
                             after_default_stream("broadcast")),
               "broadcast", rank());
    return record("broadcast", std::move(watch));
  }
  /// `in` has size() * count elements, `out` count.
  Request ireduce_scatter(const void* in, void* out, std::size_t count, at::ScalarType dtype, reduce_op op) {
    check_reduce_dtype("reduce_scatter", dtype, op);
    // Counted by `in`'s elements, as comm::Mpi and comm::Gloo count a reduce-scatter.
    auto watch = begin("reduce_scatter", dtype, count * static_cast<std::size_t>(size()), static_cast<int>(op));
    nccl_check(ncclReduceScatter(in, out, count, nccl_type("reduce_scatter", dtype), nccl_op(op), state_->comm,
                                 after_default_stream("reduce_scatter")),
               "reduce_scatter", rank());
    return record("reduce_scatter", std::move(watch));
  }
  /// `in` has count elements, `out` size() * count.
  Request iall_gather(const void* in, void* out, std::size_t count, at::ScalarType dtype) {
    check_dtype("all_gather", dtype);
    auto watch = begin("all_gather", dtype, count, 0);
    nccl_check(ncclAllGather(in, out, count, nccl_type("all_gather", dtype), state_->comm,
                             after_default_stream("all_gather")),
               "all_gather", rank());
    return record("all_gather", std::move(watch));
  }
  // Note [NCCL point-to-point]
  // NCCL has no tags: the messages between two ranks match in the order each side posts them,
  // and a send is not buffered: it completes, on the communicator's stream, only once the
  // peer has posted the matching receive. So both sides must post a pair's messages in the
  // same order, and two ranks that send to each other must do it in one group (iexchange),
  // or each send waits for a receive queued behind the other's send. The tag is checked
  // (>= 0) and named in the watchdog's reports, but matches nothing. A pipeline over
  // comm::Nccl keeps each direction on a group of its own: Note [One group per direction].

  /// `tag` names the message in the watchdog's reports; NCCL has no tags and matches a pair's
  /// messages in the order they are posted (Note [NCCL point-to-point]).
  Request isend(const void* data, std::size_t count, at::ScalarType dtype, int peer, int tag = 0) {
    check_point_to_point("send", dtype, peer, tag);
    auto watch = skeleton().point_to_point("send", peer, tag);
    nccl_check(ncclSend(data, count, nccl_type("send", dtype), peer, state_->comm, after_default_stream("send")),
               "send", rank());
    return record("send", std::move(watch));
  }
  Request irecv(void* data, std::size_t count, at::ScalarType dtype, int peer, int tag = 0) {
    check_point_to_point("recv", dtype, peer, tag);
    auto watch = skeleton().point_to_point("recv", peer, tag);
    nccl_check(ncclRecv(data, count, nccl_type("recv", dtype), peer, state_->comm, after_default_stream("recv")),
               "recv", rank());
    return record("recv", std::move(watch));
  }

  // ---- tensors whose device is CUDA ---------------------------------------------
  Request iall_reduce(at::Tensor& t, reduce_op op) {
    check_device("all_reduce", t);
    auto r = iall_reduce(t.data_ptr(), n(t), t.scalar_type(), op);
    r.keep_ = {t};
    return r;
  }
  void all_reduce(at::Tensor& t, reduce_op op) { iall_reduce(t, op).wait(); }
  Request ibroadcast(at::Tensor& t, int root) {
    check_device("broadcast", t);
    auto r = ibroadcast(t.data_ptr(), n(t), t.scalar_type(), root);
    r.keep_ = {t};
    return r;
  }
  void broadcast(at::Tensor& t, int root) { ibroadcast(t, root).wait(); }
  /// Reduces `in` (size() equal parts, one per rank) and leaves part rank() in `out`.
  Request ireduce_scatter(const at::Tensor& in, at::Tensor& out, reduce_op op) {
    check_device("reduce_scatter", in);
    check_device("reduce_scatter", out);
    detail::check_reduce_scatter(rank(), size(), in, out, op);
    auto r = ireduce_scatter(in.data_ptr(), out.data_ptr(), n(out), in.scalar_type(), op);
    r.keep_ = {in, out};
    return r;
  }
  void reduce_scatter(const at::Tensor& in, at::Tensor& out, reduce_op op) { ireduce_scatter(in, out, op).wait(); }
  /// Concatenates every rank's `in`, in rank order, into `out`. In place when `in` is
  /// part rank() of `out`: NCCL detects that itself (sendbuff == recvbuff + rank * count).
  Request iall_gather(const at::Tensor& in, at::Tensor& out) {
    check_device("all_gather", in);
    check_device("all_gather", out);
    detail::check_all_gather(rank(), size(), in, out);
    auto r = iall_gather(in.data_ptr(), out.data_ptr(), n(in), in.scalar_type());
    r.keep_ = {in, out};
    return r;
  }
  void all_gather(const at::Tensor& in, at::Tensor& out) { iall_gather(in, out).wait(); }
  /// Part i of `in` (size() equal parts) goes to rank i; part i of `out`, as large as `in`,
  /// is what rank i sent this rank. The uneven form takes each part's element count, as
  /// comm::Mpi's does (Note [All-to-all across ranks]). One NCCL group of a send and a
  /// receive per peer with a non-empty part (NCCL has no all-to-all of its own; PyTorch's
  /// NCCL backend does the same), this rank's own part included.
  Request iall_to_all(const at::Tensor& in, at::Tensor& out) { return iall_to_all(in, {}, out, {}); }
  Request iall_to_all(const at::Tensor& in, std::span<const std::int64_t> in_counts, at::Tensor& out,
                      std::span<const std::int64_t> out_counts) {
    check_device("all_to_all", in);
    check_device("all_to_all", out);
    const auto layout = detail::check_all_to_all(rank(), size(), in, in_counts, out, out_counts);
    check_dtype("all_to_all", in.scalar_type());
    check_async_error("all_to_all");
    auto watch = skeleton().begin_all_to_all("all_to_all", in.scalar_type(), layout, Words{*this});
    const auto type = nccl_type("all_to_all", in.scalar_type());
    const auto bytes = static_cast<std::size_t>(in.element_size());
    const auto* source = static_cast<const char*>(in.data_ptr());
    auto* target = static_cast<char*>(out.data_ptr());
    const auto stream = after_default_stream("all_to_all");
    nccl_check(ncclGroupStart(), "all_to_all", rank());
    ncclResult_t rc = ncclSuccess;
    std::size_t sent = 0, received = 0;  // elements before part `peer` of in and of out
    for (int peer = 0; peer < size() && rc == ncclSuccess; ++peer) {
      const auto i = static_cast<std::size_t>(peer);
      const auto send = static_cast<std::size_t>(layout.in_count(i)), recv = static_cast<std::size_t>(layout.out_count(i));
      if (send > 0) rc = ncclSend(source + sent * bytes, send, type, peer, state_->comm, stream);
      if (rc == ncclSuccess && recv > 0) rc = ncclRecv(target + received * bytes, recv, type, peer, state_->comm, stream);
      sent += send, received += recv;
    }
    const auto end = ncclGroupEnd();
    nccl_check(rc, "all_to_all", rank());
    nccl_check(end, "all_to_all", rank());
    auto r = record("all_to_all", std::move(watch));
    r.keep_ = {in, out};
    return r;
  }
  void all_to_all(const at::Tensor& in, at::Tensor& out) { iall_to_all(in, out).wait(); }
  void all_to_all(const at::Tensor& in, std::span<const std::int64_t> in_counts, at::Tensor& out,
                  std::span<const std::int64_t> out_counts) {
    iall_to_all(in, in_counts, out, out_counts).wait();
  }

  /// Note [NCCL point-to-point]: a send completes once the peer has posted its receive.
  Request isend(const at::Tensor& t, int peer, int tag = 0) {
    check_device("send", t);
    auto r = isend(t.data_ptr(), n(t), t.scalar_type(), peer, tag);
    r.keep_ = {t};
    return r;
  }
  Request irecv(at::Tensor& t, int peer, int tag = 0) {
    check_device("recv", t);
    auto r = irecv(t.data_ptr(), n(t), t.scalar_type(), peer, tag);
    r.keep_ = {t};
    return r;
  }
  void send(const at::Tensor& t, int peer, int tag = 0) { isend(t, peer, tag).wait(); }
  void recv(at::Tensor& t, int peer, int tag = 0) { irecv(t, peer, tag).wait(); }

  /// One message of an exchange: the tensor to send or to receive into, and the peer.
  struct Message {
    at::Tensor tensor;
    int peer = 0;
    int tag = 0;
  };
  /// Sends and receives `sends` and `recvs` together, as one NCCL group (ncclGroupStart/End,
  /// PyTorch's batch_isend_irecv): two ranks that send to each other cannot wait for each
  /// other's receive, which separate calls would (Note [NCCL point-to-point]). One request
  /// for all of them.
  Request iexchange(std::span<const Message> sends, std::span<const Message> recvs) {
    std::vector<at::Tensor> keep;
    for (const auto* list : {&sends, &recvs})
      for (const auto& m : *list) {
        check_device(list == &sends ? "send" : "recv", m.tensor);
        check_point_to_point(list == &sends ? "send" : "recv", m.tensor.scalar_type(), m.peer, m.tag);
        keep.push_back(m.tensor);
      }
    if (sends.empty() && recvs.empty()) return Request{};
    check_async_error("exchange");
    // Watched as its first message (a point-to-point operation: no collective fingerprint).
    const auto& first = !sends.empty() ? sends.front() : recvs.front();
    auto watch = skeleton().point_to_point(!sends.empty() ? "send" : "recv", first.peer, first.tag);
    const auto stream = after_default_stream("exchange");
    nccl_check(ncclGroupStart(), "exchange", rank());
    ncclResult_t rc = ncclSuccess;
    for (const auto& m : sends)
      if (rc == ncclSuccess)
        rc = ncclSend(m.tensor.data_ptr(), n(m.tensor), nccl_type("send", m.tensor.scalar_type()), m.peer,
                      state_->comm, stream);
    for (const auto& m : recvs)
      if (rc == ncclSuccess)
        rc = ncclRecv(m.tensor.data_ptr(), n(m.tensor), nccl_type("recv", m.tensor.scalar_type()), m.peer,
                      state_->comm, stream);
    const auto end = ncclGroupEnd();
    nccl_check(rc, "exchange", rank());
    nccl_check(end, "exchange", rank());
    auto r = record("exchange", std::move(watch));
    r.keep_ = std::move(keep);
    return r;
  }

  /// Waits for everything enqueued on this communicator, on every rank.
  void barrier() {
    // A float of its own, made once: cudaMalloc and cudaFree would synchronise the device on
    // every call (and the word collectives' scratch may be regrown by the all-reduce's preamble).
    auto& word = state_->barrier_word;
    if (word == nullptr) cuda_check(cudaMalloc(&word, sizeof(float)), "barrier", rank());
    iall_reduce(word, 1, at::kFloat, reduce_op::sum).wait();
  }

 private:
  explicit Nccl(std::shared_ptr<State> s) : state_(std::move(s)) {}

  static void nccl_check(ncclResult_t rc, const char* op, int rank) { detail::nccl_check(rc, op, rank); }
  static void cuda_check(cudaError_t rc, const char* op, int rank) { detail::cuda_check(rc, op, rank); }

  [[nodiscard]] const detail::Skeleton& skeleton() const noexcept { return state_->skeleton; }

  // The skeleton's preamble (comm/detail/skeleton.hpp), after the arguments are checked and
  // before anything is enqueued.
  [[nodiscard]] detail::Watch begin(const char* op, at::ScalarType dtype, std::size_t count, int detail) {
    check_async_error(op);
    return skeleton().begin(op, dtype, static_cast<std::int64_t>(count), detail, Words{*this});
  }

  // The skeleton's word collectives: the host words through a device buffer, on this
  // communicator's stream, waited for.
  struct Words {
    Nccl& comm;
    void all_reduce_max(const char* op, at::Tensor& w) const {
      const auto bytes = static_cast<std::size_t>(w.numel()) * sizeof(std::int64_t);
      auto* d = comm.scratch(op, bytes);
      comm.on_stream(op, cudaMemcpyAsync(d, w.data_ptr(), bytes, cudaMemcpyHostToDevice, comm.stream()));
      comm.nccl_check(ncclAllReduce(d, d, static_cast<std::size_t>(w.numel()), ncclInt64, ncclMax, comm.state_->comm,
                                    comm.stream()),
                      op, comm.rank());
      comm.on_stream(op, cudaMemcpyAsync(w.data_ptr(), d, bytes, cudaMemcpyDeviceToHost, comm.stream()));
      comm.on_stream(op, cudaStreamSynchronize(comm.stream()));
    }
    void all_gather(const char* op, const at::Tensor& in, at::Tensor& out) const {
      const auto part = static_cast<std::size_t>(in.numel()) * sizeof(std::int64_t);
      auto* d = static_cast<char*>(comm.scratch(op, part * static_cast<std::size_t>(comm.size() + 1)));
      comm.on_stream(op, cudaMemcpyAsync(d, in.data_ptr(), part, cudaMemcpyHostToDevice, comm.stream()));
      comm.nccl_check(ncclAllGather(d, d + part, static_cast<std::size_t>(in.numel()), ncclInt64, comm.state_->comm,
                                    comm.stream()),
                      op, comm.rank());
      comm.on_stream(op, cudaMemcpyAsync(out.data_ptr(), d + part, part * static_cast<std::size_t>(comm.size()),
                                         cudaMemcpyDeviceToHost, comm.stream()));
      comm.on_stream(op, cudaStreamSynchronize(comm.stream()));
    }
  };
  void on_stream(const char* op, cudaError_t rc) const { cuda_check(rc, op, rank()); }
  // At least `bytes` of device memory, kept for the next word collective.
  void* scratch(const char* op, std::size_t bytes) {
    auto& s = *state_;
    if (s.scratch_bytes < bytes) {
      if (s.scratch != nullptr) cuda_check(cudaFree(std::exchange(s.scratch, nullptr)), op, rank());
      s.scratch_bytes = 0;
      cuda_check(cudaMalloc(&s.scratch, bytes), op, rank());
      s.scratch_bytes = bytes;
    }
    return s.scratch;
  }

  ncclDataType_t nccl_type(const char* op, at::ScalarType t) const {
    switch (t) {
      case at::kFloat: return ncclFloat32;
      case at::kDouble: return ncclFloat64;
      case at::kBFloat16: return ncclBfloat16;
      case at::kHalf: return ncclFloat16;
      case at::kInt: return ncclInt32;
      case at::kLong: return ncclInt64;
      default:
        throw error(op, rank(), "dtype " + std::string(c10::toString(t)) +
                                    " is not supported by comm::Nccl; supported are float32, float64, bfloat16, "
                                    "float16, int32 and int64");
    }
  }
  // Note [An average over one rank]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // Over one rank an average is the rank's own buffer, and NCCL 2.28's ncclAvg left the last
  // element of an odd-sized buffer unwritten there (seen on an H200: a reduce-scatter of
  // 2,359,297 floats, blocking and not; its sum and max wrote every element, and so did
  // PyTorch's average, a premultiplied sum). So it is summed. Over more ranks ncclAvg stays:
  // it has not been run on several GPUs here.
  ncclRedOp_t nccl_op(reduce_op op) const {
    switch (op) {
      case reduce_op::sum: return ncclSum;
      case reduce_op::average: return size() == 1 ? ncclSum : ncclAvg;
      case reduce_op::max: return ncclMax;
      case reduce_op::min: return ncclMin;
    }
    return ncclSum;
  }

  void check_async_error(const char* op) { state_->check_async_error(op, rank()); }

  void check_point_to_point(const char* op, at::ScalarType dtype, int peer, int tag) {
    check_dtype(op, dtype);
    skeleton().check_peer(op, peer);
    if (peer == rank()) skeleton().fail(op, "rank " + std::to_string(peer) + " is this rank; NCCL cannot send to itself");
    if (tag < 0) skeleton().fail(op, "tag " + std::to_string(tag) + " is negative; tags count up from 0");
    check_async_error(op);
  }

  void check_dtype(const char* op, at::ScalarType t) const {
    if (!detail::is_supported_dtype(t))
      skeleton().fail(op, "dtype " + std::string(c10::toString(t)) +
                              " is not supported by comm::Nccl; supported are float32, float64, bfloat16, float16, "
                              "int32 and int64");
  }
  void check_reduce_dtype(const char* op, at::ScalarType t, reduce_op r) const {
    check_dtype(op, t);
    if (r == reduce_op::average && !at::isFloatingType(t))
      skeleton().fail(op, "average of an integer buffer would truncate; reduce with reduce_op::sum and divide");
  }
  void check_device(const char* op, const at::Tensor& t) const {
    detail::check_buffer(op, rank(), t);
    if (!t.is_cuda())
      throw error(op, rank(), "comm::Nccl takes CUDA tensors; this one is on " + t.device().str() +
                                  " (use comm::Mpi for CPU tensors)");
    if (t.device().index() != state_->device)
      throw error(op, rank(),
                  "this comm::Nccl works on cuda:" + std::to_string(state_->device) + "; this tensor is on " +
                      t.device().str() + " (move it there, or make the communicator on that GPU)");
  }
  static std::size_t n(const at::Tensor& t) { return static_cast<std::size_t>(t.numel()); }

  // Note [Stream order]
  // The communicator's stream is non-blocking, so that compute on the default stream
  // can overlap communication; but then nothing orders it after the kernels and copies
  // that produced the buffer. Each operation therefore first makes the stream wait for
  // the work already enqueued on the legacy default stream (cudaMemcpy, LibTorch's
  // default stream), as ProcessGroupNCCL waits for the current stream. Work on other
  // streams must be synchronised by the caller.
  cudaStream_t after_default_stream(const char* op) {
    cuda_check(cudaEventRecord(state_->ready, cudaStreamLegacy), op, rank());
    cuda_check(cudaStreamWaitEvent(stream(), state_->ready, 0), op, rank());
    return stream();
  }

  // The operation's completion, watched from its start (Note [Watchdog]) to its wait(). Where
  // CUDA cannot give it an event, the operation is already enqueued and no request will keep
  // its buffers: the stream is waited for before the throw, so that no buffer is freed under it.
  Request record(const char* op, detail::Watch watch) {
    cudaEvent_t e = nullptr;
    const auto failed = [&](cudaError_t rc) {
      if (e != nullptr) cudaEventDestroy(e);
      cudaStreamSynchronize(stream());
      cuda_check(rc, op, rank());
    };
    if (const auto rc = cudaEventCreateWithFlags(&e, cudaEventDisableTiming); rc != cudaSuccess) failed(rc);
    if (const auto rc = cudaEventRecord(e, stream()); rc != cudaSuccess) failed(rc);
    Request r(op, rank(), {});
    r.native_.event = e;
    r.native_.state = state_;
    r.watch_ = std::move(watch);
    return r;
  }

  std::shared_ptr<State> state_;
};

}  // namespace paratrain::comm

// Nccl() meets through a comm::Rendezvous, whose bootstrap needs the class above whole.
#include "paratrain/comm/nccl/bootstrap_over_store.hpp"  // IWYU pragma: export
