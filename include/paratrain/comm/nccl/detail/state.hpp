#pragma once
/// \file
/// What copies of a comm::Nccl and its requests share: the communicator, its stream and its
/// watch (NcclState); what a request holds: its event (NcclHandles, for detail::BasicRequest).

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "paratrain/comm/detail/skeleton.hpp"
#include "paratrain/comm/nccl/options.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain::comm {
class Nccl;
}  // namespace paratrain::comm

namespace paratrain::detail {

inline void nccl_check(ncclResult_t rc, const char* op, int rank) {
  if (rc != ncclSuccess) throw error(op, rank, std::string("NCCL failed: ") + ncclGetErrorString(rc));
}
inline void cuda_check(cudaError_t rc, const char* op, int rank) {
  if (rc != cudaSuccess) throw error(op, rank, std::string("CUDA failed: ") + cudaGetErrorString(rc));
}

struct NcclState {
  ~NcclState() {
    if (scratch != nullptr) cudaFree(scratch);
    if (barrier_word != nullptr) cudaFree(barrier_word);
    if (comm != nullptr && aborted.empty()) ncclCommDestroy(comm);
    if (ready != nullptr) cudaEventDestroy(ready);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr;  // Note [Stream order]
  void* scratch = nullptr;      // the word collectives' device buffer
  void* barrier_word = nullptr;  // barrier()'s float
  std::size_t scratch_bytes = 0;
  int device = 0;
  comm::NcclOptions options;
  detail::Skeleton skeleton;  // rank, size; Note [Watchdog], Note [Collective fingerprint]
  std::string aborted;        // why ncclCommAbort ended the communicator: Note [NCCL errors]

  // Note [NCCL errors]
  // NCCL reports some failures only asynchronously: a peer that died, a network error, an
  // operation that cannot complete (ncclCommGetAsyncError). A wait() polls its event and the
  // communicator's error alternately, so that instead of waiting on a GPU that will never
  // finish, it aborts the communicator (ncclCommAbort: NCCL's kernels then return) and
  // throws paratrain::error naming NCCL's error, on this rank; every later operation on the
  // communicator throws the same. The other ranks see their own errors, or their watchdog
  // names the operation that does not complete (Note [Watchdog]). A hang that NCCL does not
  // report is the watchdog's too: every operation is watched from its start to the end of
  // its wait() or test().
  void check_async_error(const char* op, int rank) {
    if (!aborted.empty()) throw error(op, rank, aborted);
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm, &async) != ncclSuccess || async == ncclSuccess || async == ncclInProgress) return;
    aborted = std::string("NCCL reported an asynchronous error (") + ncclGetErrorString(async) +
              "); the communicator was aborted (ncclCommAbort) and cannot be used again";
    ncclCommAbort(comm);
    throw error(op, rank, aborted);
  }
};

// CUDA's handle on one operation, for detail::BasicRequest (comm/detail/request.hpp): its
// event, and the communicator, whose asynchronous errors end a wait (Note [NCCL errors]).
struct NcclHandles {
  using owner = comm::Nccl;
  NcclHandles() noexcept : event(nullptr) {}  // not a member initialiser: see comm::Gloo's Handles
  cudaEvent_t event;
  std::shared_ptr<NcclState> state;

  [[nodiscard]] bool pending() const noexcept { return event != nullptr; }
  void wait(const char* op, int rank) {
    for (int polls = 0; !test(op, rank); ++polls)
      if (polls > 1000) std::this_thread::sleep_for(std::chrono::microseconds(20));
      else std::this_thread::yield();
  }
  [[nodiscard]] bool test(const char* op, int rank) {
    const auto rc = cudaEventQuery(event);
    if (rc == cudaErrorNotReady) {
      state->check_async_error(op, rank);
      return false;
    }
    // Complete or failed, the request is done with: the event and the state go either way, so
    // that a failure is thrown once, not by every later wait() (the destructor's included).
    cudaEventDestroy(std::exchange(event, nullptr));
    state.reset();
    cuda_check(rc, op, rank);
    return true;
  }
  void abandon() noexcept {  // leaked: Note [Dropped requests]
    event = nullptr;
    new std::shared_ptr<NcclState>(std::exchange(state, {}));
  }
};

}  // namespace paratrain::detail
