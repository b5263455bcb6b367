#pragma once
/// \file
/// elastic::Membership — the ranks of a job that goes on when some are lost: generations of
/// comm::Gloo groups, met in a store that outlives every rank, each without the ranks the
/// last one lost (Note [Generations]).

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "paratrain/comm/peer_loss.hpp"
#include "paratrain/comm/gloo/gloo.hpp"
#include "paratrain/comm/launch.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/core/message.hpp"

namespace paratrain::elastic {

// Note [Generations]
// The ranks meet in a c10d FileStore: a file every rank reaches, which no rank's death takes
// with it (a TCPStore lives in rank 0's process). Generation 0 is every rank the launcher
// started; its comm::Gloo group meets under "paratrain/elastic/0/group". Each generation's
// groups share one comm::PeerLoss (Note [Recoverable groups]), whose announcement is the key
// "paratrain/elastic/<g>/lost". Every rank's monitor thread polls that key every 20 ms; when it
// appears, the thread hears the loss (so that the rank's waits throw) and says this rank is
// alive for generation g + 1 (one add to "<g+1>/alive"): a thread, so a rank busy computing
// answers too, and a dead or stopped one does not.
//
// regroup() is the survivors' meeting for generation g + 1. Each takes a ticket ("<g+1>/joined")
// and leaves its rank of generation g under it. The first to arrive closes the meeting: it waits
// Options::settle for the living to answer, then for as many to join as answered (at most the
// timeout), and writes the count that joined ("<g+1>/closed"). Those are generation g + 1, ranked
// in their old order; a rank whose ticket came after the count was written (a stopped rank woken
// later) is left out, with an error. A second loss during the meeting ends it with an error on
// every rank: the restart path takes over.
//
// A rank started while the job runs (the key "paratrain/elastic/generation" is there: each
// generation's ranks set it once their group stands) joins it instead of meeting as
// generation 0: it takes a ticket ("joiners") and waits for its admission. Rank 0 counts the
// waiting (waiting()) at each of fit's mid-epoch checkpoints; the ranks agree on the count,
// and where it is not 0 fit stops there (joining_reason) and admit() makes the next generation
// of the ranks there are and the waiting ones, ranked after them; every one of them then
// resumes from that checkpoint.

/// How an elastic job's ranks meet, and go on after a loss.
struct Options {
  /// The file where the ranks meet, generation after generation: every rank must reach it (a
  /// shared file system across nodes, /tmp on one), and it must be fresh for each job. By
  /// default PARATRAIN_STORE_FILE.
  std::string store_file = env_string("PARATRAIN_STORE_FILE");
  /// After a loss, how long the first survivor at the next meeting waits for the living to
  /// answer (each answers within 20 ms of the loss's announcement); it then waits for exactly
  /// those.
  std::chrono::milliseconds settle{1000};
  /// The fewest ranks to go on with: a meeting of fewer is an error on every rank there.
  int min_ranks = 1;
  /// How many losses to survive in-process; the next one is an error (the restart path).
  int max_recoveries = 16;
  /// The groups' options. Its timeout is how long a collective may wait before the ranks it
  /// waits for count as lost (a stopped process); by default PARATRAIN_TIMEOUT, else 10 minutes.
  comm::Gloo::Options communicator;

 private:
  static std::string env_string(const char* name) {
    const char* v = std::getenv(name);
    return v == nullptr ? std::string() : std::string(v);
  }
};

/// The current generation of an elastic job's ranks, and the meeting that makes the next.
///
/// \code
///   paratrain::elastic::Membership members;   // PARATRAIN_STORE_FILE, RANK, WORLD_SIZE
///   try { ... members.communicator() ... } catch (const paratrain::peer_lost&) { members.regroup(); }
/// \endcode
class Membership {
 public:
  /// Meets every rank the launcher started (detect_placement()) as generation 0. Collective.
  explicit Membership(Options o = {}) : options_(std::move(o)) {
    const auto placement = detect_placement();
    rank_ = placement.rank;
    size_ = placement.world_size;
    if (options_.store_file.empty())
      fail("an elastic job meets in a file that every rank reaches and that outlives each of them: set "
           "PARATRAIN_STORE_FILE (a fresh name per job), or elastic::Options::store_file");
    if (options_.min_ranks < 1) fail("Options::min_ranks must be at least 1");
    // A write to a lost peer's socket must fail (EPIPE), not end this process: SIGPIPE is
    // ignored where nobody handles it (Python does the same for PyTorch's ranks).
    struct sigaction now {};
    if (sigaction(SIGPIPE, nullptr, &now) == 0 && now.sa_handler == SIG_DFL) std::signal(SIGPIPE, SIG_IGN);
    try {
      store_ = open_store();
      monitor_store_ = open_store();
    } catch (const std::exception& e) {
      fail("cannot open the store file " + options_.store_file + ": " + paratrain::detail::message_of(e));
    }
    if (running()) join_running();
    else open(0, rank_, size_);
    monitor_ = std::thread([this] { watch(); });
  }
  Membership(const Membership&) = delete;
  Membership& operator=(const Membership&) = delete;
  ~Membership() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    woken_.notify_all();
    monitor_.join();
  }

  /// The current generation's group: what the strategy is built over.
  [[nodiscard]] comm::Gloo& communicator() noexcept { return *communicator_; }
  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] int generation() const noexcept { return generation_; }
  [[nodiscard]] const Options& options() const noexcept { return options_; }

  /// After a paratrain::peer_lost: meets the survivors as the next generation (Note
  /// [Generations]) and makes its group; communicator(), rank() and size() are then its.
  /// Throws paratrain::error where this rank is left out, too few ranks are left, or the
  /// recoveries allowed are spent: the restart path's turn.
  void regroup() {
    if (++recoveries_ > options_.max_recoveries)
      fail("a rank was lost again after " + std::to_string(options_.max_recoveries) +
           " recoveries (elastic::Options::max_recoveries)");
    const int next = generation_ + 1;
    const auto p = prefix(next);
    std::int64_t ticket = 0, count = 0;
    std::vector<int> members;
    try {
      ticket = store_->add(p + "joined", 1);
      store_->set(p + "member/" + std::to_string(ticket), bytes(std::to_string(rank_)));
      if (ticket == 1) close_meeting(p);
      store_->wait({p + "closed"}, options_.communicator.timeout);
      count = number(store_->get(p + "closed"));
      if (ticket <= count)
        for (std::int64_t t = 1; t <= count; ++t) members.push_back(static_cast<int>(number(store_->get(p + "member/" + std::to_string(t)))));
    } catch (const std::exception& e) {
      fail("the survivors' meeting for generation " + std::to_string(next) + " failed: " +
           paratrain::detail::message_of(e) + " (another rank was lost meanwhile?)");
    }
    if (ticket > count)
      fail("reached generation " + std::to_string(next) + "'s meeting after it closed with " + std::to_string(count) +
           " ranks; the others go on without this one (a rank that stopped answering is left out)");
    if (count < options_.min_ranks)
      fail(std::to_string(count) + " ranks are left, fewer than elastic::Options::min_ranks = " +
           std::to_string(options_.min_ranks));
    std::sort(members.begin(), members.end());
    const auto me = std::find(members.begin(), members.end(), rank_);
    open(next, static_cast<int>(me - members.begin()), static_cast<int>(count));
  }

  /// How many ranks wait to join, on rank 0 (0 elsewhere): a read of the store.
  [[nodiscard]] std::int64_t waiting() {
    if (rank_ != 0) return 0;
    try {
      return store_->add(joiners_key, 0) - store_->add(admitted_key, 0);
    } catch (const std::exception&) {
      return 0;
    }
  }

  /// Makes the next generation of this one's ranks and those waiting to join (Note
  /// [Generations]): every rank of this generation calls it, after fit stopped at a
  /// checkpoint for them. Returns how many joined.
  int admit() {
    const int next = generation_ + 1;
    const auto p = prefix(next);
    std::int64_t size = 0;
    try {
      if (rank_ == 0) {
        const auto admitted = store_->add(admitted_key, 0), joiners = store_->add(joiners_key, 0);
        for (auto t = admitted + 1; t <= joiners; ++t)
          store_->set("paratrain/elastic/admit/" + std::to_string(t),
                      bytes(std::to_string(next) + " " + std::to_string(size_ + (t - admitted - 1)) + " " +
                            std::to_string(size_ + (joiners - admitted))));
        store_->add(admitted_key, joiners - admitted);
        store_->set(p + "size", bytes(std::to_string(size_ + (joiners - admitted))));
      }
      store_->wait({p + "size"}, options_.communicator.timeout);
      size = number(store_->get(p + "size"));
    } catch (const std::exception& e) {
      fail("letting the waiting ranks in failed: " + paratrain::detail::message_of(e));
    }
    const int joined = static_cast<int>(size) - size_;
    open(next, rank_, static_cast<int>(size));
    return joined;
  }

 private:
  [[noreturn]] void fail(const std::string& why) const { throw error("elastic::Membership", rank_, why); }

  c10::intrusive_ptr<c10d::Store> open_store() const {
    // -1 workers: the file is never removed by a rank's exit; the launcher removes it.
    auto s = c10::make_intrusive<c10d::FileStore>(options_.store_file, -1);
    s->setTimeout(options_.communicator.timeout);
    return s;
  }

  static constexpr const char* generation_key = "paratrain/elastic/generation";
  static constexpr const char* joiners_key = "paratrain/elastic/joiners";
  static constexpr const char* admitted_key = "paratrain/elastic/admitted";

  // Whether the job already runs: a generation's group stood (Note [Generations]).
  bool running() const {
    try {
      std::error_code ec;  // c10d's FileStore writes its file first when a key is set
      return std::filesystem::exists(options_.store_file, ec) && store_->check({generation_key});
    } catch (const std::exception& e) {
      fail("cannot read the store file " + options_.store_file + ": " + paratrain::detail::message_of(e));
    }
  }

  // A rank started while the job runs waits to be let in at its next checkpoint.
  void join_running() {
    std::vector<std::uint8_t> admission;
    try {
      const auto ticket = store_->add(joiners_key, 1);
      const auto key = "paratrain/elastic/admit/" + std::to_string(ticket);
      store_->wait({key}, options_.communicator.timeout);
      admission = store_->get(key);
    } catch (const std::exception& e) {
      fail("the store file " + options_.store_file + " says a job runs, but it did not let this rank in (it does at "
           "each checkpoint; is it still running, does it save checkpoints within PARATRAIN_TIMEOUT, and is the file "
           "not an earlier job's?): " + paratrain::detail::message_of(e));
    }
    int g = 0, rank = 0, size = 0;
    if (std::sscanf(std::string(admission.begin(), admission.end()).c_str(), "%d %d %d", &g, &rank, &size) != 3)
      fail("the store file holds a malformed admission");
    open(g, rank, size);
  }

  static std::string prefix(int generation) { return "paratrain/elastic/" + std::to_string(generation) + "/"; }
  static std::vector<std::uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
  static std::int64_t number(const std::vector<std::uint8_t>& b) { return std::stoll(std::string(b.begin(), b.end())); }

  // Generation `g`'s group, this rank `rank` of `size`, with its PeerLoss announced in the store.
  void open(int g, int rank, int size) {
    auto loss = std::make_shared<comm::PeerLoss>(
        [store = store_, key = prefix(g) + "lost"](const std::string& why) { store->set(key, bytes(why)); });
    auto o = options_.communicator;
    o.peer_loss = loss;
    auto group = std::make_unique<comm::Gloo>(c10::make_intrusive<c10d::PrefixStore>(prefix(g) + "group", store_),
                                              rank, size, std::move(o));
    store_->set(generation_key, bytes(std::to_string(g)));
    std::lock_guard<std::mutex> lock(mutex_);
    communicator_ = std::move(group);
    loss_ = std::move(loss);
    generation_ = g;
    rank_ = rank;
    size_ = size;
  }

  // Note [Generations]: the first survivor at the meeting decides who is in it.
  void close_meeting(const std::string& p) {
    std::this_thread::sleep_for(options_.settle);
    const auto alive = store_->add(p + "alive", 0);
    const auto until = std::chrono::steady_clock::now() + options_.communicator.timeout;
    auto joined = store_->add(p + "joined", 0);
    while (joined < alive && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      joined = store_->add(p + "joined", 0);
    }
    store_->set(p + "closed", bytes(std::to_string(joined)));
  }

  // The monitor thread: hears the current generation's loss, and answers that this rank lives.
  void watch() {
    int answered = -1;
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
      const int g = generation_;
      const auto loss = loss_;
      lock.unlock();
      if (answered < g) try {
          const auto key = prefix(g) + "lost";
          if (monitor_store_->check({key})) {
            const auto why = monitor_store_->get(key);
            loss->heard(std::string(why.begin(), why.end()));
            monitor_store_->add(prefix(g + 1) + "alive", 1);
            answered = g;
          }
        } catch (const std::exception&) {  // the store is unreadable: the waits' own limits act
        }
      lock.lock();
      woken_.wait_for(lock, std::chrono::milliseconds(20), [this] { return stopping_; });
    }
  }

  Options options_;
  int rank_ = 0, size_ = 1, generation_ = 0, recoveries_ = 0;
  c10::intrusive_ptr<c10d::Store> store_;          // the main thread's
  c10::intrusive_ptr<c10d::Store> monitor_store_;  // the monitor thread's own connection to the file
  std::unique_ptr<comm::Gloo> communicator_;
  std::shared_ptr<comm::PeerLoss> loss_;
  std::mutex mutex_;  // generation_, loss_ and stopping_, between the threads
  std::condition_variable woken_;
  bool stopping_ = false;
  std::thread monitor_;
};

}  // namespace paratrain::elastic
