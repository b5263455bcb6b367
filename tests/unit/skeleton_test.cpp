// The communicator skeleton (comm/detail/skeleton.hpp, comm/detail/request.hpp) over a
// loopback transport: two "ranks" are two threads of this process whose word collectives
// meet in memory. What comm::Mpi, comm::Gloo and comm::Nccl share is tested here once,
// without any of them (comm::Nccl's path cannot run without a GPU).
#include <torch/torch.h>

#include <array>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "paratrain/comm/detail/request.hpp"
#include "paratrain/comm/detail/skeleton.hpp"
#include "paratrain/core/error.hpp"
#include "support/doctest.hpp"

// A namespace of its own: this file shares a translation unit with others (Note [Unity groups]).
namespace skeleton_test {

namespace {

using paratrain::reduce_op;
namespace pd = paratrain::detail;

// Two ranks' words, exchanged through memory at a barrier.
struct Exchange {
  std::barrier<> meet{2};
  std::array<std::vector<std::int64_t>, 2> posted;
};

// The word collectives of rank `rank` of a world of two.
struct Loopback {
  Exchange& x;
  int rank;

  void post(const at::Tensor& t) {
    const auto* p = t.data_ptr<std::int64_t>();
    x.posted[static_cast<std::size_t>(rank)].assign(p, p + t.numel());
    x.meet.arrive_and_wait();
  }
  void all_reduce_max(const char*, at::Tensor& words) {
    post(words);
    auto* p = words.data_ptr<std::int64_t>();
    for (std::int64_t i = 0; i < words.numel(); ++i)
      p[i] = std::max(x.posted[0][static_cast<std::size_t>(i)], x.posted[1][static_cast<std::size_t>(i)]);
    x.meet.arrive_and_wait();  // both have read before either posts again
  }
  void all_gather(const char*, const at::Tensor& in, at::Tensor& out) {
    post(in);
    auto* p = out.data_ptr<std::int64_t>();
    for (const auto& part : x.posted) p = std::copy(part.begin(), part.end(), p);
    x.meet.arrive_and_wait();
  }
};
static_assert(pd::word_collectives<Loopback>);

pd::Skeleton make_skeleton(int rank, bool validate) {
  return pd::Skeleton(rank, 2, validate, pd::Watched("loopback", {0, 1}, rank, std::chrono::seconds(60)));
}

// Runs `body(rank, skeleton, transport)` on two threads; returns each rank's error message
// ("" where it threw none).
template <class Body>
std::array<std::string, 2> on_two_ranks(bool validate, Body body) {
  Exchange x;
  std::array<std::string, 2> errors;
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      const auto skeleton = make_skeleton(r, validate);
      Loopback transport{x, r};
      try {
        body(r, skeleton, transport);
      } catch (const paratrain::error& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  for (auto& t : ranks) t.join();
  return errors;
}

}  // namespace

TEST_CASE("skeleton: validation throws on every rank when the ranks' collectives differ") {
  const auto errors = on_two_ranks(/*validate=*/true, [](int rank, const pd::Skeleton& s, Loopback& transport) {
    const auto t = torch::zeros({rank == 0 ? 4 : 5});
    (void)s.begin("all_reduce", t, static_cast<int>(reduce_op::sum), transport);
  });
  for (const auto& e : errors) {
    CAPTURE(e);
    CHECK(e.find("ranks disagree on the element count (this rank: ") != std::string::npos);
    CHECK(e.find("across ranks from 4 to 5)") != std::string::npos);
  }
}

TEST_CASE("skeleton: validation passes when the ranks agree, and then the collective is counted") {
  const auto errors = on_two_ranks(/*validate=*/true, [](int, const pd::Skeleton& s, Loopback& transport) {
    const auto t = torch::zeros({4});
    for (int i = 0; i < 3; ++i) (void)s.begin("broadcast", t, 0, transport);
    CHECK(s.watched().ledger().count() == 3);
  });
  CHECK(errors[0].empty());
  CHECK(errors[1].empty());
}

TEST_CASE("skeleton: without validation, the 256th collective compares fingerprints and names the first difference") {
  const auto errors = on_two_ranks(/*validate=*/false, [](int rank, const pd::Skeleton& s, Loopback& transport) {
    const auto same = torch::zeros({8}, torch::kLong);
    for (int i = 1; i < 10; ++i) (void)s.begin("all_gather", same, 0, transport);
    const auto differs = torch::zeros({rank == 0 ? 6 : 7});
    (void)s.begin("all_reduce", differs, static_cast<int>(reduce_op::sum), transport);  // #10
    for (int i = 11; i <= 256; ++i) (void)s.begin("all_gather", same, 0, transport);  // #256 compares
  });
  for (const auto& e : errors) {
    CAPTURE(e);
    CHECK(e.find("the first that differs is #10: all_reduce (Float, 6 elements, sum) on world rank 0; "
                 "all_reduce (Float, 7 elements, sum) on world rank 1") != std::string::npos);
  }
  // The same text on every rank, after the "paratrain: fingerprint on rank r" prefix.
  CHECK(errors[0].substr(errors[0].find(": the ranks")) == errors[1].substr(errors[1].find(": the ranks")));
}

// A barrier or a split carries no words and cannot compare: where one is the 256th
// collective, the comparison is the next collective's (Note [Collective fingerprint]).
TEST_CASE("skeleton: a barrier that falls on the 256th collective leaves the comparison to the next one") {
  const auto errors = on_two_ranks(/*validate=*/false, [](int rank, const pd::Skeleton& s, Loopback& transport) {
    const auto same = torch::zeros({8}, torch::kLong);
    for (int i = 1; i < 256; ++i) (void)s.begin("all_gather", same, 0, transport);
    (void)s.collective("barrier");  // #256
    const auto differs = torch::zeros({rank == 0 ? 6 : 7});
    (void)s.begin("all_reduce", differs, static_cast<int>(reduce_op::sum), transport);  // #257 compares
  });
  for (const auto& e : errors) {
    CAPTURE(e);
    CHECK(e.find("the first that differs is #257: all_reduce (Float, 6 elements, sum) on world rank 0; "
                 "all_reduce (Float, 7 elements, sum) on world rank 1") != std::string::npos);
  }
}

// What a rank tells the others' watchdogs (Note [Watchdog]): the oldest operation pending on
// the communicator asked about, or else the oldest pending anywhere (pending 2), with the
// communicator's count; a watch ended leaves the table, and the next takes its place.
TEST_CASE("watchdog: a rank's status names the oldest operation pending on the communicator asked about, else anywhere") {
  using namespace std::chrono_literals;
  const pd::Watched a("a", {0}, 0, 60s), b("b", {0}, 0, 60s), idle("idle", {0}, 0, 60s);
  const auto& dog = pd::Watchdog::instance();
  const auto status = [&](const pd::Watched& w) { return dog.status(w.ledger().id()); };
  auto [b1, due_b1] = b.collective("broadcast", at::kFloat, 3, 0);  // the oldest anywhere
  auto [a1, due_a1] = a.collective("all_reduce", at::kFloat, 5, 0);
  auto [a2, due_a2] = a.collective("all_gather", at::kLong, 7, 0);
  auto s = status(a);
  CHECK(s.pending == 1);
  CHECK(s.operation == pd::OperationRecord{1, pd::operation_code("all_reduce"), static_cast<std::int64_t>(at::kFloat), 5, 0});
  CHECK(s.count == 2);
  CHECK(s.history[1].op == pd::operation_code("all_gather"));
  s = status(idle);
  CHECK(s.pending == 2);
  CHECK(s.operation.op == pd::operation_code("broadcast"));
  CHECK(s.count == 0);
  a1.release();  // the newer one on a is now the oldest there
  s = status(a);
  CHECK(s.pending == 1);
  CHECK(s.operation.op == pd::operation_code("all_gather"));
  CHECK(s.operation.seq == 2);
  // An operation's end is noticed without the lock or the clock (Note [Watchdog]): a rank
  // whose last operation ended just now is not idle since that operation's start.
  std::this_thread::sleep_for(300ms);
  b1 = {}, a2 = {};
  CHECK(status(a).pending == 0);
  CHECK(status(idle).pending == 0);
  CHECK(status(idle).idle_ms < 250);
  // The slots given back are taken again, in start order still.
  auto [a3, due_a3] = a.collective("all_to_all", at::kFloat, -1, 0);
  auto [b2, due_b2] = b.collective("barrier", at::ScalarType::Undefined, 0, 0);
  s = status(idle);
  CHECK(s.pending == 2);
  CHECK(s.operation.op == pd::operation_code("all_to_all"));
  CHECK(s.operation.seq == 3);
  CHECK(status(b).operation.op == pd::operation_code("barrier"));
}

// A record is kept as two words (Note [Stores in the preamble]) and its seq implied by its
// place in the ledger's ring: what the history gives back is what was issued, numbered,
// past the ring's wrap too; no dtype, an all-to-all's -1 elements and a negative detail kept.
TEST_CASE("ledger: records kept in two words come back as issued, numbered, after the history wraps") {
  using namespace std::chrono_literals;
  CHECK(pd::PackedRecord::of(pd::operation_code("all_to_all"), -1, -1, -5).unpack(9) ==
        pd::OperationRecord{9, pd::operation_code("all_to_all"), -1, -1, -5});
  CHECK(pd::PackedRecord::of(pd::operation_code("broadcast"), static_cast<std::int64_t>(at::kHalf), std::int64_t{1} << 40,
                             2147483647)
            .unpack(1) == pd::OperationRecord{1, pd::operation_code("broadcast"), static_cast<std::int64_t>(at::kHalf),
                                              std::int64_t{1} << 40, 2147483647});
  const pd::Watched w("wraps", {0}, 0, 60s);
  const int issued = static_cast<int>(pd::history_length) + 44;
  const auto op_of = [](int k) { return k % 2 == 0 ? "broadcast" : "all_reduce"; };
  for (int k = 1; k <= issued; ++k) {
    auto [watch, due] = w.collective(op_of(k), k % 3 == 0 ? at::kLong : at::kFloat, 3 * k, k % 7 - 3);
  }
  const auto s = pd::Watchdog::instance().status(w.ledger().id());
  CHECK(s.count == issued);
  for (std::size_t i = 0; i < s.history.size(); ++i) {
    const int k = issued - static_cast<int>(s.history.size()) + 1 + static_cast<int>(i);
    CAPTURE(k);
    CHECK(s.history[i] == pd::OperationRecord{k, pd::operation_code(op_of(k)),
                                              static_cast<std::int64_t>(k % 3 == 0 ? at::kLong : at::kFloat), 3 * k,
                                              k % 7 - 3});
  }
}

TEST_CASE("skeleton: check_peer names the communicator's ranks") {
  const auto s = make_skeleton(0, false);
  CHECK_NOTHROW(s.check_peer("send", 1));
  CHECK_THROWS_WITH_AS(s.check_peer("send", 2), "paratrain: send on rank 0: rank 2 is not in this communicator of 2 ranks (0..1)",
                       paratrain::error);
  CHECK_THROWS_WITH_AS(s.check_peer("broadcast", -1), doctest::Contains("rank -1 is not in this communicator"),
                       paratrain::error);
}

// ---- the request lifetime ---------------------------------------------------------------

namespace {

struct Calls {
  int waits = 0, tests = 0, abandoned = 0, then = 0;
};

struct FakeOwner;

// Handles that complete on the second test(), and record what was done to them.
struct FakeHandles {
  using owner = FakeOwner;
  FakeHandles() noexcept : calls(nullptr) {}
  Calls* calls;
  [[nodiscard]] bool pending() const noexcept { return calls != nullptr; }
  void wait(const char*, int) {
    ++calls->waits;
    calls = nullptr;
  }
  [[nodiscard]] bool test(const char*, int) {
    if (++calls->tests < 2) return false;
    calls = nullptr;
    return true;
  }
  void abandon() noexcept {
    ++calls->abandoned;
    calls = nullptr;
  }
};
using FakeRequest = pd::BasicRequest<FakeHandles>;

struct FakeOwner {
  static FakeRequest start(Calls& calls) {
    FakeRequest r("fake", 0, {torch::ones({1})});
    r.native_.calls = &calls;
    r.then_ = [&calls] { ++calls.then; };
    return r;
  }
};

}  // namespace

TEST_CASE("skeleton: a request runs its completion once, after test() says complete or wait() returns") {
  Calls calls;
  {
    auto r = FakeOwner::start(calls);
    CHECK_FALSE(r.test());
    CHECK(calls.then == 0);
    CHECK(r.test());
    CHECK(calls.then == 1);
    CHECK(r.test());  // complete: no more calls
    r.wait();
    CHECK(calls.tests == 2);
    CHECK(calls.waits == 0);
  }
  CHECK(calls.then == 1);
}

TEST_CASE("skeleton: a dropped request waits, but not while an exception unwinds (Note [Dropped requests])") {
  Calls dropped;
  { auto r = FakeOwner::start(dropped); }
  CHECK(dropped.waits == 1);
  CHECK(dropped.then == 1);
  CHECK(dropped.abandoned == 0);

  Calls unwound;
  try {
    auto r = FakeOwner::start(unwound);
    throw std::runtime_error("a peer failed");
  } catch (const std::runtime_error&) {
  }
  CHECK(unwound.waits == 0);
  CHECK(unwound.then == 0);
  CHECK(unwound.abandoned == 1);

  Calls moved;
  {
    auto a = FakeOwner::start(moved);
    FakeRequest b = std::move(a);  // a is no longer pending: only b waits
  }
  CHECK(moved.waits == 1);
}

}  // namespace skeleton_test
