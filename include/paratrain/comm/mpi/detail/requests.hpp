#pragma once
/// \file
/// What comm::Mpi holds of one pending operation: its MPI requests, or the segments of a
/// large reduce-scatter started a window at a time (Note [Segmented reduce-scatter and
/// all-gather]); detail::BasicRequest (comm/detail/request.hpp) waits on them.

#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "paratrain/comm/mpi/progress.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain::comm {
class Mpi;
}  // namespace paratrain::comm

namespace paratrain::detail {

// Note [Segmented reduce-scatter and all-gather]
// ZeRO's collectives are large: a whole gradient buffer reduce-scattered, a parameter
// buffer all-gathered. Measured on 2 ranks here (docs/benchmarks.md), OpenMPI 4.1's
// MPI_Reduce_scatter_block and MPI_Ireduce_scatter_block run at ~3 GB/s bus bandwidth
// from 128 KiB to 2 MiB, 0.9 GB/s at 8 MiB, and 0.13 GB/s from 16 MiB on (a reduction
// through scratch of the whole size).
// Reduce-scatters of more than Options::reduce_scatter_segment_above_bytes (of `in`)
// are therefore done as column segments: segment k is elements [k*s, (k+1)*s) of EVERY
// rank's part, a complete reduce-scatter of its own of Options::sharding_segment_bytes.
// Its size() pieces are strided in `in`, and MPI's predefined reductions refuse
// derived datatypes (OpenMPI: "MPI_SUM is not defined for non-intrinsic datatypes";
// our 16-bit reductions could not read them either), so each segment is packed into a
// contiguous scratch buffer and reduced with one MPI_Ireduce_scatter_block straight
// into its place in `out`. The copy costs far less than the cliff: 9-17x raw above it.
// Issuing every segment at once loses the gain (libnbc then works on all of them
// together: 0.07 GB/s, raw's rate, as iall_reduce does above 32 MiB), so a segmented
// Request keeps at most Options::sharding_window segments in flight and starts the
// next as one completes, inside wait() and test(): Note [Segment order]. The blocking
// form waits on the same pipeline (faster than blocking segments one by one).
// All-gather needs no scratch, and segmenting it did not pay: MPI_Iallgatherv segments
// (displacements i*part + k*s, no copies) ran at 0.3-0.5x one MPI_Allgather from
// 16 MiB to 256 MiB (an exploratory sweep on a busy machine), and one MPI_Allgather has
// no cliff here (5-15 GB/s up to 256 MiB). It is one call at every size unless
// Options::all_gather_segment_above_bytes says otherwise (the same pipeline, for MPI
// libraries where it pays). An all-gather whose `in` is part rank() of `out` passes
// MPI_IN_PLACE. Up to the thresholds both collectives make exactly the one MPI call a
// raw user would (the blocking forms the blocking call: libnbc's non-blocking ones
// cost 5-8 us more per call on small buffers).

// Note [Segment order]
// MPI matches collectives on a communicator by the order in which each rank starts
// them. Segments started lazily by test() would start at different points on different
// ranks relative to the caller's next collective; so every collective of this
// communicator first starts all segments not yet started of the one pending segmented
// operation (at most one can be partly started: its predecessors were completed by the
// same rule). The order of starts is then the program order on every rank. Code that
// calls MPI itself on native() while a segmented request is pending must wait for it
// first.

/// Throws paratrain::error with MPI's own words when `rc` is not MPI_SUCCESS.
inline void mpi_check(int rc, const char* op, int rank) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  throw error(op, rank, "MPI failed: " + std::string(text, static_cast<std::size_t>(len)));
}

// A segmented operation: Note [Segmented reduce-scatter and all-gather]. Shared with
// the communicator, which may start the rest: Note [Segment order].
struct MpiSegments {
  std::int64_t count = 0;    // segments in all
  std::int64_t started = 0;  // segments [0, started) have been started
  std::size_t window = 2;
  std::vector<MPI_Request> in_flight;  // oldest first
  /// Starts segment k and returns MPI's error code. `reuse` says that segment
  /// k - window is complete, so that its scratch may be reused; it is false when the
  /// rest are started at once.
  std::function<int(std::int64_t k, MPI_Request*, bool reuse)> start;

  void start_some(const char* op, int rank) { start_up_to(window, op, rank); }
  void start_all(const char* op, int rank) { start_up_to(static_cast<std::size_t>(count), op, rank); }
  void start_up_to(std::size_t limit, const char* op, int rank) {
    while (started < count && in_flight.size() < limit) {
      const bool reuse = in_flight.size() < window;
      auto& r = in_flight.emplace_back(MPI_REQUEST_NULL);
      mpi_check(start(started++, &r, reuse), op, rank);
    }
  }
};

// A wait's failure, out of line (cold): `rc` from MPI_Wait, or MPI_ERR_IN_STATUS from
// MPI_Testall with the failed request's status. A message longer than its receive is an
// all-to-all whose ranks disagree on their counts (Note [Non-blocking all-to-all as
// messages]): said so, naming the sender.
[[gnu::cold, gnu::noinline]] inline void mpi_wait_failed(int rc, const MPI_Status& status, const char* op, int rank) {
  const int e = rc == MPI_ERR_IN_STATUS ? status.MPI_ERROR : rc;
  int cls = MPI_SUCCESS;
  MPI_Error_class(e, &cls);
  if (cls == MPI_ERR_TRUNCATE)
    throw error(op, rank,
                "rank " + std::to_string(status.MPI_SOURCE) +
                    " sent this rank more elements than it expects from it (MPI: message truncated): what rank i "
                    "sends rank j (in_counts[j]) must be what rank j expects from rank i (out_counts[i]), and every "
                    "rank must issue the same collectives in the same order; PARATRAIN_VALIDATE=1 names the pair "
                    "on every rank");
  mpi_check(e, op, rank);
}

// MPI's handles on one operation, for detail::BasicRequest (comm/detail/request.hpp):
// its requests, or its segments.
struct MpiHandles {
  using owner = comm::Mpi;
  /// Requests held without an allocation: a non-blocking all-to-all over up to five ranks
  /// (two a peer: Note [Non-blocking all-to-all as messages]); most operations make one.
  static constexpr int inline_requests = 8;

  MpiHandles() = default;
  MpiHandles(MpiHandles&& o) noexcept { *this = std::move(o); }
  MpiHandles& operator=(MpiHandles&& o) noexcept {
    std::copy(o.few_, o.few_ + std::min(o.count_, inline_requests), few_);
    count_ = std::exchange(o.count_, 0);
    more_ = std::move(o.more_);
    o.more_.clear();
    segments = std::move(o.segments);
    progress = std::move(o.progress);
    return *this;
  }

  [[nodiscard]] bool pending() const noexcept { return count_ > 0 || segments; }
  /// Where the operation's next MPI request goes (MPI sets a complete one to MPI_REQUEST_NULL).
  [[nodiscard]] MPI_Request* add() {
    if (count_ < inline_requests) {
      auto* r = &few_[count_++];
      *r = MPI_REQUEST_NULL;
      return r;
    }
    ++count_;
    return &more_.emplace_back(MPI_REQUEST_NULL);
  }

  void wait(const char* op, int rank) {
    if (segments) {
      while (!segments->in_flight.empty()) {
        mpi_check(MPI_Wait(&segments->in_flight.front(), MPI_STATUS_IGNORE), op, rank);
        segments->in_flight.erase(segments->in_flight.begin());
        segments->start_some(op, rank);
      }
      segments.reset();
      progress.reset();
      return;
    }
    // One MPI_Wait a request, in the order they were made (an all-to-all's receives first):
    // a failure comes back as its own code, with the status that names its sender.
    MPI_Status status;
    for (int i = 0; i < count_; ++i)
      if (const int rc = MPI_Wait(at(i), &status); rc != MPI_SUCCESS) [[unlikely]]
        mpi_wait_failed(rc, status, op, rank);
    completed();
  }
  // MPI progresses only inside its calls: this is one.
  [[nodiscard]] bool test(const char* op, int rank) {
    if (segments) {
      while (!segments->in_flight.empty()) {
        int done = 0;
        mpi_check(MPI_Test(&segments->in_flight.front(), &done, MPI_STATUS_IGNORE), op, rank);
        if (!done) return false;
        segments->in_flight.erase(segments->in_flight.begin());
        segments->start_some(op, rank);
      }
      segments.reset();
      progress.reset();
      return true;
    }
    int done = 1;
    MPI_Status statuses[inline_requests];
    const int n = std::min(count_, inline_requests);
    if (const int rc = MPI_Testall(n, few_, &done, statuses); rc != MPI_SUCCESS) [[unlikely]]
      failed_in(rc, statuses, n, op, rank);
    if (done && !more_.empty()) {
      std::vector<MPI_Status> rest(more_.size());
      const int m = static_cast<int>(more_.size());
      if (const int rc = MPI_Testall(m, more_.data(), &done, rest.data()); rc != MPI_SUCCESS) [[unlikely]]
        failed_in(rc, rest.data(), m, op, rank);
    }
    if (done) completed();
    return done != 0;
  }
  void abandon() noexcept {
    if (segments) new std::shared_ptr<MpiSegments>(std::move(segments));
    count_ = 0;
    more_.clear();
    progress.reset();
  }

  std::shared_ptr<MpiSegments> segments;
  MpiProgress::Lease progress;  // Note [Progress thread]

 private:
  [[nodiscard]] MPI_Request* at(int i) noexcept {
    return i < inline_requests ? &few_[i] : &more_[static_cast<std::size_t>(i - inline_requests)];
  }
  // MPI_Testall's failure: the first request that failed (MPI_ERR_IN_STATUS), or its own code.
  [[noreturn]] static void failed_in(int rc, const MPI_Status* statuses, int n, const char* op, int rank) {
    for (int i = 0; rc == MPI_ERR_IN_STATUS && i < n; ++i)
      if (statuses[i].MPI_ERROR != MPI_SUCCESS && statuses[i].MPI_ERROR != MPI_ERR_PENDING)
        mpi_wait_failed(rc, statuses[i], op, rank);
    mpi_check(rc, op, rank);
    throw error(op, rank, "MPI failed");  // not reached: rc is not MPI_SUCCESS
  }
  void completed() {
    count_ = 0;
    more_.clear();
    progress.reset();
  }

  // The first inline_requests requests; the others (an all-reduce in many segments, an
  // all-to-all over many ranks) in more_. Only the first count_ are set.
  MPI_Request few_[inline_requests];  // NOLINT(cppcoreguidelines-avoid-c-arrays): MPI takes a pointer
  int count_ = 0;
  std::vector<MPI_Request> more_;
};

}  // namespace paratrain::detail
