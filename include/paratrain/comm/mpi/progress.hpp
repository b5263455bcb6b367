#pragma once
/// \file
/// comm::Mpi's progress thread: Note [Progress thread].

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "paratrain/core/error.hpp"

namespace paratrain::detail {

// Note [Progress thread]
// Open MPI 4.1 moves a non-blocking operation forward only inside MPI calls of the process
// that owns it (it has no asynchronous progress). GradientBuckets tests its requests from
// the gradient hooks, so backward's reductions move; but ZeRO-3 starts the next unit's
// gather (the prefetch) before the current unit computes, and nothing calls MPI while a
// unit's forward runs (a unit has no hooks inside, and one large product is one call):
// its messages then move only when the next unit waits for them, in the open. So while
// any non-blocking operation of a comm::Mpi is pending, one thread of the process calls
// into MPI every Mpi::Options::progress (MPI_Iprobe on MPI_COMM_SELF: it matches nothing
// and runs Open MPI's progress engine, which serves every communicator), and it sleeps on
// a condition variable while none is. It needs MPI_THREAD_MULTIPLE, which
// Mpi::Environment asks for; without it no thread is started. A segmented operation's
// later segments are still started by the owner's test() or wait() (Note [Segmented
// reduce-scatter and all-gather]): the thread never touches a request. The
// Environment stops the thread before MPI_Finalize.
//
// Off by default, because measured it did not pay where every core computes
// (docs/benchmarks.md, "ZeRO-3 and the progress thread": 2 ranks on 2 cores, one
// intra-op thread each): it halved ZeRO-3's exposed share of the step (6.9 -> 3.8% and
// 6.3 -> 2.8% on the 16.8M and 50.4M MLPs) but no step got faster (0.92-1.05x of the
// rate without it, across DDP and ZeRO 1-3). On a CPU, moving a gather's bytes is work for
// the cores that compute whichever thread does it, and the thread's wake-ups preempt
// compute; ZeRO-3's remaining gap to DDP there (0.85-0.96x) is its 1.5x communication
// volume, not exposure. Where ranks have a core to spare, PARATRAIN_MPI_PROGRESS_US=200
// (or Options::progress) turns it on.

/// The process's progress thread for comm::Mpi: Note [Progress thread].
class MpiProgress {
 public:
  /// Held by a pending operation: while any lease lives, the thread calls MPI every
  /// `every` (the shortest interval asked for). Default-constructed and moved-from: none.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& o) noexcept : active_(std::exchange(o.active_, false)) {}
    Lease& operator=(Lease&& o) noexcept {
      if (this != &o) {
        reset();
        active_ = std::exchange(o.active_, false);
      }
      return *this;
    }
    ~Lease() { reset(); }
    void reset() noexcept {
      if (std::exchange(active_, false)) instance().end();
    }

   private:
    friend class MpiProgress;
    explicit Lease(bool active) : active_(active) {}
    bool active_ = false;
  };

  /// The process's one progress thread; never destroyed (stop() ends the thread).
  static MpiProgress& instance() {
    static auto* p = new MpiProgress;
    return *p;
  }

  /// A lease for one pending operation; none where `every` is zero or MPI cannot be
  /// called from a second thread.
  Lease lease(std::chrono::microseconds every) {
    if (every.count() <= 0) return {};
    std::unique_lock lock(mutex_);
    if (stopped_) return {};
    if (!thread_.joinable()) {
      int level = MPI_THREAD_SINGLE;
      MPI_Query_thread(&level);
      if (level != MPI_THREAD_MULTIPLE) return {};
      thread_ = std::thread([this] { run(); });
    }
    every_ = pending_ == 0 ? every : std::min(every_, every);
    if (pending_++ == 0) wake_.notify_one();
    return Lease(true);
  }

  /// How many times the thread has called into MPI so far: what a test of the thread
  /// waits on (not on the clock).
  [[nodiscard]] std::uint64_t calls() const noexcept { return calls_.load(std::memory_order_relaxed); }

  /// Ends the thread for good; before MPI_Finalize (Mpi::Environment's destructor).
  void stop() {
    {
      std::lock_guard lock(mutex_);
      stopped_ = true;
    }
    wake_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

 private:
  MpiProgress() = default;

  void end() {
    std::lock_guard lock(mutex_);
    --pending_;
  }

  void run() {
    std::unique_lock lock(mutex_);
    while (!stopped_) {
      if (pending_ == 0) {
        wake_.wait(lock, [this] { return stopped_ || pending_ > 0; });
        continue;
      }
      lock.unlock();
      int flag = 0, finalized = 0;
      MPI_Finalized(&finalized);  // a program that finalises without Mpi::Environment
      if (!finalized) MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, MPI_COMM_SELF, &flag, MPI_STATUS_IGNORE);
      calls_.fetch_add(1, std::memory_order_relaxed);
      lock.lock();
      wake_.wait_for(lock, every_, [this] { return stopped_; });
    }
  }

  std::atomic<std::uint64_t> calls_{0};
  std::mutex mutex_;
  std::condition_variable wake_;
  std::thread thread_;
  std::int64_t pending_ = 0;
  std::chrono::microseconds every_{0};
  bool stopped_ = false;
};

/// Mpi::Options::progress's default: PARATRAIN_MPI_PROGRESS_US (microseconds; 0: no
/// progress thread), else 0 (Note [Progress thread] says why).
inline std::chrono::microseconds default_progress() {
  if (const char* v = std::getenv("PARATRAIN_MPI_PROGRESS_US"); v != nullptr && *v != '\0') {
    char* end = nullptr;
    const long long us = std::strtoll(v, &end, 10);
    if (end == v || *end != '\0' || us < 0)
      throw error("PARATRAIN_MPI_PROGRESS_US", -1,
                  std::string("\"") + v +
                      "\" is not a whole number of microseconds >= 0 (e.g. PARATRAIN_MPI_PROGRESS_US=200; 0: off)");
    return std::chrono::microseconds(us);
  }
  return std::chrono::microseconds(0);
}

}  // namespace paratrain::detail
