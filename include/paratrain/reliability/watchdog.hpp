#pragma once
/// \file
/// The collective watchdog, shared by every communicator (Note [Watchdog]): the thread that
/// names an operation stuck past its timeout and ends the job, the channel it asks the
/// other ranks through, and `Watched`, a communicator's handle to it and to its ledger
/// (reliability/ledger.hpp).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "paratrain/core/error.hpp"
#include "paratrain/reliability/ledger.hpp"

namespace paratrain::detail {

// Note [Watchdog]
// ~~~~~~~~~~~~~~~~
// Every operation of comm::Mpi, comm::Gloo and comm::Nccl (collectives, sends and
// receives, blocking or not) holds a Watch from the moment it starts until it completes.
// One thread per process looks at the oldest watch a few times per timeout; when one has
// been pending for longer than its communicator's timeout, the rank
//   1. prints what it waits for: the operation, its sequence number on its communicator,
//      its dtype and element count (or peer and tag), and for how long;
//   2. asks every other rank, over a channel that does not need the stuck communicator
//      (a duplicate of MPI_COMM_WORLD served by the other ranks' watchdog threads, or the
//      Gloo rendezvous store), what it is doing; ranks that answer are described (waiting
//      in the same collective: arrived; in another one; busy outside communication since
//      their last operation), ranks that do not answer within the grace period are named
//      as stopped or dead, and the ranks' recent collectives are compared to find the
//      first one they issued differently (Note [Collective fingerprint]);
//   3. ends the whole job: MPI_Abort under MPI (mpirun then ends every rank, stopped ones
//      included), an exit under a torchrun-style launch (the peers' next operation then
//      fails: comm::Gloo throws paratrain::error "Gloo failed: ..." on each of them).
// Nothing is done on the training threads but taking a slot of a table when an operation
// starts, under one uncontended lock (the ledger's: the collective is counted under the
// same acquisition), and marking the slot ended when it ends, without the lock (an atomic
// store; the next start gives it back to the free ones), with no allocation once the table
// has grown to the most operations ever pending at once, and no clock: the watchdog
// thread, which sleeps otherwise and wakes every tick (a tenth of the shortest timeout,
// 20 ms to 1 s) to answer questions and look at the table, stamps an operation with the
// time of the first tick that sees it pending. An operation is so timed from up to a
// tick after it began, and is reported at most two ticks after its timeout (a tick that
// serves a slow channel lasts longer: a stopped Gloo store's 5 s), where
// reading the clock at every start (~5 ns even from the kernel's last tick) was a tenth
// of what the preamble added to a 4 KiB all-to-all (docs/benchmarks.md).

/// What a rank says of itself when asked: fixed-size, so that it travels as bytes.
struct RankStatus {
  std::int64_t world_rank = -1;
  std::int64_t ledger = 0;  // the communicator asked about
  std::int64_t count = 0;   // collectives issued on it so far
  // The oldest operation pending on that communicator or, failing that, anywhere.
  std::int64_t pending = 0;  // 0 none, 1 on the communicator asked about, 2 on another
  OperationRecord operation;
  std::int64_t peer = -1;
  std::int64_t age_ms = 0;
  std::int64_t idle_ms = 0;  // since this rank last started or finished an operation
  std::array<OperationRecord, status_history_length> history{};  // the last ones on that communicator
};

/// How the watchdog reaches the other ranks without the stuck communicator.
class WatchdogChannel {
 public:
  virtual ~WatchdogChannel() = default;
  /// The world's size and this process's rank in it.
  [[nodiscard]] virtual int world_rank() const = 0;
  [[nodiscard]] virtual int world_size() const = 0;
  /// Answers the other ranks' questions (called by the watchdog thread every tick).
  virtual void serve(const std::function<RankStatus(std::int64_t ledger)>& describe_self) = 0;
  /// Asks every other rank about `ledger`, answering questions meanwhile; the answers that
  /// came within `grace`, by world rank.
  virtual std::map<int, RankStatus> ask(std::int64_t ledger, std::chrono::milliseconds grace,
                                        const std::function<RankStatus(std::int64_t ledger)>& describe_self) = 0;
  /// Ends the whole job with `code`. Does not return.
  [[noreturn]] virtual void end_job(int code) = 0;
};

/// Where the watchdog's settings come from: PARATRAIN_TIMEOUT (seconds, fractions
/// allowed) or the 10 minutes NCCL's ProcessGroup also waits by default.
inline std::chrono::milliseconds default_timeout() {
  if (const char* v = std::getenv("PARATRAIN_TIMEOUT"); v != nullptr && *v != '\0') {
    char* end = nullptr;
    const double seconds = std::strtod(v, &end);
    if (end == v || *end != '\0' || !(seconds > 0))
      throw error("PARATRAIN_TIMEOUT", -1,
                  std::string("\"") + v + "\" is not a positive number of seconds (e.g. PARATRAIN_TIMEOUT=600)");
    return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000));
  }
  return std::chrono::minutes(10);
}

class Watchdog {
  struct Pending;

 public:
  using clock = std::chrono::steady_clock;

  /// The process's one watchdog; never destroyed (its thread may outlive main's locals).
  static Watchdog& instance() {
    static auto* w = new Watchdog();
    return *w;
  }

  /// An operation being watched; moving it along moves the watch, dropping it ends it.
  class Watch {
   public:
    Watch() = default;
    Watch(Watch&& o) noexcept : pending_(std::exchange(o.pending_, nullptr)) {}
    Watch& operator=(Watch&& o) noexcept {
      if (this != &o) {
        release();
        pending_ = std::exchange(o.pending_, nullptr);
      }
      return *this;
    }
    ~Watch() { release(); }
    void release() noexcept {
      if (pending_ != nullptr) end(std::exchange(pending_, nullptr));
    }

   private:
    friend class Watchdog;
    explicit Watch(Pending* pending) : pending_(pending) {}
    Pending* pending_ = nullptr;
  };

  /// Starts watching an operation of `ledger`'s communicator; `peer` >= 0 for a send or receive.
  Watch begin(const std::shared_ptr<Ledger>& ledger, const PackedRecord& operation, std::chrono::milliseconds timeout,
              int peer = -1) {
    std::lock_guard lock(mutex_);  // not a unique_lock: passed on, one was four stores a call
    auto& p = take_held(ledger, timeout, peer);
    operation.store_into(p.operation);
    if (p.seq != 0) p.seq = 0;  // not counted
    return Watch(&p);
  }
  /// Counts a collective on `ledger` (Ledger::record) and starts watching it, under one
  /// acquisition of the lock; says whether the fingerprints are due for comparison.
  std::pair<Watch, bool> begin_counted(const std::shared_ptr<Ledger>& ledger, const PackedRecord& operation,
                                       std::chrono::milliseconds timeout) {
    std::lock_guard lock(mutex_);
    auto& p = take_held(ledger, timeout, -1);
    const auto [seq, due] = ledger->record_held(operation);
    operation.store_into(p.operation);
    p.seq = seq;
    return {Watch(&p), due};
  }

  /// Lets the watchdog reach the other ranks (the first channel given is kept).
  void set_channel(std::unique_ptr<WatchdogChannel> channel) {
    std::lock_guard serving(channel_mutex_);
    std::lock_guard lock(mutex_);
    if (!channel_) channel_ = std::move(channel);
  }
  [[nodiscard]] bool has_channel() const {
    std::lock_guard lock(mutex_);
    return channel_ != nullptr;
  }

  /// Stops using the channel (before MPI_Finalize, say).
  void retire_channel() {
    std::lock_guard serving(channel_mutex_);
    std::lock_guard lock(mutex_);
    channel_.reset();
  }

  /// Ends the job with `code` through the channel (so that every rank ends), or returns
  /// false when there is none (a single process: the caller returns the code).
  bool end_job(int code) {
    std::lock_guard serving(channel_mutex_);
    if (channel_ == nullptr || channel_->world_size() <= 1) return false;
    std::fflush(nullptr);
    channel_->end_job(code);
    std::_Exit(code);  // end_job does not return
  }

  void remember(const std::shared_ptr<Ledger>& ledger) {
    std::lock_guard lock(mutex_);
    ledgers_[ledger->id()] = ledger;
  }

  /// This rank's answer to "what are you doing on `ledger`?".
  RankStatus status(std::int64_t ledger_id) const {
    std::lock_guard lock(mutex_);
    RankStatus s;
    s.ledger = ledger_id;
    const auto now = clock::now();
    if (auto it = ledgers_.find(ledger_id); it != ledgers_.end())
      if (auto l = it->second.lock()) {
        s.count = static_cast<std::int64_t>(l->count_);
        s.history = l->recent_held<status_history_length>();
        s.world_rank = l->members()[static_cast<std::size_t>(l->rank())];
      }
    // The oldest pending here or, failing that, the oldest anywhere.
    const Pending* chosen = nullptr;
    const auto is_here = [&](const Pending* p) { return p->ledger && p->ledger->id() == ledger_id; };
    for (const auto& p : slots_) {
      if (!p.pending()) continue;
      const bool here = is_here(&p);
      if (chosen == nullptr || (here && !is_here(chosen)) || (here == is_here(chosen) && p.order < chosen->order))
        chosen = &p;
    }
    if (chosen != nullptr) {
      s.pending = chosen->ledger && chosen->ledger->id() == ledger_id ? 1 : 2;
      s.operation = chosen->record();
      s.peer = chosen->peer;
      s.age_ms = chosen->seen() ? ms(now - chosen->started) : 0;  // a tick short at most
    }
    // An operation that started or ended since the last tick (noticed_activity_held) did so about now.
    s.idle_ms = active_since_tick_held() ? 0 : ms(now - last_activity_);
    return s;
  }

 private:
  // A slot of the table: written under the lock when its operation starts (take_held, only
  // what changed: Note [Stores in the preamble]), read under it (status, run), and stamped
  // under it by the watchdog's tick that first sees it pending (run); its state alone
  // changes without the lock, when the operation
  // ends (end: pending -> ended, a release store). The lock's holder gives an ended slot
  // back to the free ones (reclaim_held). Slots live in a deque: end() touches one while
  // take_held may append others, and a slot's address does not change.
  enum : std::uint8_t { slot_free, slot_pending, slot_ended };
  struct Operation {
    std::shared_ptr<Ledger> ledger;
    PackedRecord operation;
    std::int64_t seq = 0;  // on its communicator; 0 for one not counted (a send, a validation)
    int peer = -1;
    std::chrono::milliseconds timeout{};
    clock::time_point started{};  // the first tick that saw it pending; the epoch until then
    std::uint64_t order = 0;      // start order, from 1

    [[nodiscard]] bool seen() const noexcept { return started != clock::time_point{}; }
    [[nodiscard]] OperationRecord record() const noexcept { return operation.unpack(seq); }
  };
  struct Pending : Operation {
    std::atomic<std::uint8_t> state{slot_free};

    [[nodiscard]] bool pending() const noexcept { return state.load(std::memory_order_acquire) == slot_pending; }
  };

  Watchdog() = default;

  // A free slot for an operation about to start, taken and marked pending; the caller
  // writes its record before releasing the lock.
  Pending& take_held(const std::shared_ptr<Ledger>& ledger, std::chrono::milliseconds timeout, int peer) {
    // The slot that ended last, taken again where it has not been given back since (one
    // operation after another: no free list, no call), else a free one.
    auto* slot = last_ended_.load(std::memory_order_relaxed);
    if (slot == nullptr || slot->state.load(std::memory_order_acquire) != slot_ended) [[unlikely]] {
      if (free_.empty()) grow_held();
      slot = free_.back();
      free_.pop_back();
    }
    auto& p = *slot;
    // A slot keeps its last ledger: the same communicator's next operation takes the same
    // slot (the one that ended last, or the top of free_, a stack) and copies no
    // shared_ptr, which costs two atomic operations a call. A ledger kept so is ~10 KB, at
    // most one a slot.
    if (p.ledger != ledger) [[unlikely]] p.ledger = ledger;
    // each written only where it changed (Note [Stores in the preamble]): the same
    // communicator's next operation mostly finds them as it would leave them
    if (p.peer != peer) p.peer = peer;
    if (p.timeout != timeout) p.timeout = timeout;
    if (p.seen()) p.started = {};
    p.order = ++started_count_;
    p.state.store(slot_pending, std::memory_order_relaxed);  // the lock's release publishes it
    if (timeout < shortest_timeout_) [[unlikely]] shorten_tick_held(timeout);
    return p;
  }
  // The rare parts of take_held, out of line: no free slot (reclaim the ended ones, or
  // add one; the first operation also starts the thread), and a shorter timeout. Rare:
  // an operation that starts while none other is pending takes the slot that ended last.
  [[gnu::noinline]] void grow_held() {
    if (!started_) start_held();
    reclaim_held();
    if (!free_.empty()) return;
    // free_ keeps a place for every slot, so that reclaim_held() never allocates.
    if (free_.capacity() < slots_.size() + 1) free_.reserve(2 * (slots_.size() + 1));
    free_.push_back(&slots_.emplace_back());
  }
  [[gnu::noinline]] void shorten_tick_held(std::chrono::milliseconds timeout) {
    shortest_timeout_ = timeout;
    wake_.notify_all();
  }

  // Gives the ended slots back, the one that ended last first (last_ended_, when it has not
  // been reclaimed since): a communicator's operations, one after another, find their slot
  // without a scan.
  void reclaim_held() noexcept {
    const auto give_back = [&](Pending& p) {
      if (p.state.load(std::memory_order_acquire) != slot_ended) return false;
      p.state.store(slot_free, std::memory_order_relaxed);
      free_.push_back(&p);
      return true;
    };
    if (auto* hint = last_ended_.load(std::memory_order_relaxed); hint != nullptr && give_back(*hint)) return;
    for (auto& p : slots_) give_back(p);
  }

  static std::int64_t ms(clock::duration d) { return std::chrono::duration_cast<std::chrono::milliseconds>(d).count(); }

  // Without the lock or the clock: an operation's end is three stores (on x86, plain
  // moves). The watchdog's tick notices that operations started or ended (started_count_
  // or ends_ moved) and counts the rank active then (noticed_activity_held): idle times
  // are a tick coarse.
  static void end(Pending* p) noexcept {
    ends_.store(ends_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);  // racing ends still move it
    if (last_ended_.load(std::memory_order_relaxed) != p) last_ended_.store(p, std::memory_order_relaxed);
    p->state.store(slot_ended, std::memory_order_release);
  }
  [[nodiscard]] bool active_since_tick_held() const noexcept {
    return ends_.load(std::memory_order_relaxed) != ends_seen_ || started_count_ != starts_seen_;
  }
  void noticed_activity_held(clock::time_point now) {
    if (active_since_tick_held())
      ends_seen_ = ends_.load(std::memory_order_relaxed), starts_seen_ = started_count_, last_activity_ = now;
  }

  void start_held() {
    std::thread([this] { run(); }).detach();  // one for the process's lifetime
    started_ = true;
  }

  [[nodiscard]] std::chrono::milliseconds tick() const {
    return std::clamp(std::chrono::duration_cast<std::chrono::milliseconds>(shortest_timeout_ / 10),
                      std::chrono::milliseconds(20), std::chrono::milliseconds(1000));
  }

  void run() {
    const auto self = [this](std::int64_t ledger) { return status(ledger); };
    for (;;) {
      std::optional<Operation> expired;
      {
        std::unique_lock lock(mutex_);
        wake_.wait_for(lock, tick());
        const auto now = clock::now();
        noticed_activity_held(now);
        for (auto& p : slots_) {
          if (!p.pending()) continue;
          if (!p.seen()) {
            p.started = now;
            continue;
          }
          if (now - p.started >= p.timeout && (!expired || p.order < expired->order))
            expired = static_cast<const Operation&>(p);
        }
      }
      std::lock_guard serving(channel_mutex_);  // channel_ changes only under both locks
      if (expired) fire(*expired, channel_.get(), self);  // does not return
      if (channel_ != nullptr) channel_->serve(self);
    }
  }

  [[noreturn]] void fire(const Operation& p, WatchdogChannel* channel,
                         const std::function<RankStatus(std::int64_t)>& self) {
    const auto& ledger = *p.ledger;
    const int me = ledger.members()[static_cast<std::size_t>(ledger.rank())];
    const auto timeout = p.timeout.count();
    const std::string prefix = "paratrain: watchdog on rank " + std::to_string(me) + ": ";
    const auto record = p.record();
    std::string what = describe_operation(record);
    if (p.peer >= 0)
      what = std::string(operation_name(record.op)) + (record.op == operation_code("send") ? " to" : " from") +
             " rank " + std::to_string(ledger.members()[static_cast<std::size_t>(p.peer)]) + " (tag " +
             std::to_string(record.detail) + ")";
    std::fprintf(stderr, "%s%s on communicator %s (world ranks %s) did not complete within %.1f s; asking the other ranks\n",
                 prefix.c_str(), what.c_str(), ledger.name().c_str(), rank_list(ledger.members()).c_str(),
                 static_cast<double>(timeout) / 1000.0);
    std::fflush(stderr);
    // Half the timeout, and long enough for every other rank's watchdog to look for the
    // question: their ticks are at most 1 s (tick()), whatever their own timeouts.
    const auto grace = std::clamp(std::chrono::milliseconds(timeout / 2), std::chrono::milliseconds(2500),
                                  std::chrono::milliseconds(10000));
    std::map<int, RankStatus> answers;
    if (channel != nullptr && channel->world_size() > 1) answers = channel->ask(ledger.id(), grace, self);
    const auto mine = self(ledger.id());
    std::vector<int> arrived{me}, missing;
    std::string details;
    std::optional<std::pair<OperationRecord, OperationRecord>> difference;
    int differing_rank = -1;
    for (int r : ledger.members()) {
      if (r == me) continue;
      const auto it = answers.find(r);
      std::string line = "  rank " + std::to_string(r) + ": ";
      if (it == answers.end()) {
        missing.push_back(r);
        line += "no answer within " + std::to_string(grace.count()) + " ms: stopped, dead, or stuck where paratrain cannot answer";
      } else {
        const auto& s = it->second;
        if (auto d = first_divergence(mine.history, s.history); d && (!difference || d->first.seq < difference->first.seq))
          difference = d, differing_rank = r;
        if (s.pending == 1 && p.peer < 0 && s.operation == record) {
          arrived.push_back(r);
          line += "waiting in the same " + describe_operation(s.operation) + " for " + seconds(s.age_ms);
        } else {
          missing.push_back(r);
          line += s.pending == 1   ? "waiting in " + describe_operation(s.operation) + " on this communicator for " + seconds(s.age_ms)
                  : s.pending == 2 ? "waiting in " + describe_operation(s.operation) + " on another communicator for " + seconds(s.age_ms)
                                   : "busy outside communication for " + seconds(s.idle_ms);
          line += "; it has issued " + std::to_string(s.count) + " collectives on this communicator";
        }
      }
      details += prefix + line + "\n";
    }
    std::string summary = prefix + "arrived: " + rank_list(arrived) + "; not arrived: " + rank_list(missing);
    if (difference)
      summary += "; the ranks issued different collectives: #" + std::to_string(difference->first.seq) + " is " +
                 describe_operation(difference->first, false) + " on rank " + std::to_string(me) + " but " +
                 describe_operation(difference->second, false) + " on rank " + std::to_string(differing_rank);
    std::fprintf(stderr, "%s%s; ending the job (exit %d)\n", details.c_str(), summary.c_str(), watchdog_exit_code);
    std::fflush(nullptr);
    if (channel != nullptr) channel->end_job(watchdog_exit_code);
    std::_Exit(watchdog_exit_code);
  }

  static std::string seconds(std::int64_t ms) {
    char b[32];
    std::snprintf(b, sizeof b, "%.1f s", static_cast<double>(ms) / 1000.0);
    return b;
  }

  LedgerLock& mutex_ = ledger_lock();  // also every ledger's: Watchdog::begin_counted
  std::mutex channel_mutex_;           // held while the channel is used; taken before mutex_
  std::condition_variable_any wake_;
  std::deque<Pending> slots_;        // a Watch points at its slot
  std::vector<Pending*> free_;       // the free slots
  static inline std::atomic<Pending*> last_ended_{nullptr};  // the slot that ended last
  static inline std::atomic<std::uint64_t> ends_{0};         // operations ended, about
  std::uint64_t ends_seen_ = 0;                              // at the last tick
  std::uint64_t started_count_ = 0;
  std::uint64_t starts_seen_ = 0;  // started_count_ at the last tick
  std::map<std::int64_t, std::weak_ptr<Ledger>> ledgers_;
  clock::time_point last_activity_ = clock::now();
  std::chrono::milliseconds shortest_timeout_ = std::chrono::hours(24);
  std::unique_ptr<WatchdogChannel> channel_;
  bool started_ = false;
};

using Watch = Watchdog::Watch;

/// A communicator's side of the watchdog and the fingerprint: its ledger, known to the
/// watchdog, and its timeout (copied from the communicator's options, which do not change).
/// comm::Mpi, comm::Gloo and comm::Nccl each keep one in their shared state, inside the
/// skeleton they share (comm/detail/skeleton.hpp).
class Watched {
 public:
  Watched() = default;
  Watched(std::string name, std::vector<int> members, int rank, std::chrono::milliseconds timeout)
      : ledger_(std::make_shared<Ledger>(std::move(name), std::move(members), rank)), timeout_(timeout) {
    Watchdog::instance().remember(ledger_);
  }

  [[nodiscard]] const Ledger& ledger() const noexcept { return *ledger_; }

  /// Watches an operation that is not counted (a validation, a fingerprint comparison).
  [[nodiscard]] Watch operation(const PackedRecord& record) const {
    return Watchdog::instance().begin(ledger_, record, timeout_);
  }
  /// Counts a collective and watches it; says whether the fingerprints are due for comparison.
  [[nodiscard]] std::pair<Watch, bool> collective(std::string_view op, const at::Tensor& t, int detail) const {
    return Watchdog::instance().begin_counted(ledger_, record_of(op, t, detail), timeout_);
  }
  /// The same for a buffer known by its dtype and element count (comm::Nccl's device pointers).
  [[nodiscard]] std::pair<Watch, bool> collective(std::string_view op, at::ScalarType dtype, std::int64_t numel,
                                                  int detail) const {
    return Watchdog::instance().begin_counted(ledger_, record_of(op, static_cast<std::int64_t>(dtype), numel, detail),
                                              timeout_);
  }
  /// Counts and watches a collective without a tensor (barrier, split).
  [[nodiscard]] Watch collective(std::string_view op) const { return collective(op, at::Tensor(), 0).first; }
  [[nodiscard]] Watch point_to_point(std::string_view op, int peer, int tag) const {
    return Watchdog::instance().begin(ledger_, PackedRecord::of(operation_code(op), -1, 0, tag), timeout_, peer);
  }

  /// Note [Collective fingerprint], over the communicator's own transport, uncounted:
  /// `reduce_max(t)` all-reduces a 4-element int64 tensor with MAX in place, `all_gather(in,
  /// out)` concatenates every rank's `in` into `out`. Throws the same error on every rank
  /// when the fingerprints differ.
  template <class ReduceMax, class AllGather>
  void compare_fingerprints(int rank, int size, ReduceMax&& reduce_max, AllGather&& all_gather) const {
    const auto fingerprint = ledger_->fingerprint_to_compare();
    const auto high = static_cast<std::int64_t>(fingerprint >> 32), low = static_cast<std::int64_t>(fingerprint & 0xffffffffu);
    // The thread's own four words, made once: a tensor made every comparison was ~1,200
    // stores, ~5 a collective at one comparison per 256 (Note [Stores in the preamble]).
    // Replaced when the all-reduce throws: a recoverable Gloo group may leave it running
    // on Gloo's threads, still writing them (Note [Recoverable groups]).
    thread_local at::Tensor packed = at::empty({4}, at::kLong);
    auto* p = packed.data_ptr<std::int64_t>();
    p[0] = high, p[1] = low, p[2] = -high, p[3] = -low;
    try {
      const auto watch = operation(record_of("fingerprint", packed, 0));
      reduce_max(packed);
    } catch (...) {
      packed = at::empty({4}, at::kLong);
      throw;
    }
    if (p[0] == -p[2] && p[1] == -p[3]) return;
    using History = std::array<OperationRecord, history_length>;
    constexpr auto words = static_cast<std::int64_t>(sizeof(History) / sizeof(std::int64_t));
    auto in = at::empty({words}, at::kLong), out = at::empty({words * size}, at::kLong);
    const auto mine = ledger_->history();
    std::memcpy(in.data_ptr(), mine.data(), sizeof mine);
    {
      const auto watch = operation(record_of("fingerprint", in, 0));
      all_gather(in, out);
    }
    std::vector<History> all(static_cast<std::size_t>(size));
    std::memcpy(all.data(), out.data_ptr(), sizeof(History) * all.size());
    throw error("fingerprint", rank, fingerprint_mismatch(*ledger_, all));
  }

 private:
  std::shared_ptr<Ledger> ledger_;
  std::chrono::milliseconds timeout_{};
};

}  // namespace paratrain::detail
