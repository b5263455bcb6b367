#pragma once
/// \file
/// comm::Nccl — collectives over NCCL on CUDA device buffers.

#include <ATen/core/Tensor.h>
#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/core/reduce_op.hpp"
#include "paratrain/comm/detail/tensor_checks.hpp"
#include "paratrain/reliability/watchdog.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain::comm {

// Note [NCCL without CUDA-enabled LibTorch]
// Debian's LibTorch (and many others) is built without CUDA, so this header uses no
// LibTorch CUDA API: it works on raw device pointers (the `void*` overloads) and
// takes at::Tensor only to read data_ptr(), numel() and dtype from a tensor whose
// device is CUDA. It thus compiles and links wherever the CUDA toolkit and NCCL are
// installed, and runs wherever a GPU is.

/// A group of GPU ranks, one device each, communicating through NCCL.
///
/// It is made collectively from a comm::Mpi over the same processes, which carries
/// NCCL's unique id from rank 0 to the others; after that MPI is not used. Each rank
/// takes the GPU `Options::device`, by default its rank among the processes of its
/// node modulo the node's GPU count. Operations are enqueued on the communicator's
/// own stream, after the work already on the default stream (Note [Stream order]);
/// the blocking forms wait for them, the `i` forms return a Request.
///
/// Choose it for: CUDA tensors. Choose comm::Mpi for CPU tensors.
class Nccl {
 public:
  struct Options {
    /// The CUDA device of this rank; -1 picks the rank within its node.
    int device = -1;
    /// How long an operation may stay pending (from its start to the end of its wait()
    /// or test()) before the watchdog reports it and ends the job: Note [Watchdog].
    std::chrono::milliseconds timeout = detail::default_timeout();
  };

  /// Completion of operations enqueued so far, through a CUDA event.
  class Request {
   public:
    Request() = default;
    Request(Request&& o) noexcept
        : event_(std::exchange(o.event_, nullptr)), rank_(o.rank_), keep_(std::move(o.keep_)), watch_(std::move(o.watch_)) {}
    Request& operator=(Request&& o) noexcept {
      std::swap(event_, o.event_);
      std::swap(keep_, o.keep_);
      std::swap(watch_, o.watch_);
      rank_ = o.rank_;
      return *this;
    }
    ~Request() {
      if (event_ != nullptr) {
        cudaEventSynchronize(event_);
        cudaEventDestroy(event_);
      }
    }
    void wait() {
      if (event_ == nullptr) return;
      cuda_check(cudaEventSynchronize(event_), "wait", rank_);
      cudaEventDestroy(std::exchange(event_, nullptr));
      watch_.release();
      keep_.clear();
    }
    [[nodiscard]] bool test() {
      if (event_ == nullptr) return true;
      const auto rc = cudaEventQuery(event_);
      if (rc == cudaErrorNotReady) return false;
      cuda_check(rc, "test", rank_);
      cudaEventDestroy(std::exchange(event_, nullptr));
      watch_.release();
      keep_.clear();
      return true;
    }

   private:
    friend class Nccl;
    Request(cudaEvent_t e, int rank, detail::Watch watch) : event_(e), rank_(rank), watch_(std::move(watch)) {}
    cudaEvent_t event_ = nullptr;
    int rank_ = -1;
    std::vector<at::Tensor> keep_;  // must outlive the operation (a caching allocator would reuse the memory)
    detail::Watch watch_;           // Note [Watchdog]
  };

  /// Rank 0 makes NCCL's unique id and broadcasts it over `bootstrap` (or its failure,
  /// so that every rank throws rather than waits); works without a GPU, so the
  /// bootstrap is testable on CPU machines. Collective over `bootstrap`.
  [[nodiscard]] static ncclUniqueId unique_id(Mpi& bootstrap) {
    struct {
      ncclUniqueId id;
      ncclResult_t rc;
    } message{{}, ncclSuccess};
    if (bootstrap.rank() == 0) message.rc = ncclGetUniqueId(&message.id);
    check_mpi(MPI_Bcast(&message, sizeof message, MPI_BYTE, 0, bootstrap.native()), "unique_id", bootstrap.rank());
    nccl_check(message.rc, "unique_id", bootstrap.rank());
    return message.id;
  }

  /// The number of CUDA devices this process sees; 0 where there is no GPU or driver.
  [[nodiscard]] static int device_count() noexcept {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
  }

  /// Collective over `bootstrap`'s ranks. Throws paratrain::error where there is no GPU.
  explicit Nccl(Mpi& bootstrap) : Nccl(bootstrap, Options{}) {}
  Nccl(Mpi& bootstrap, Options options) : state_(std::make_shared<State>()) {
    auto& s = *state_;
    s.rank = bootstrap.rank();
    s.size = bootstrap.size();
    const int devices = device_count();
    const auto id = unique_id(bootstrap);
    // Ranks without a GPU must not leave the others waiting in ncclCommInitRank.
    int without = devices == 0 ? 1 : 0;
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, &without, 1, MPI_INT, MPI_SUM, bootstrap.native()), "comm::Nccl", s.rank);
    if (without > 0)
      throw error("comm::Nccl", s.rank,
                  (devices == 0 ? std::string("no CUDA device is visible (cudaGetDeviceCount failed or found none)")
                                : "no CUDA device is visible on " + std::to_string(without) + " of the " +
                                      std::to_string(s.size) + " ranks") +
                      "; use comm::Mpi for CPU tensors, or check CUDA_VISIBLE_DEVICES and the driver");
    s.device = options.device >= 0 ? options.device : local_rank(bootstrap) % devices;
    cuda_check(cudaSetDevice(s.device), "comm::Nccl", s.rank);
    cuda_check(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking), "comm::Nccl", s.rank);
    cuda_check(cudaEventCreateWithFlags(&s.ready, cudaEventDisableTiming), "comm::Nccl", s.rank);
    nccl_check(ncclCommInitRank(&s.comm, s.size, id, s.rank), "comm::Nccl", s.rank);
    s.watched = detail::Watched("nccl", detail::world_ranks(bootstrap.native()), s.rank, options.timeout);
  }

  [[nodiscard]] int rank() const noexcept { return state_->rank; }
  [[nodiscard]] int size() const noexcept { return state_->size; }
  [[nodiscard]] int device() const noexcept { return state_->device; }
  [[nodiscard]] cudaStream_t stream() const noexcept { return state_->stream; }

  // ---- raw device buffers (Note [NCCL without CUDA-enabled LibTorch]) ----------
  Request iall_reduce(void* data, std::size_t count, at::ScalarType dtype, reduce_op op) {
    check_reduce_dtype("all_reduce", dtype, op);
    nccl_check(ncclAllReduce(data, data, count, nccl_type("all_reduce", dtype), nccl_op(op), state_->comm,
                             after_default_stream("all_reduce")),
               "all_reduce", rank());
    return record("all_reduce");
  }
  Request ibroadcast(void* data, std::size_t count, at::ScalarType dtype, int root) {
    check_root("broadcast", root);
    nccl_check(ncclBroadcast(data, data, count, nccl_type("broadcast", dtype), root, state_->comm,
                             after_default_stream("broadcast")),
               "broadcast", rank());
    return record("broadcast");
  }
  /// `in` has size() * count elements, `out` count.
  Request ireduce_scatter(const void* in, void* out, std::size_t count, at::ScalarType dtype, reduce_op op) {
    check_reduce_dtype("reduce_scatter", dtype, op);
    nccl_check(ncclReduceScatter(in, out, count, nccl_type("reduce_scatter", dtype), nccl_op(op), state_->comm,
                                 after_default_stream("reduce_scatter")),
               "reduce_scatter", rank());
    return record("reduce_scatter");
  }
  /// `in` has count elements, `out` size() * count.
  Request iall_gather(const void* in, void* out, std::size_t count, at::ScalarType dtype) {
    nccl_check(ncclAllGather(in, out, count, nccl_type("all_gather", dtype), state_->comm,
                             after_default_stream("all_gather")),
               "all_gather", rank());
    return record("all_gather");
  }
  Request isend(const void* data, std::size_t count, at::ScalarType dtype, int peer) {
    check_root("send", peer);
    nccl_check(ncclSend(data, count, nccl_type("send", dtype), peer, state_->comm, after_default_stream("send")),
               "send", rank());
    return record("send");
  }
  Request irecv(void* data, std::size_t count, at::ScalarType dtype, int peer) {
    check_root("recv", peer);
    nccl_check(ncclRecv(data, count, nccl_type("recv", dtype), peer, state_->comm, after_default_stream("recv")),
               "recv", rank());
    return record("recv");
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
  void send(const at::Tensor& t, int peer, int /*tag*/ = 0) {
    check_device("send", t);
    isend(t.data_ptr(), n(t), t.scalar_type(), peer).wait();
  }
  void recv(at::Tensor& t, int peer, int /*tag*/ = 0) {
    check_device("recv", t);
    irecv(t.data_ptr(), n(t), t.scalar_type(), peer).wait();
  }
  /// Waits for everything enqueued on this communicator, on every rank.
  void barrier() {
    float* one = nullptr;
    cuda_check(cudaMalloc(&one, sizeof(float)), "barrier", rank());
    auto r = iall_reduce(one, 1, at::kFloat, reduce_op::sum);
    r.wait();
    cudaFree(one);
  }

 private:
  struct State {
    ~State() {
      if (comm != nullptr) ncclCommDestroy(comm);
      if (ready != nullptr) cudaEventDestroy(ready);
      if (stream != nullptr) cudaStreamDestroy(stream);
    }
    ncclComm_t comm = nullptr;
    cudaStream_t stream = nullptr;
    cudaEvent_t ready = nullptr;  // Note [Stream order]
    int rank = 0, size = 1, device = 0;
    detail::Watched watched;  // Note [Watchdog]
  };

  static void nccl_check(ncclResult_t rc, const char* op, int rank) {
    if (rc != ncclSuccess) throw error(op, rank, std::string("NCCL failed: ") + ncclGetErrorString(rc));
  }
  static void cuda_check(cudaError_t rc, const char* op, int rank) {
    if (rc != cudaSuccess) throw error(op, rank, std::string("CUDA failed: ") + cudaGetErrorString(rc));
  }
  static void check_mpi(int rc, const char* op, int rank) {
    if (rc != MPI_SUCCESS) throw error(op, rank, "MPI failed while broadcasting NCCL's unique id");
  }

  static int local_rank(Mpi& bootstrap) {
    MPI_Comm node = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split_type(bootstrap.native(), MPI_COMM_TYPE_SHARED, bootstrap.rank(), MPI_INFO_NULL, &node),
              "comm::Nccl", bootstrap.rank());
    int local = 0;
    MPI_Comm_rank(node, &local);
    MPI_Comm_free(&node);
    return local;
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
  static ncclRedOp_t nccl_op(reduce_op op) {
    switch (op) {
      case reduce_op::sum: return ncclSum;
      case reduce_op::average: return ncclAvg;
      case reduce_op::max: return ncclMax;
      case reduce_op::min: return ncclMin;
    }
    return ncclSum;
  }

  void check_reduce_dtype(const char* op, at::ScalarType t, reduce_op r) const {
    if (!detail::is_supported_dtype(t))
      throw error(op, rank(), "dtype " + std::string(c10::toString(t)) + " is not supported by comm::Nccl");
    if (r == reduce_op::average && !at::isFloatingType(t))
      throw error(op, rank(), "average of an integer buffer would truncate; reduce with reduce_op::sum and divide");
  }
  void check_root(const char* op, int peer) const {
    if (peer < 0 || peer >= size())
      throw error(op, rank(), "rank " + std::to_string(peer) + " is not in this communicator of " +
                                  std::to_string(size()) + " ranks");
  }
  void check_device(const char* op, const at::Tensor& t) const {
    detail::check_buffer(op, rank(), t);
    if (!t.is_cuda())
      throw error(op, rank(), "comm::Nccl takes CUDA tensors; this one is on " + t.device().str() +
                                  " (use comm::Mpi for CPU tensors)");
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

  Request record(const char* op) {
    cudaEvent_t e = nullptr;
    cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), op, rank());
    cuda_check(cudaEventRecord(e, stream()), op, rank());
    // Watched from here to its wait(): the watchdog (Note [Watchdog]) ends the job through
    // MPI when a peer never joins. NCCL's collectives are counted but not fingerprinted.
    return Request(e, rank(), state_->watched.collective(op));
  }

  std::shared_ptr<State> state_;
};

}  // namespace paratrain::comm
