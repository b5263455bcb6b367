// Collectives of comm::SingleDevice and comm::Mpi, checked against values computed
// locally from a formula (tests/support/collectives.hpp, shared with comm::Gloo's tests).
#include <torch/torch.h>

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/comm/rendezvous.hpp"
#include "paratrain/comm/single_device.hpp"
#include "paratrain/concepts/communicator.hpp"
#include "support/collectives.hpp"
#include "support/doctest.hpp"
#include "support/ports.hpp"
#include "support/shared_dir.hpp"

namespace comm = paratrain::comm;

TEST_CASE_TEMPLATE("all_reduce matches the formula for every dtype, op and size", C, comm::SingleDevice, comm::Mpi) {
  C c;
  collectives::check_all_reduce(c);
}

TEST_CASE_TEMPLATE("broadcast copies the root's tensor to every rank", C, comm::SingleDevice, comm::Mpi) {
  C c;
  collectives::check_broadcast(c);
}

TEST_CASE_TEMPLATE("reduce_scatter leaves each rank its reduced part", C, comm::SingleDevice, comm::Mpi) {
  C c;
  collectives::check_reduce_scatter(c);
}

TEST_CASE_TEMPLATE("all_gather concatenates the ranks' tensors in rank order", C, comm::SingleDevice, comm::Mpi) {
  C c;
  collectives::check_all_gather(c);
}

TEST_CASE_TEMPLATE("ireduce_scatter and reduce_scatter match the formula, segmented sizes included", C,
                   comm::SingleDevice, comm::Mpi) {
  C c;
  collectives::check_ireduce_scatter(c);
}

TEST_CASE_TEMPLATE("iall_gather and all_gather match the formula, segmented sizes included", C, comm::SingleDevice,
                   comm::Mpi) {
  C c;
  collectives::check_iall_gather(c);
}

TEST_CASE_TEMPLATE("all_gather in place: in is part rank() of out", C, comm::SingleDevice, comm::Mpi) {
  C c;
  collectives::check_all_gather_in_place(c);
}

// Tiny segments and a threshold of one element: every size but 0 and 1 is cut into many
// segments, the last one short, in every dtype.
TEST_CASE("comm::Mpi: reduce_scatter and all_gather cut into many uneven segments still match the formula") {
  for (int window : {1, 3}) {
    CAPTURE(window);
    comm::Mpi c({.reduce_scatter_segment_above_bytes = 8,
                  .all_gather_segment_above_bytes = 8,
                  .sharding_segment_bytes = 100,
                  .sharding_window = window});
    const std::vector<std::int64_t> parts = {0, 1, 2, 49, 333, 1001};
    collectives::check_ireduce_scatter(c, parts);
    collectives::check_iall_gather(c, parts);
    collectives::check_all_gather_in_place(c, parts);
  }
}

// Note [Segment order]: segments not yet started when the next collective is called
// must start before it, in the same order on every rank, however far test() got.
TEST_CASE("comm::Mpi: collectives called while segmented requests are pending keep their order on every rank") {
  comm::Mpi c(
      {.reduce_scatter_segment_above_bytes = 8, .all_gather_segment_above_bytes = 8, .sharding_segment_bytes = 64});
  collectives::check_pending_segments(c);
}

TEST_CASE_TEMPLATE("misuse throws paratrain::error naming the operation and the fix", C, comm::SingleDevice,
                   comm::Mpi) {
  C c;
  collectives::check_misuse(c);
}

TEST_CASE_TEMPLATE("all_to_all sends part i to rank i, in equal and uneven parts", C, comm::SingleDevice, comm::Mpi) {
  static_assert(paratrain::async_all_to_all_communicator<C> && paratrain::explain_all_to_all_communicator<C>());
  C c;
  collectives::check_all_to_all(c);
  collectives::check_all_to_all_misuse(c);
}

TEST_CASE("comm::Mpi: with validation, all_to_all counts the ranks disagree on throw on every rank, naming the pair") {
  comm::Mpi c({.validate = true});
  collectives::check_all_to_all_validation(c);
}

// comm::Mpi's non-blocking all-to-all is point-to-point messages on a communicator of its own
// (Note [Non-blocking all-to-all as messages]): two in flight at once, waited for in the
// other order, beside a message of the application's own with the tag they use, posted
// before them and sent after them; uneven parts of ~8 KB (past the eager limit) and empty
// ones. Each by the formula; a message that matched another's receive would show.
TEST_CASE("comm::Mpi: non-blocking all-to-alls in flight together, beside the application's own messages") {
  comm::Mpi c;
  const int n = c.size(), me = c.rank(), next = (me + 1) % n, prev = (me + n - 1) % n;
  using collectives::routed, collectives::routed_count;
  auto mine = torch::full({5}, 99.f), theirs = torch::full({5}, 7.f + static_cast<float>(me));
  auto user = c.irecv(mine, prev, 0);
  std::vector<torch::Tensor> a_in, a_want, b_in, b_want;
  std::vector<std::int64_t> in_counts, out_counts;
  for (int j = 0; j < n; ++j) {
    a_in.push_back(routed(me, j, 3, torch::kFloat));
    a_want.push_back(routed(j, me, 3, torch::kFloat));
    in_counts.push_back(routed_count(me, j, j == next ? 0 : 2000));
    out_counts.push_back(routed_count(j, me, me == (j + 1) % n ? 0 : 2000));
    b_in.push_back(routed(me, j, in_counts.back(), torch::kFloat));
    b_want.push_back(routed(j, me, out_counts.back(), torch::kFloat));
  }
  const auto a = torch::cat(a_in), b = torch::cat(b_in);
  auto a_out = torch::full({3 * n}, 99.f), b_out = torch::full({torch::cat(b_want).numel()}, 99.f);
  auto ra = c.iall_to_all(a, a_out);
  auto rb = c.iall_to_all(b, in_counts, b_out, out_counts);
  c.send(theirs, next, 0);
  rb.wait();
  ra.wait();
  user.wait();
  CHECK(collectives::same(a_out, torch::cat(a_want)));
  CHECK(collectives::same(b_out, torch::cat(b_want)));
  CHECK(collectives::same(mine, torch::full({5}, 7.f + static_cast<float>(prev))));
}

// Without validation, a rank that sends more than its peer expects: the peer's wait names it
// (comm::Mpi reads the truncation from the receive); at one rank, sending itself more than it
// expects is refused before anything is copied. The ranks stay in step.
TEST_CASE("comm::Mpi: a non-blocking all-to-all that sends a rank more than it expects names the sender") {
  comm::Mpi c;
  const int n = c.size(), me = c.rank(), last = n - 1;
  std::vector<std::int64_t> in_counts(static_cast<std::size_t>(n), 1), out_counts = in_counts;
  if (me == last) in_counts[0] = 2;  // rank 0 expects 1
  auto in = torch::ones({me == last ? n + 1 : n}), out = torch::empty({n});
  if (n == 1) {
    CHECK_THROWS_WITH_AS(c.iall_to_all(in, in_counts, out, out_counts),
                         doctest::Contains("this rank sends itself 2 elements (in_counts[0]) but expects 1"),
                         paratrain::error);
  } else if (me == 0) {
    auto r = c.iall_to_all(in, in_counts, out, out_counts);
    CHECK_THROWS_WITH_AS(r.wait(),
                         doctest::Contains(("rank " + std::to_string(last) +
                                            " sent this rank more elements than it expects from it (MPI: message "
                                            "truncated)")
                                               .c_str()),
                         paratrain::error);
  } else {
    c.iall_to_all(in, in_counts, out, out_counts).wait();
  }
  auto agreed = torch::empty({n});
  c.all_to_all(torch::ones({n}), agreed);
  CHECK(collectives::same(agreed, torch::ones({n})));
}

// More requests than comm::Mpi's handles hold inline (an all-to-all over six ranks and more):
// the rest in a vector, waited for and tested in the order they were made. Ranks 0 and 1
// exchange (any other rank with itself): sends first, held inline; then the receives, in the
// vector, for messages that rank 1 sends 0.2 s late. The handles are moved before the wait.
TEST_CASE("comm::Mpi: a request of more MPI requests than its handles hold inline completes them all") {
  comm::Mpi c;
  const int me = c.rank(), peer = (me ^ 1) < c.size() ? me ^ 1 : me;
  constexpr int messages = paratrain::detail::MpiHandles::inline_requests;  // and as many receives
  for (const bool by_test : {false, true}) {
    CAPTURE(by_test);
    std::vector<int> sent(messages), received(messages, -1), want(messages);
    paratrain::detail::MpiHandles h;
    if (me == 1) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    for (int i = 0; i < messages; ++i) {
      sent[static_cast<std::size_t>(i)] = 100 * me + i;
      want[static_cast<std::size_t>(i)] = 100 * peer + i;
      MPI_Isend(&sent[static_cast<std::size_t>(i)], 1, MPI_INT, peer, 40 + i, c.native(), h.add());
    }
    for (int i = 0; i < messages; ++i)
      MPI_Irecv(&received[static_cast<std::size_t>(i)], 1, MPI_INT, peer, 40 + i, c.native(), h.add());
    auto moved = std::move(h);  // as a request returned by value is
    CHECK_FALSE(h.pending());
    CHECK(moved.pending());
    if (by_test) {
      while (!moved.test("test", me)) {
      }
    } else {
      moved.wait("wait", me);
    }
    CHECK_FALSE(moved.pending());
    CHECK(received == want);
    c.barrier();
  }
}

TEST_CASE("comm::Mpi: reduce_scatter of a size that does not divide says how to pad") {
  comm::Mpi c;
  collectives::check_reduce_scatter_padding(c);
}

TEST_CASE("comm::Mpi: send and recv pass tensors around a ring") {
  comm::Mpi c;
  collectives::check_ring(c);
}

TEST_CASE("comm::Mpi: a message of the wrong length is an error on the receiver, and the sender completes") {
  comm::Mpi c;
  collectives::check_wrong_length(c);
}

TEST_CASE("comm::Mpi: split groups ranks by colour") {
  comm::Mpi c;
  collectives::check_split(c);
}

TEST_CASE("comm::Mpi: non-blocking requests complete through test() and through their destructor") {
  comm::Mpi c;
  collectives::check_requests(c);
}

TEST_CASE("comm::Mpi: with validation, mismatched collectives throw on every rank instead of hanging") {
  comm::Mpi c({.validate = true});
  collectives::check_validation(c);
}

TEST_CASE("comm::Mpi: the collective fingerprint names the first collective the ranks issued differently") {
  comm::Mpi c;  // a fresh duplicate: its count starts at 0
  collectives::check_fingerprint(c);
}

// The watchdog runs one thread per process, however many operations are watched.
TEST_CASE("comm::Mpi: watched operations do not add threads") {
  const auto threads = [] {
    std::ifstream status("/proc/self/status");
    for (std::string line; std::getline(status, line);)
      if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
    return -1;
  };
  comm::Mpi c;
  auto t = torch::ones({4});
  c.all_reduce(t, paratrain::reduce_op::sum);  // the watchdog's thread has started
  const int before = threads();
  for (int i = 0; i < 200; ++i) {
    c.all_reduce(t, paratrain::reduce_op::sum);
    c.iall_reduce(t, paratrain::reduce_op::sum).wait();
  }
  CHECK(threads() == before);
}

TEST_CASE("comm::Mpi: duplicate() is an independent communicator over the same ranks") {
  comm::Mpi c;
  auto d = c.duplicate();
  CHECK(d.size() == c.size());
  CHECK(d.rank() == c.rank());
  CHECK(d.native() != c.native());
}

TEST_CASE("comm::SingleDevice has no peers") {
  comm::SingleDevice c;
  auto t = torch::ones({2});
  CHECK_THROWS_WITH_AS(c.send(t, 1), doctest::Contains("use comm::Mpi"), paratrain::error);
  CHECK_THROWS_AS(c.recv(t, 0), paratrain::error);
}

TEST_CASE("comm::Mpi: a world of one under WORLD_SIZE > 1 says how to launch instead of training alone") {
  if (comm::Mpi().size() != 1) return;  // under mpirun -n 2+, MPI's world is right
  const char* before = std::getenv("WORLD_SIZE");
  const std::string saved = before ? before : "";
  setenv("WORLD_SIZE", "2", 1);
  CHECK_THROWS_WITH_AS(comm::Mpi(), doctest::Contains("mpirun -n 2"), paratrain::error);
  if (before) setenv("WORLD_SIZE", saved.c_str(), 1);
  else unsetenv("WORLD_SIZE");
}

// ---- comm::Rendezvous: ranks meeting without MPI (MPI only starts them and checks) -------

namespace {

// What every rank of `meeting` says, checked against what each rank was given.
void check_meeting(comm::Rendezvous& meeting, const comm::Mpi& mpi) {
  CHECK(meeting.rank() == mpi.rank());
  CHECK(meeting.size() == mpi.size());
  const auto all = meeting.all_gather("test", "rank " + std::to_string(mpi.rank()));
  REQUIRE(all.size() == static_cast<std::size_t>(mpi.size()));
  for (int r = 0; r < mpi.size(); ++r) CHECK(all[static_cast<std::size_t>(r)] == "rank " + std::to_string(r));
  const int root = mpi.size() - 1;
  CHECK(meeting.broadcast("test", mpi.rank() == root ? std::string("from the last\0rank", 18) : "", root) ==
        std::string("from the last\0rank", 18));
  // A second agreement over the same store uses fresh keys: no stale value is read.
  CHECK(meeting.broadcast("test", mpi.rank() == 0 ? "second" : "", 0) == "second");
}

}  // namespace

TEST_CASE("comm::Rendezvous: ranks meet in a file and agree values through it") {
  comm::Mpi mpi;
  const auto dir = paratrain_test::shared_dir(mpi, "rendezvous");
  {
    comm::Rendezvous meeting({.rank = mpi.rank(),
                              .world_size = mpi.size(),
                              .local_rank = 0,
                              .master_addr = "",
                              .file = (dir / "store").string()});
    CHECK(meeting.where() == "file " + (dir / "store").string());
    CHECK(meeting.port() == 0);
    check_meeting(meeting, mpi);
  }  // the store closed: its file goes with the directory
  paratrain_test::remove_shared_dir(mpi, dir);
}

TEST_CASE("comm::Rendezvous: ranks meet at MASTER_ADDR:MASTER_PORT through rank 0's TCPStore") {
  comm::Mpi mpi;
  auto port = torch::full({1}, mpi.rank() == 0 ? paratrain_test::free_port() : 0, torch::kLong);
  mpi.all_reduce(port, paratrain::reduce_op::sum);
  comm::Rendezvous meeting({.rank = mpi.rank(),
                            .world_size = mpi.size(),
                            .local_rank = 0,
                            .master_addr = "127.0.0.1",
                            .master_port = static_cast<int>(port.item<std::int64_t>()),
                            .file = ""});
  CHECK(meeting.where() == (mpi.size() == 1 ? "" : "127.0.0.1:" + std::to_string(port.item<std::int64_t>())));
  check_meeting(meeting, mpi);
}

TEST_CASE("comm::Rendezvous: a meeting that cannot happen says which variable to fix") {
  using Options = comm::Rendezvous::Options;
  CHECK_THROWS_WITH_AS(comm::Rendezvous(Options{.rank = 2, .world_size = 2, .local_rank = 0}),
                       doctest::Contains("rank 2 is not in a world of 2"), paratrain::error);
  CHECK_THROWS_WITH_AS(
      comm::Rendezvous(Options{.rank = 0, .world_size = 2, .local_rank = 0, .master_addr = "", .file = ""}),
      doctest::Contains("neither MASTER_ADDR nor Options::master_addr is set"), paratrain::error);
  CHECK_THROWS_WITH_AS(comm::Rendezvous(Options{.rank = 0,
                                                .world_size = 2,
                                                .local_rank = 0,
                                                .master_addr = "127.0.0.1",
                                                .master_port = 0,
                                                .file = ""}),
                       doctest::Contains("Options::master_port=0 is not a port number"), paratrain::error);
  // A file meeting whose other rank never comes: the timeout, named, instead of a hang.
  const auto lonely = std::filesystem::temp_directory_path() / ("paratrain-lonely-" + std::to_string(::getpid()));
  std::filesystem::remove(lonely);
  CHECK_THROWS_WITH_AS(comm::Rendezvous(Options{.rank = 0,
                                                .world_size = 2,
                                                .local_rank = 0,
                                                .file = lonely.string(),
                                                .timeout = std::chrono::milliseconds(300)}),
                       doctest::Contains(("rendezvous at file " + lonely.string() + " of 2 ranks failed").c_str()),
                       paratrain::error);
  std::filesystem::remove(lonely);
}

TEST_CASE("comm::Mpi: a pending all-gather completes while its caller makes no MPI call (Note [Progress thread])") {
  // 1 MiB a rank, far above Open MPI's eager limit (4 KiB on shared memory): its messages move,
  // and the request is marked complete, only when some MPI call of each process runs the
  // progress engine. The caller makes none: it waits until the progress thread has called into
  // MPI 2,000 times (a count, not a clock), and then the first test() must find the gather done.
  // Without single-copy transfers the message goes in 32 KiB fragments, a few per call on each
  // side: 32 fragments need far fewer calls than 2,000 (16 MiB, 512 fragments, against 500
  // calls failed here under a CPU hog and in CI's sanitizer run). With progress = 0 (the
  // default) there is no thread: the count never grows and the case fails at its deadline
  // (seen failing so at 2 ranks; with the half-second sleep this replaced, the one test()
  // found the gather not done).
  comm::Mpi::Options options;
  options.progress = std::chrono::microseconds(200);
  comm::Mpi mpi(options);
  if (mpi.size() == 1) return;
  const std::int64_t n = std::int64_t{256} << 10;
  const auto mine = torch::full({n}, static_cast<float>(mpi.rank()));
  auto all = torch::empty({n * mpi.size()});
  mpi.barrier();
  const auto& progress = paratrain::detail::MpiProgress::instance();
  const auto before = progress.calls();
  auto r = mpi.iall_gather(mine, all);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (progress.calls() < before + 2000 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));  // the pace of the look, not what it waits for
  REQUIRE(progress.calls() >= before + 2000);  // the thread ran: 2,000 calls into MPI
  CHECK(r.test());
  r.wait();
  for (int k = 0; k < mpi.size(); ++k) CHECK(all.narrow(0, k * n, n).eq(k).all().item<bool>());
}
