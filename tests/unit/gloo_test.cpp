// comm::Gloo on ranks started without MPI (tests/launch/torchrun_style.sh): the formula-based
// checks every communicator passes (tests/support/collectives.hpp, as comm_test.cpp runs them
// for comm::Mpi), what is particular to Gloo (rendezvous, emulated operations, timeouts), and
// DataParallel over Gloo against single-device training.
#include <unistd.h>
#include <torch/torch.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "paratrain/comm/gloo/gloo.hpp"
#include "paratrain/concepts/communicator.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "support/collectives.hpp"
#include "support/doctest.hpp"
#include "support/ports.hpp"
#include "support/equivalence.hpp"
#include "support/gloo_world.hpp"
#include "support/gpt_reference.hpp"
#include "support/pipeline_equivalence.hpp"

namespace comm = paratrain::comm;
using paratrain::reduce_op;

static_assert(paratrain::communicator<comm::Gloo>);
static_assert(paratrain::sharding_communicator<comm::Gloo>);
static_assert(paratrain::point_to_point_communicator<comm::Gloo>);
static_assert(paratrain::async_communicator<comm::Gloo>);
static_assert(paratrain::explain_sharding_communicator<comm::Gloo>());
static_assert(paratrain::async_sharding_communicator<comm::Gloo>);
static_assert(paratrain::explain_async_sharding_communicator<comm::Gloo>());

// ---- what every communicator does ---------------------------------------------------

TEST_CASE("comm::Gloo: all_reduce matches the formula for every dtype, op and size") {
  collectives::check_all_reduce(gloo_world());
}

TEST_CASE("comm::Gloo: broadcast copies the root's tensor to every rank") { collectives::check_broadcast(gloo_world()); }

TEST_CASE("comm::Gloo: reduce_scatter leaves each rank its reduced part") {
  collectives::check_reduce_scatter(gloo_world());
}

TEST_CASE("comm::Gloo: all_gather concatenates the ranks' tensors in rank order") {
  collectives::check_all_gather(gloo_world());
}

TEST_CASE("comm::Gloo: non-blocking reduce_scatter and all_gather (ZeRO's), in place too, match the formulas") {
  collectives::check_ireduce_scatter(gloo_world());
  collectives::check_iall_gather(gloo_world());
  collectives::check_all_gather_in_place(gloo_world());
}

TEST_CASE("comm::Gloo: misuse throws paratrain::error naming the operation and the fix") {
  collectives::check_misuse(gloo_world());
}

TEST_CASE("comm::Gloo: reduce_scatter of a size that does not divide says how to pad") {
  collectives::check_reduce_scatter_padding(gloo_world());
}

TEST_CASE("comm::Gloo: send and recv pass tensors around a ring") {
  if (gloo_world().size() == 1) return;  // Gloo cannot send to itself
  collectives::check_ring(gloo_world());
}

TEST_CASE("comm::Gloo: a message of the wrong length is an error on the receiver, and the sender completes") {
  if (gloo_world().size() == 1) return;
  collectives::check_wrong_length(gloo_world());
}

TEST_CASE("comm::Gloo: split groups ranks by colour") { collectives::check_split(gloo_world()); }

TEST_CASE("comm::Gloo: non-blocking requests complete through test() and through their destructor") {
  collectives::check_requests(gloo_world());
}

TEST_CASE("comm::Gloo: with validation, mismatched collectives throw on every rank instead of hanging") {
  auto c = gloo_world().duplicate({.validate = true});
  CHECK(c.options().validate);
  collectives::check_validation(c);
}

TEST_CASE("comm::Gloo: all_to_all sends part i to rank i, in equal and uneven parts; misuse and counts the ranks "
          "disagree on throw on every rank") {
  static_assert(paratrain::async_all_to_all_communicator<paratrain::comm::Gloo>);
  collectives::check_all_to_all(gloo_world());
  collectives::check_all_to_all_misuse(gloo_world());
  auto c = gloo_world().duplicate({.validate = true});
  collectives::check_all_to_all_validation(c);
}

TEST_CASE("comm::Gloo: the collective fingerprint names the first collective the ranks issued differently") {
  auto c = gloo_world().duplicate();  // a fresh group: its count starts at 0
  collectives::check_fingerprint(c);
}

// ---- what is particular to Gloo -----------------------------------------------------

TEST_CASE("comm::Gloo: the group follows the launcher's variables") {
  const auto where = paratrain::detect_placement();
  CHECK(gloo_world().rank() == where.rank);
  CHECK(gloo_world().size() == where.world_size);
}

TEST_CASE("comm::Gloo: duplicate() is an independent group over the same ranks") {
  auto& world = gloo_world();
  auto d = world.duplicate();
  CHECK(d.size() == world.size());
  CHECK(d.rank() == world.rank());
  CHECK(&d.native() != &world.native());
  // Interleaved operations on the two groups do not mix.
  auto a = torch::full({100}, 1.0), b = torch::full({100}, 2.0);
  auto ra = world.iall_reduce(a, reduce_op::sum);
  auto rb = d.iall_reduce(b, reduce_op::sum);
  rb.wait();
  ra.wait();
  CHECK(torch::equal(a, torch::full({100}, 1.0 * world.size())));
  CHECK(torch::equal(b, torch::full({100}, 2.0 * world.size())));
}

TEST_CASE("comm::Gloo: point-to-point arguments are checked") {
  auto& c = gloo_world();
  auto t = torch::ones({2});
  CHECK_THROWS_WITH_AS(c.send(t, c.rank()), doctest::Contains("cannot send to itself"), paratrain::error);
  CHECK_THROWS_WITH_AS(c.recv(t, c.size()), doctest::Contains("is not in this communicator"), paratrain::error);
  if (c.size() > 1)
    CHECK_THROWS_WITH_AS(c.send(t, (c.rank() + 1) % c.size(), -1), doctest::Contains("tag -1 is negative"),
                         paratrain::error);
}

// Run by ctest's fault.gloo.unanswered_recv (tests/fault/inject.sh), which checks that the
// watchdog ends the job after rank 0's 1 s timeout, naming the receive and what rank 1 does.
TEST_CASE("comm::Gloo: a receive nobody answers (the watchdog's test)" * doctest::skip()) {
  auto& world = gloo_world();
  auto quick = world.duplicate({.timeout = std::chrono::seconds(1)});
  if (world.rank() == 0) {
    auto t = torch::empty({4});
    quick.recv(t, 1, /*tag=*/99);
  } else {
    std::this_thread::sleep_for(std::chrono::seconds(30));  // busy elsewhere; ended by the watchdog's exit
  }
  FAIL("the watchdog did not end the job");
}

TEST_CASE("comm::Gloo: a world of one needs no rendezvous") {
  comm::Gloo one({.rank = 0, .world_size = 1, .master_addr = ""});
  CHECK(one.rank() == 0);
  CHECK(one.size() == 1);
  auto t = torch::arange(5, torch::kFloat);
  one.all_reduce(t, reduce_op::average);
  CHECK(torch::equal(t, torch::arange(5, torch::kFloat)));
  collectives::check_misuse(one);
}

TEST_CASE("comm::Gloo: a group that cannot meet says which variable to fix") {
  CHECK_THROWS_WITH_AS(comm::Gloo({.rank = 2, .world_size = 2}), doctest::Contains("rank 2 is not in a world of 2"),
                       paratrain::error);
  CHECK_THROWS_WITH_AS(comm::Gloo({.rank = 0, .world_size = 2, .master_addr = ""}),
                       doctest::Contains("neither MASTER_ADDR nor Options::master_addr is set"), paratrain::error);
  CHECK_THROWS_WITH_AS(comm::Gloo({.rank = 0, .world_size = 2, .master_addr = "127.0.0.1", .master_port = 70000}),
                       doctest::Contains("Options::master_port=70000 is not a port number"), paratrain::error);

  // A port that is bound here but never listened on: connecting is refused until the timeout.
  const auto [fd, port] = paratrain_test::bind_loopback_port();
  CHECK_THROWS_WITH_AS(comm::Gloo({.rank = 1,
                                   .world_size = 2,
                                   .master_addr = "127.0.0.1",
                                   .master_port = port,
                                   .timeout = std::chrono::seconds(1)}),
                       doctest::Contains(("rendezvous at 127.0.0.1:" + std::to_string(port)).c_str()),
                       paratrain::error);
  ::close(fd);
}

// ---- DataParallel over Gloo equals single-device training ------------------------------
// The harness of data_parallel_test.cpp (support/equivalence.hpp): each rank's replica starts from its own
// initialisation (so the broadcast from rank 0 is checked too), the reference is plain
// LibTorch on the concatenation of the ranks' batches, starting from rank 0's.

namespace {

void check_data_parallel(paratrain::DataParallelOptions options) {
  using namespace paratrain_test;
  auto& world = gloo_world();
  const Scenario scenario{.steps = 8, .options = options};
  const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
  const auto want = reference<torch::optim::SGD>(scenario, world.size(), sgd);
  const auto got = distributed<comm::Gloo, torch::optim::SGD>(scenario, world, sgd);
  CHECK(max_relative_difference(got, want) <= 1e-5);
}

}  // namespace

TEST_CASE("comm::Gloo: ZeRO stages 2 and 3 with SGD equal single-device training, batches differing per rank") {
  using namespace paratrain_test;
  auto& world = gloo_world();
  const Scenario scenario{.steps = 8, .varied_batch = true, .options = {.bucket_cap_bytes = 1, .first_bucket_cap_bytes = 1}};
  const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
  const auto want = reference<torch::optim::SGD>(scenario, world.size(), sgd);
  using paratrain::Sharded;
  namespace zero = paratrain::zero;
  CHECK(max_relative_difference(distributed<comm::Gloo, Sharded<torch::optim::SGD, zero::stage2>>(scenario, world, sgd),
                                want) <= 1e-5);
  CHECK(max_relative_difference(distributed<comm::Gloo, Sharded<torch::optim::SGD, zero::stage3>>(scenario, world, sgd),
                                want) <= 1e-5);
}

TEST_CASE("comm::Gloo: DataParallel equals single-device training on the union of the ranks' batches") {
  SUBCASE("one bucket") { check_data_parallel({}); }
  SUBCASE("one parameter per bucket: several all-reduces in flight") {
    check_data_parallel({.bucket_cap_bytes = 1, .first_bucket_cap_bytes = 1});
  }
}

TEST_CASE("comm::Gloo: a pipeline (1F1B, ZB-H1; 2-D at 4 ranks) equals single-device training") {
  using namespace paratrain_test::pipe;
  const int world = gloo_world().size();
  if (world % 2 != 0) return;
  for (const auto kind : {paratrain::pipeline::Kind::one_f_one_b, paratrain::pipeline::Kind::zero_bubble_h1})
    for (int micro : {1, 4}) check_pipeline<comm::Gloo, torch::optim::SGD, ChainOf<2>>(gloo_world().duplicate(), {.schedule = kind}, micro,
                                                                10);
}

// ---- tensor parallelism over Gloo (issue #38) --------------------------------------------

TEST_CASE("comm::Gloo: tensor parallelism at degree = world (sequence-parallel, dropout on) equals the single-device model") {
  CHECK(paratrain_test::gpt::tensor_parallel_against_reference(gloo_world(), /*sequence_parallel=*/true) <= 1e-5);
}
