// Static tests: the concepts accept what they should and reject what they should.
// This file has no run-time content; it passes by compiling.
#include <ATen/core/Tensor.h>

#include "paratrain/comm/mpi.hpp"
#include "paratrain/comm/single_device.hpp"
#include "paratrain/concepts/communicator.hpp"

namespace {

using paratrain::reduce_op;
namespace comm = paratrain::comm;

// The shipped communicators model every refinement.
static_assert(paratrain::communicator<comm::SingleDevice>);
static_assert(paratrain::sharding_communicator<comm::SingleDevice>);
static_assert(paratrain::point_to_point_communicator<comm::SingleDevice>);
static_assert(paratrain::async_communicator<comm::SingleDevice>);
static_assert(paratrain::communicator<comm::Mpi>);
static_assert(paratrain::sharding_communicator<comm::Mpi>);
static_assert(paratrain::point_to_point_communicator<comm::Mpi>);
static_assert(paratrain::async_communicator<comm::Mpi>);
static_assert(paratrain::request<comm::Mpi::Request>);
static_assert(paratrain::explain_sharding_communicator<comm::Mpi>());

// Things that are not communicators.
static_assert(!paratrain::communicator<int>);
static_assert(!paratrain::communicator<at::Tensor>);

struct OnlyReduces {
  int rank() const { return 0; }
  int size() const { return 1; }
  void all_reduce(at::Tensor&, reduce_op) {}
  void broadcast(at::Tensor&, int) {}
  void barrier() {}
};
static_assert(paratrain::communicator<OnlyReduces>);
static_assert(!paratrain::sharding_communicator<OnlyReduces>);
static_assert(!paratrain::point_to_point_communicator<OnlyReduces>);
static_assert(!paratrain::async_communicator<OnlyReduces>);

struct RankIsLong : OnlyReduces {
  long rank() const { return 0; }
};
static_assert(!paratrain::communicator<RankIsLong>);

struct NotMovable : OnlyReduces {
  NotMovable() = default;
  NotMovable(NotMovable&&) = delete;
};
static_assert(!paratrain::communicator<NotMovable>);

}  // namespace
