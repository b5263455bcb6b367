#pragma once
/// \file
/// The collective ledger and fingerprint every communicator keeps: each collective counted
/// and hashed, the recent ones kept, the ranks' histories compared (Note [Collective
/// fingerprint]).

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "paratrain/core/reduce_op.hpp"
#include "paratrain/util/fnv1a.hpp"

namespace paratrain::detail {

// Note [Collective fingerprint]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each communicator keeps a running hash of (operation, dtype, element count, root or
// reduction) of its collectives and the last `history_length` of them. Every
// `fingerprint_period` collectives the ranks compare hashes with one 4-element MAX
// all-reduce (the maximum of x and -x meets only where all agree: Note [Collective
// validation]); on a mismatch they all-gather their histories, which cover every
// collective since the last agreeing check, and every rank throws the same error naming
// the first collective that differs and the ranks on each side. A collective that cannot
// compare (a barrier, a split: they carry no words) leaves the comparison due to the next
// one that can. The cost is one tiny
// all-reduce per 256 collectives: per 64, its ~0.5 us (a 4-word all-reduce and the
// tensor it fills, 2 ranks) was ~8 ns a collective, a sixth of what paratrain added to a
// 4 KiB all-to-all (docs/benchmarks.md). The full per-call check (PARATRAIN_VALIDATE=1)
// stays for finding the culprit of a hang at once.

inline constexpr std::uint64_t fingerprint_period = 256;
/// The collectives a ledger keeps: every one since the last agreeing comparison.
inline constexpr std::size_t history_length = fingerprint_period;
/// The most recent of them, which a rank tells the others' watchdogs (Note [Watchdog]).
inline constexpr std::size_t status_history_length = 64;
/// The exit status of a job ended by the watchdog (as timeout(1)'s).
inline constexpr int watchdog_exit_code = 124;

/// The operations the ledger names, in a fixed order: their codes travel between ranks.
inline constexpr std::array<std::string_view, 13> operation_names = {
    "?",    "all_reduce", "iall_reduce", "broadcast", "reduce_scatter", "all_gather",
    "send", "recv",       "barrier",     "split",     "validate",       "fingerprint", "all_to_all"};

inline std::int64_t operation_code(std::string_view op) noexcept {
  for (std::size_t i = 1; i < operation_names.size(); ++i)
    if (operation_names[i] == op) return static_cast<std::int64_t>(i);
  return 0;
}
inline std::string_view operation_name(std::int64_t code) noexcept {
  return code > 0 && code < static_cast<std::int64_t>(operation_names.size()) ? operation_names[static_cast<std::size_t>(code)]
                                                                               : operation_names[0];
}

/// One collective as the fingerprint sees it. seq 0 is "none".
struct OperationRecord {
  std::int64_t seq = 0;
  std::int64_t op = 0;
  std::int64_t dtype = -1;
  std::int64_t numel = 0;
  std::int64_t detail = 0;  // root or reduction

  friend bool operator==(const OperationRecord&, const OperationRecord&) = default;
};

// Note [Stores in the preamble]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A collective's copy (MPI's memcpy of a 4 KiB all-to-all, say) leaves the core's store
// buffer full, and it drains for as long as the next call's preamble runs: there each store
// waits its turn, about a cycle, while loads and arithmetic are nearly free. Counted with
// callgrind (docs/benchmarks.md), what paratrain added to a 4 KiB all-to-all was ~95
// stores a call and timed ~25 ns, about a quarter of a nanosecond a store; 20 extra stores
// before a raw MPI_Alltoallv cost it ~5 ns. So the preamble is written for few stores: a
// record is two words (PackedRecord), its seq implied by where it lies; a slot of the
// watchdog's table is written only where it changes; the argument checks capture what their
// messages need by value (a capture by reference puts the variable in memory on every call);
// a layout is built where it is used, not copied.

/// An operation's record as the ledger and the watchdog's table keep it: the operation,
/// dtype and detail (root, reduction or tag) in one word, the element count in the other,
/// each within its byte or int. These two words are also what the fingerprint mixes.
struct PackedRecord {
  std::uint64_t code = 0;
  std::int64_t numel = 0;

  [[nodiscard]] static constexpr PackedRecord of(std::int64_t op, std::int64_t dtype, std::int64_t numel,
                                                 std::int64_t detail) noexcept {
    return {static_cast<std::uint64_t>(op & 0xff) | static_cast<std::uint64_t>((dtype + 1) & 0xff) << 8 |
                static_cast<std::uint64_t>(static_cast<std::uint32_t>(detail)) << 32,
            numel};
  }
  [[nodiscard]] constexpr OperationRecord unpack(std::int64_t seq) const noexcept {
    return {seq, static_cast<std::int64_t>(code & 0xff), static_cast<std::int64_t>((code >> 8) & 0xff) - 1, numel,
            static_cast<std::int32_t>(static_cast<std::uint32_t>(code >> 32))};
  }
  /// `to = *this`, word by word: copied whole, a record just built is read back in one
  /// 16-byte load, which waits for the two 8-byte stores still in flight (a
  /// store-forwarding stall, ~5 ns of a preamble).
  void store_into(PackedRecord& to) const noexcept { to.code = code, to.numel = numel; }
};

/// "all_reduce #12 (Float, 676 elements)"; without the number when `numbered` is false.
inline std::string describe_operation(const OperationRecord& r, bool numbered = true) {
  std::string s(operation_name(r.op));
  if (numbered) {
    s += " #";
    s += std::to_string(r.seq);
  }
  if (r.dtype >= 0) {
    s += " (";
    s += c10::toString(static_cast<at::ScalarType>(r.dtype));
    // An all-to-all's element count is each rank's own (uneven parts): recorded as -1.
    s += r.numel < 0 ? std::string(", each rank's own counts") : ", " + std::to_string(r.numel) + " elements";
    if (r.op == operation_code("all_reduce") || r.op == operation_code("reduce_scatter"))
      s.append(", ").append(to_string(static_cast<reduce_op>(r.detail)));
    else if (r.op == operation_code("broadcast"))
      s.append(", root ").append(std::to_string(r.detail));
    s += ")";
  }
  return s;
}

/// An operation's record; dtype -1 for none.
inline PackedRecord record_of(std::string_view op, std::int64_t dtype, std::int64_t numel, int detail) {
  // iall_reduce and all_reduce match each other across ranks: one name for both.
  const auto code = operation_code(op == "iall_reduce" ? std::string_view("all_reduce") : op);
  return PackedRecord::of(code, dtype, numel, detail);
}
inline PackedRecord record_of(std::string_view op, const at::Tensor& t, int detail) {
  return record_of(op, t.defined() ? static_cast<std::int64_t>(t.scalar_type()) : -1, t.defined() ? t.numel() : 0,
                   detail);
}

/// The lock of every ledger and of the watchdog's table of pending operations
/// (reliability/watchdog.hpp), so that a collective is counted and watched under one
/// acquisition. A spinlock: it is held for a few dozen instructions at a time, and an
/// uncontended std::mutex costs an atomic operation to unlock as well as to lock (15 ns a
/// pair against 7, measured with a second thread alive, as a communicator's process has);
/// a waiter that spins long yields its core, as it must where ranks outnumber cores.
class LedgerLock {
 public:
  void lock() noexcept {
    for (int spins = 0; flag_.test_and_set(std::memory_order_acquire);)
      while (flag_.test(std::memory_order_relaxed))
        if (++spins > 64) std::this_thread::yield();
  }
  bool try_lock() noexcept { return !flag_.test_and_set(std::memory_order_acquire); }
  void unlock() noexcept { flag_.clear(std::memory_order_release); }

 private:
  std::atomic_flag flag_;
};
inline LedgerLock& ledger_lock() noexcept {
  static LedgerLock lock;
  return lock;
}

class Watchdog;

/// What one communicator has done: its collectives' count, fingerprint and recent history.
/// `id` is the same on every member rank (a hash of the members' world ranks and how many
/// communicators over the same members this process made before).
class Ledger {
 public:
  Ledger(std::string name, std::vector<int> members, int rank) : name_(std::move(name)), members_(std::move(members)), rank_(rank) {
    Fnv1a members_hash;
    for (int m : members_) members_hash.mix(static_cast<std::uint64_t>(m + 1));
    const auto h = members_hash.value();
    static std::mutex mutex;
    static std::map<std::uint64_t, std::uint64_t> made;
    std::lock_guard lock(mutex);
    id_ = static_cast<std::int64_t>((h ^ (made[h]++ * 0x9e3779b97f4a7c15ull)) >> 1);
  }

  [[nodiscard]] std::int64_t id() const noexcept { return id_; }
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  [[nodiscard]] const std::vector<int>& members() const noexcept { return members_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }

  /// The fingerprint about to be compared; the comparison is no longer due.
  [[nodiscard]] std::uint64_t fingerprint_to_compare() {
    std::lock_guard lock(ledger_lock());
    due_ = false;
    return fingerprint_.value();
  }
  [[nodiscard]] std::int64_t count() const {
    std::lock_guard lock(ledger_lock());
    return static_cast<std::int64_t>(count_);
  }

  /// The recent collectives, oldest first, padded with seq-0 records to history_length.
  [[nodiscard]] std::array<OperationRecord, history_length> history() const {
    std::lock_guard lock(ledger_lock());
    return recent_held<history_length>();
  }

 private:
  friend class Watchdog;  // counts and reads under ledger_lock(), which it holds

  // Counts `r` (its seq ignored): its seq, and whether the fingerprint is due (from every
  // fingerprint_period-th collective until the comparison takes it: fingerprint_to_compare).
  struct Counted {
    std::int64_t seq;
    bool due;
  };
  Counted record_held(const PackedRecord& r) {
    const auto count = ++count_;
    // two words, where four (one a field) made a chain of four multiplications a collective
    fingerprint_.mix(r.code);
    fingerprint_.mix(static_cast<std::uint64_t>(r.numel));
    r.store_into(history_[(count - 1) % history_length]);  // its seq is `count`: where it lies says so
    if (count % fingerprint_period == 0) due_ = true;
    return {static_cast<std::int64_t>(count), due_};
  }
  // The last N collectives, oldest first, padded with seq-0 records.
  template <std::size_t N>
  [[nodiscard]] std::array<OperationRecord, N> recent_held() const {
    static_assert(N <= history_length);
    std::array<OperationRecord, N> out{};
    const auto n = std::min<std::uint64_t>(count_, N);
    for (std::uint64_t i = 0; i < n; ++i) {
      const auto seq = count_ - n + i + 1;
      out[i] = history_[(seq - 1) % history_length].unpack(static_cast<std::int64_t>(seq));
    }
    return out;
  }

  std::string name_;
  std::vector<int> members_;
  int rank_;
  std::int64_t id_ = 0;
  std::uint64_t count_ = 0;
  bool due_ = false;  // a comparison is due: Note [Collective fingerprint]
  Fnv1a fingerprint_;
  std::array<PackedRecord, history_length> history_{};  // collective k (from 1) at (k - 1) % history_length
};

/// The first collective that two histories (oldest first) record differently, as the pair.
inline std::optional<std::pair<OperationRecord, OperationRecord>> first_divergence(std::span<const OperationRecord> a,
                                                                                   std::span<const OperationRecord> b) {
  for (const auto& x : a) {
    if (x.seq == 0) continue;
    for (const auto& y : b)
      if (y.seq == x.seq) {
        if (!(x == y)) return std::pair{x, y};
        break;
      }
  }
  return std::nullopt;
}

/// Ranks as "0, 2, 3".
inline std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (int r : ranks) {
    if (!s.empty()) s += ", ";
    s += std::to_string(r);
  }
  return s.empty() ? "none" : s;
}

/// After the fingerprints disagreed: every rank's history (oldest first, in member order)
/// gives the first collective that differs, and the ranks on each side. The same text on
/// every rank, since every rank sees the same histories.
inline std::string fingerprint_mismatch(const Ledger& ledger,
                                        const std::vector<std::array<OperationRecord, history_length>>& histories) {
  std::int64_t first = INT64_MAX;
  for (std::size_t i = 1; i < histories.size(); ++i)
    if (auto d = first_divergence(histories[0], histories[i])) first = std::min(first, d->first.seq);
  std::string s = "the ranks of communicator " + ledger.name() + " issued different collectives";
  if (first == INT64_MAX) return s + " before the last " + std::to_string(history_length) + " (their fingerprints differ)";
  // Group the ranks by what they issued as collective `first`.
  std::vector<std::pair<OperationRecord, std::vector<int>>> sides;
  for (std::size_t i = 0; i < histories.size(); ++i) {
    OperationRecord mine{first, 0, -1, 0, 0};
    for (const auto& r : histories[i])
      if (r.seq == first) mine = r;
    auto it = std::find_if(sides.begin(), sides.end(), [&](const auto& side) { return side.first == mine; });
    if (it == sides.end()) it = sides.insert(sides.end(), {mine, {}});
    it->second.push_back(ledger.members()[i]);
  }
  // append, not operator+ on temporaries: GCC 12 warns falsely (-Wstringop-overflow) there
  s.append(": the first that differs is #").append(std::to_string(first)).append(":");
  for (const auto& [record, ranks] : sides)
    s.append(" ")
        .append(record.op == 0 ? std::string("none") : describe_operation(record, false))
        .append(ranks.size() > 1 ? " on world ranks " : " on world rank ")
        .append(rank_list(ranks))
        .append(";");
  s.pop_back();
  return s + "; every rank must issue the same collectives in the same order";
}

}  // namespace paratrain::detail
