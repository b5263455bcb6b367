#pragma once
/// \file
/// comm::Rendezvous — where processes started without MPI meet: a c10d store (a TCPStore at
/// MASTER_ADDR:MASTER_PORT, as torchrun; a FileStore on a file system every rank sees; none
/// for a world of one), with this process's rank, world size and local rank. comm::Gloo
/// meets through one; comm::Nccl agrees NCCL's unique id over one
/// (comm/nccl/bootstrap_over_store.hpp).

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "paratrain/core/message.hpp"
#include "paratrain/comm/launch.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/reliability/watchdog.hpp"
#include "paratrain/util/torch_compat.hpp"

namespace paratrain::comm {

// Note [torchrun's store]
// torchrun's elastic agent (its default, static rendezvous) serves a c10d TCPStore at
// MASTER_ADDR:MASTER_PORT itself and tells its workers so (TORCHELASTIC_USE_AGENT_STORE=True):
// a rank 0 that listened there would find the port taken. As PyTorch's own env:// rendezvous
// does, every rank then connects as a client and keys go under "/worker/attempt_<restart
// count>/", so that a restarted group never reads an earlier attempt's keys (NCCL's unique id,
// the barrier's counts). Without the agent (a script, srun, the c10d rendezvous backend), rank
// 0 serves the store.

/// The meeting point of a group of processes, and each one's place in it.
///
/// Rank, world size and local rank come from `paratrain::detect_placement()` (torchrun's
/// RANK/WORLD_SIZE/LOCAL_RANK, mpirun's, srun's) unless Options names them. The ranks meet
/// in a c10d FileStore at Options::file (PARATRAIN_STORE_FILE) when one is named, else in a
/// c10d TCPStore that rank 0 runs at MASTER_ADDR:MASTER_PORT; a world of one meets nobody
/// (an in-memory store). Collective: the constructor returns once every rank has joined
/// (at most Options::timeout), and throws paratrain::error naming the variable to fix
/// otherwise.
///
/// \code
///   paratrain::comm::Rendezvous meeting;      // torchrun's variables, or PARATRAIN_STORE_FILE
///   paratrain::comm::Nccl gpus(meeting);      // with comm/nccl/bootstrap_over_store.hpp
/// \endcode
class Rendezvous {
 public:
  struct Options {
    /// This process's rank; by default `detect_placement().rank`.
    std::optional<int> rank;
    /// The number of ranks; by default `detect_placement().world_size`.
    std::optional<int> world_size;
    /// This process's rank among those of its node; by default `detect_placement().local_rank`.
    std::optional<int> local_rank;
    /// The host where rank 0 listens for the others; by default the environment's MASTER_ADDR.
    std::optional<std::string> master_addr;
    /// Its port; by default the environment's MASTER_PORT.
    std::optional<int> master_port;
    /// A file that every rank can reach (a shared file system, or /tmp on one node): the
    /// ranks meet there, through a c10d FileStore, instead of at MASTER_ADDR:MASTER_PORT. By
    /// default the environment's PARATRAIN_STORE_FILE. It must not hold an earlier
    /// meeting's keys: use a fresh name per job.
    std::string file = env_string("PARATRAIN_STORE_FILE");
    /// How long to wait for the other ranks, at the meeting and for any key after it. By
    /// default PARATRAIN_TIMEOUT (seconds), else 10 minutes.
    std::chrono::milliseconds timeout = detail::default_timeout();
  };

  /// Meets as the launcher describes. `who` names the operation in errors ("comm::Gloo").
  Rendezvous() : Rendezvous(Options{}) {}
  explicit Rendezvous(Options o, const char* who = "comm::Rendezvous") : who_(who) {
    if (!o.rank || !o.world_size || !o.local_rank) {
      const auto placement = detect_placement();
      rank_ = o.rank.value_or(placement.rank);
      size_ = o.world_size.value_or(placement.world_size);
      local_rank_ = o.local_rank.value_or(placement.local_rank);
    } else {
      rank_ = *o.rank;
      size_ = *o.world_size;
      local_rank_ = *o.local_rank;
    }
    if (size_ < 1) fail(-1, "world size " + std::to_string(size_) + " is not at least 1");
    if (rank_ < 0 || rank_ >= size_)
      fail(-1, "rank " + std::to_string(rank_) + " is not in a world of " + std::to_string(size_) + " (0.." +
                   std::to_string(size_ - 1) + ")");
    if (local_rank_ < 0) fail(rank_, "local rank " + std::to_string(local_rank_) + " is negative");
    timeout_ = o.timeout;
    try {
      if (!o.file.empty()) {
        where_ = "file " + o.file;
        store_ = c10::make_intrusive<c10d::FileStore>(o.file, size_);
        store_->setTimeout(o.timeout);
        // FileStore's constructor does not wait for the others: a barrier on the file does.
        arrive_and_wait("paratrain/rendezvous/");
      } else if (size_ == 1) {
        store_ = c10::make_intrusive<c10d::HashStore>();  // a world of one meets nobody
      } else {
        auto at = address(o);
        if (!at)
          fail(rank_, "no address to meet at: neither MASTER_ADDR nor Options::master_addr is set; the " +
                          std::to_string(size_) +
                          " ranks meet at MASTER_ADDR:MASTER_PORT, where rank 0 listens; export both, as torchrun "
                          "does (MASTER_ADDR=<rank 0's host> MASTER_PORT=<a free port>), or name a shared file "
                          "in PARATRAIN_STORE_FILE");
        host_ = std::move(at->first);
        port_ = at->second;
        where_ = host_ + ":" + std::to_string(port_);
        // Note [torchrun's store]: under torchrun's agent, which already serves a store at
        // MASTER_ADDR:MASTER_PORT, every rank is its client, under the attempt's prefix.
        const bool agent = env_string("TORCHELASTIC_USE_AGENT_STORE") == "True";
        c10d::TCPStoreOptions store_options;
        store_options.port = static_cast<std::uint16_t>(port_);
        store_options.isServer = rank_ == 0 && !agent;
        store_options.numWorkers = size_;
        store_options.waitWorkers = !agent;
        store_options.timeout = o.timeout;
        store_ = c10::make_intrusive<c10d::TCPStore>(host_, detail::plain_socket_store(store_options));
        if (agent) {
          const auto attempt = env_string("TORCHELASTIC_RESTART_COUNT");
          store_ = c10::make_intrusive<c10d::PrefixStore>(
              "/worker/attempt_" + (attempt.empty() ? std::string("0") : attempt) + "/paratrain", store_);
          where_ += " (torchrun's store)";
          arrive_and_wait("paratrain/rendezvous/");  // the agent's store counts no workers: a barrier does
        }
      }
    } catch (const error&) {
      throw;
    } catch (const std::exception& e) {
      auto why = paratrain::detail::message_of(e);
      while (!why.empty() && (why.back() == '.' || why.back() == ' ' || why.back() == '\n')) why.pop_back();
      const std::string hint =
          !o.file.empty() ? "; check that every rank names the same file and can write its directory"
          : rank_ == 0    ? "; if the port is in use, pick another MASTER_PORT"
                          : "; check that rank 0 has started, that MASTER_ADDR is its host and that the port is "
                            "reachable";
      fail(rank_, "rendezvous at " + where_ + " of " + std::to_string(size_) + " ranks failed: " + why + hint);
    }
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] int local_rank() const noexcept { return local_rank_; }
  /// "host:port", "file <path>", or "" for a world of one: for messages.
  [[nodiscard]] const std::string& where() const noexcept { return where_; }
  /// MASTER_ADDR and MASTER_PORT where the ranks met through a TCPStore; "" and 0 otherwise.
  [[nodiscard]] const std::string& host() const noexcept { return host_; }
  [[nodiscard]] int port() const noexcept { return port_; }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return timeout_; }
  /// The store, shared: groups made over it keep it alive.
  [[nodiscard]] const c10::intrusive_ptr<c10d::Store>& store() const noexcept { return store_; }

  /// A key prefix no earlier call on this rank gave, the same on every rank that calls in
  /// the same order: "paratrain/<what>/<n>/", for one agreement over the store.
  [[nodiscard]] std::string fresh_prefix(std::string_view what) {
    return "paratrain/" + std::string(what) + "/" + std::to_string(uses_++) + "/";
  }

  /// Every rank's `mine`, in rank order, through the store: each sets its own key and
  /// reads the others' (blocking up to the timeout). Collective, and returns once every rank
  /// has read; `what` names the keys.
  [[nodiscard]] std::vector<std::string> all_gather(std::string_view what, const std::string& mine) {
    const auto prefix = fresh_prefix(what);
    store_->set(prefix + std::to_string(rank_), std::vector<std::uint8_t>(mine.begin(), mine.end()));
    std::vector<std::string> out;
    out.reserve(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r) {
      const auto bytes = get(prefix + std::to_string(r), what);
      out.emplace_back(bytes.begin(), bytes.end());
    }
    everyone_read(prefix, what);
    return out;
  }

  /// The value rank `root` sets: `value` there, what it set elsewhere. Collective, and
  /// returns once every rank has read it.
  [[nodiscard]] std::string broadcast(std::string_view what, const std::string& value, int root) {
    const auto prefix = fresh_prefix(what);
    std::string out = value;
    if (rank_ == root) {
      store_->set(prefix + "value", std::vector<std::uint8_t>(value.begin(), value.end()));
    } else {
      const auto bytes = get(prefix + "value", what);
      out.assign(bytes.begin(), bytes.end());
    }
    everyone_read(prefix, what);
    return out;
  }

 private:
  static std::string env_string(const char* name) {
    const char* v = std::getenv(name);
    return v == nullptr ? std::string() : std::string(v);
  }

  [[noreturn]] void fail(int rank, const std::string& message) const { throw error(who_, rank, message); }

  // One store call of an agreement, whose failure names what was waited for.
  template <class Call>
  auto waiting(const std::string& what, Call&& call) {
    try {
      return call();
    } catch (const std::exception& e) {
      fail(rank_, "waiting at " + (where_.empty() ? std::string("the store") : where_) + " for " + what +
                      " failed: " + paratrain::detail::message_of(e) +
                      "; a rank has not reached the same point, or has died");
    }
  }

  std::vector<std::uint8_t> get(const std::string& k, std::string_view what) {
    return waiting(std::string(what) + " (key " + k + ")", [&] { return store_->get(k); });
  }

  // Returns once every rank has arrived at `prefix`: the last to arrive sets the key the
  // others wait for. Rank 0, whose TCPStore serves the others, returns last: once every rank
  // has left its wait, so that none is still waiting on a server that has gone on and ended.
  void arrive_and_wait(const std::string& prefix) {
    if (store_->add(prefix + "arrived", 1) == size_) store_->set(prefix + "all-arrived", std::vector<std::uint8_t>{1});
    store_->wait({prefix + "all-arrived"}, timeout_);
    if (store_->add(prefix + "left", 1) == size_) store_->set(prefix + "all-left", std::vector<std::uint8_t>{1});
    if (rank_ == 0) store_->wait({prefix + "all-left"}, timeout_);
  }

  // Returns once every rank has read the agreement's keys: rank 0, whose TCPStore serves
  // them, may then go on, and even end, without leaving a reader behind.
  void everyone_read(const std::string& prefix, std::string_view what) {
    waiting("every rank to read " + std::string(what), [&] { arrive_and_wait(prefix); });
  }

  // The rendezvous address: Options first, then the environment. nullopt when neither says.
  std::optional<std::pair<std::string, int>> address(const Options& o) const {
    std::string host = o.master_addr ? *o.master_addr : env_string("MASTER_ADDR");
    if (host.empty()) return std::nullopt;
    int port = 0;
    std::string cited;
    if (o.master_port) {
      port = *o.master_port;
      cited = "Options::master_port=" + std::to_string(port);
    } else {
      const auto text = env_string("MASTER_PORT");
      if (text.empty())
        fail(rank_, "MASTER_ADDR=" + host + " is set but MASTER_PORT is not; export the port rank 0 listens on");
      cited = "MASTER_PORT=" + text;
      const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), port);
      if (ec != std::errc{} || end != text.data() + text.size()) port = -1;
    }
    if (port < 1 || port > 65535) fail(rank_, cited + " is not a port number (1 to 65535)");
    return std::pair{std::move(host), port};
  }

  const char* who_;
  int rank_ = 0;
  int size_ = 1;
  int local_rank_ = 0;
  std::string where_;
  std::string host_;
  int port_ = 0;
  std::chrono::milliseconds timeout_{};
  c10::intrusive_ptr<c10d::Store> store_;
  int uses_ = 0;
};

}  // namespace paratrain::comm
