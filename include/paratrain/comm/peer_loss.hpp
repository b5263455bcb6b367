#pragma once
/// \file
/// comm::PeerLoss — the flag that a group of ranks built to survive a lost rank shares
/// (elastic::Membership's generations), and the wait that watches it: Note [Recoverable groups].

#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <utility>

#include "paratrain/core/error.hpp"

namespace paratrain::comm {

// Note [Recoverable groups]
// A communicator made by elastic::Membership carries a PeerLoss (Gloo::Options::peer_loss), shared by every group of
// one generation (the world and its splits). Its operations then never end the job and never
// wait past the timeout:
// - a failed operation (Gloo saw a peer's socket close) raises the loss: the flag is set here
//   and announced to the other ranks through the store (Membership's callback), and the
//   operation throws paratrain::peer_lost;
// - a wait polls the flag every few milliseconds, so a rank whose own peers are alive learns of
//   the loss from the store (Membership's monitor thread hears the announcement) and throws
//   too, rather than waiting for Gloo's timeout;
// - a wait longer than the communicator's timeout (a stopped rank: nothing closes) raises it.
// The watchdog watches such operations with a longer limit, past the wait's, so that it never
// ends a job the survivors can carry on. A work abandoned this way may still run on Gloo's
// threads: its handles (and so its tensors) are leaked, and so is the group itself, whose
// destructor would join those threads (comm::Gloo's State).
/// What the groups of one generation share: whether a rank of it is lost, and why.
class PeerLoss {
 public:
  using Announce = std::function<void(const std::string&)>;
  explicit PeerLoss(Announce announce = {}) : announce_(std::move(announce)) {}

  [[nodiscard]] bool lost() const noexcept { return lost_.load(std::memory_order_acquire); }
  [[nodiscard]] std::string why() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return why_;
  }

  /// Marks the loss this rank saw, once, and announces it to the others.
  void raise(const std::string& why) {
    if (!mark(why)) return;
    if (announce_) try {
        announce_(why);
      } catch (...) {  // the others learn it from their own failed operations
      }
  }
  /// Marks the loss another rank announced.
  void heard(const std::string& why) { static_cast<void>(mark(why)); }

 private:
  bool mark(const std::string& why) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (lost()) return false;
      why_ = why;
    }
    lost_.store(true, std::memory_order_release);
    return true;
  }

  Announce announce_;
  mutable std::mutex mutex_;
  std::string why_;
  std::atomic<bool> lost_{false};
};

}  // namespace paratrain::comm

namespace paratrain::detail {

/// Waits for `work` as Note [Recoverable groups] says: throws peer_lost once the loss is
/// raised or heard, or when the wait passes `limit` (raising it). A failure of the work itself
/// is rethrown as the work's exception, for the caller to turn into a loss.
inline void await_work(c10d::Work& work, comm::PeerLoss& loss, std::chrono::milliseconds limit, const char* op, int rank) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (!work.isCompleted()) {
    if (loss.lost()) throw peer_lost(op, rank, "abandoned, a rank is lost: " + loss.why());
    if (std::chrono::steady_clock::now() >= until) {
      const auto why = std::string(op) + " on rank " + std::to_string(rank) + " did not complete within " +
                       std::to_string(limit.count() / 1000.0).substr(0, 5) + " s (a rank stopped answering)";
      loss.raise(why);
      throw peer_lost(op, rank, why);
    }
    try {
      work.wait(std::chrono::milliseconds(10));
    } catch (...) {  // "timed out" after 10 ms, or the work failed: the loop tells which
    }
  }
  work.wait();  // complete: returns, or throws the work's failure
}

}  // namespace paratrain::detail
