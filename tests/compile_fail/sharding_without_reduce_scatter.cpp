// expect: paratrain: this communicator cannot shard: it needs `reduce_scatter
// Sharding needs reduce_scatter; the message names it and the communicators that have it.
#include "paratrain/concepts/communicator.hpp"

struct OnlyReduces {
  int rank() const { return 0; }
  int size() const { return 1; }
  void all_reduce(at::Tensor&, paratrain::reduce_op) {}
  void broadcast(at::Tensor&, int) {}
  void barrier() {}
};

static_assert(paratrain::explain_sharding_communicator<OnlyReduces>());
