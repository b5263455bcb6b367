#pragma once
/// \file
/// The watchdog's channel under a torchrun-style launch (comm::Gloo): Note [Watchdog]
/// (reliability/watchdog.hpp).

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "paratrain/util/torch_compat.hpp"
#include "paratrain/reliability/watchdog.hpp"

namespace paratrain::detail {

/// Questions and answers through the rendezvous store (rank 0's TCPStore), over a
/// connection of the watchdog's own whose operations give up after the grace period:
/// a stopped rank 0 cannot block the report. Every rank's watchdog thread looks for a
/// question once a tick (one round trip); the asker leaves its question, then reads the
/// answers that come within the grace period.
class GlooWatchdogChannel final : public WatchdogChannel {
 public:
  GlooWatchdogChannel(std::string host, std::uint16_t port, int rank, int size)
      : host_(std::move(host)), port_(port), rank_(rank), size_(size) {}

  [[nodiscard]] int world_rank() const override { return rank_; }
  [[nodiscard]] int world_size() const override { return size_; }

  void serve(const std::function<RankStatus(std::int64_t)>& describe_self) override {
    try {
      auto& s = store(std::chrono::seconds(5));
      const auto asked = s.add(key("asks"), 0);
      if (asked <= answered_) return;
      answered_ = asked;
      answer(s, describe_self);
    } catch (const std::exception&) {  // the store is gone: the job is ending anyway
    }
  }

  std::map<int, RankStatus> ask(std::int64_t ledger, std::chrono::milliseconds grace,
                                const std::function<RankStatus(std::int64_t)>& describe_self) override {
    std::map<int, RankStatus> answers;
    const auto until = std::chrono::steady_clock::now() + grace;
    try {
      auto& s = store(grace);
      s.set(key("ledger"), bytes(&ledger, sizeof ledger));
      answered_ = s.add(key("asks"), 1);
      answer(s, describe_self);  // so that a rank asking at the same time has this rank's answer
      while (static_cast<int>(answers.size()) < size_ - 1 && std::chrono::steady_clock::now() < until) {
        for (int r = 0; r < size_; ++r)
          if (r != rank_ && !answers.count(r) && s.check({status_key(r)})) {
            const auto b = s.get(status_key(r));
            if (b.size() == sizeof(RankStatus)) std::memcpy(&answers[r], b.data(), sizeof(RankStatus));
          }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    } catch (const std::exception&) {  // rank 0, which holds the store, is stopped or dead
    }
    return answers;
  }

  [[noreturn]] void end_job(int code) override { std::_Exit(code); }

 private:
  c10d::TCPStore& store(std::chrono::milliseconds timeout) {
    if (!store_) {
      c10d::TCPStoreOptions o;
      o.port = port_;
      o.isServer = false;
      o.waitWorkers = false;
      o.timeout = timeout;
      store_ = std::make_unique<c10d::TCPStore>(host_, plain_socket_store(o));
    }
    store_->setTimeout(timeout);
    return *store_;
  }

  void answer(c10d::TCPStore& s, const std::function<RankStatus(std::int64_t)>& describe_self) {
    const auto b = s.get(key("ledger"));
    std::int64_t ledger = 0;
    if (b.size() == sizeof ledger) std::memcpy(&ledger, b.data(), sizeof ledger);
    auto status = describe_self(ledger);
    status.world_rank = rank_;
    s.set(status_key(rank_), bytes(&status, sizeof status));
  }

  static std::string key(const char* name) { return std::string("paratrain/watchdog/") + name; }
  static std::string status_key(int r) { return "paratrain/watchdog/status/" + std::to_string(r); }
  static std::vector<std::uint8_t> bytes(const void* p, std::size_t n) {
    const auto* b = static_cast<const std::uint8_t*>(p);
    return {b, b + n};
  }

  std::string host_;
  std::uint16_t port_;
  int rank_;
  int size_;
  std::int64_t answered_ = 0;
  std::unique_ptr<c10d::TCPStore> store_;
};

}  // namespace paratrain::detail
