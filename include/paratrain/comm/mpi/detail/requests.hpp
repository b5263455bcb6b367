#pragma once
/// \file
/// What comm::Mpi holds of one pending operation: its MPI requests, or the segments of a
/// large reduce-scatter started a window at a time (Note [Segmented reduce-scatter and
/// all-gather]); detail::BasicRequest (comm/detail/request.hpp) waits on them.

#include <mpi.h>

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

// The int vectors that hold non-blocking all-to-alls' counts and displacements, kept by
// each thread when their operations complete and taken by its next ones: a steady stream
// of them allocates nothing, where a vector a call was a tenth of what paratrain added to
// a 4 KiB iall_to_all (docs/benchmarks.md). At most eight are kept. None once the thread's
// list is gone (a request completed by a thread-local's or a static's destructor).
inline thread_local bool spare_int_vectors_gone = false;  // trivially destructible: readable to the end
struct SpareIntVectors {
  std::vector<std::vector<int>> vectors;
  SpareIntVectors() { vectors.reserve(8); }
  SpareIntVectors(const SpareIntVectors&) = delete;
  SpareIntVectors& operator=(const SpareIntVectors&) = delete;
  ~SpareIntVectors() { spare_int_vectors_gone = true; }
};
inline std::vector<std::vector<int>>* spare_int_vectors() {
  if (spare_int_vectors_gone) return nullptr;
  thread_local SpareIntVectors spare;
  return &spare.vectors;
}
inline std::vector<int> take_int_vector() {
  auto* spare = spare_int_vectors();
  if (spare == nullptr || spare->empty()) return {};
  auto v = std::move(spare->back());
  spare->pop_back();
  return v;
}
inline void give_back_int_vector(std::vector<int>& v) noexcept {
  if (v.capacity() == 0) return;
  auto* spare = spare_int_vectors();
  if (spare == nullptr || spare->size() >= 8) return;  // reserved for 8: push_back does not allocate
  v.clear();
  spare->push_back(std::move(v));
}

// MPI's handles on one operation, for detail::BasicRequest (comm/detail/request.hpp):
// its requests, or its segments.
struct MpiHandles {
  using owner = comm::Mpi;
  // An operation's MPI requests: the first inline (most operations make one: no allocation),
  // the others (an all-reduce in segments) in `more`. MPI sets a complete one to MPI_REQUEST_NULL.
  MPI_Request request = MPI_REQUEST_NULL;
  std::vector<MPI_Request> more;
  std::shared_ptr<MpiSegments> segments;
  std::vector<int> counts;      // an alltoallv's counts and displacements, read by MPI until it completes
  MpiProgress::Lease progress;  // Note [Progress thread]

  [[nodiscard]] bool pending() const noexcept { return request != MPI_REQUEST_NULL || !more.empty() || segments; }
  /// Where the operation's next MPI request goes.
  [[nodiscard]] MPI_Request* add() {
    return request == MPI_REQUEST_NULL && more.empty() ? &request : &more.emplace_back(MPI_REQUEST_NULL);
  }
  MpiHandles() = default;
  MpiHandles(MpiHandles&& o) noexcept { *this = std::move(o); }
  MpiHandles& operator=(MpiHandles&& o) noexcept {
    request = std::exchange(o.request, MPI_REQUEST_NULL);
    more = std::move(o.more);
    o.more.clear();
    segments = std::move(o.segments);
    counts = std::move(o.counts);
    progress = std::move(o.progress);
    return *this;
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
    mpi_check(MPI_Wait(&request, MPI_STATUS_IGNORE), op, rank);
    if (!more.empty()) {
      mpi_check(MPI_Waitall(static_cast<int>(more.size()), more.data(), MPI_STATUSES_IGNORE), op, rank);
      more.clear();
    }
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
    if (request != MPI_REQUEST_NULL) mpi_check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), op, rank);
    if (done && !more.empty()) {
      mpi_check(MPI_Testall(static_cast<int>(more.size()), more.data(), &done, MPI_STATUSES_IGNORE), op, rank);
      if (done) more.clear();
    }
    if (done) completed();
    return done != 0;
  }
  void completed() {
    progress.reset();
    give_back_int_vector(counts);
  }
  void abandon() noexcept {
    if (segments) new std::shared_ptr<MpiSegments>(std::move(segments));
    if (!counts.empty()) new std::vector<int>(std::move(counts));  // MPI may still read them
    request = MPI_REQUEST_NULL;
    more.clear();
    progress.reset();
  }
};

}  // namespace paratrain::detail
