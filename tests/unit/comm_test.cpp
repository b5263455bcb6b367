// Collectives of comm::SingleDevice and comm::Mpi, checked against values computed
// locally from a formula (tests/support/collectives.hpp, shared with comm::Gloo's tests).
#include <torch/torch.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/comm/single_device.hpp"
#include "paratrain/concepts/communicator.hpp"
#include "support/collectives.hpp"
#include "support/doctest.hpp"

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
