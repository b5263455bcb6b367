// expect: paratrain: this communicator cannot shard: it needs `reduce_scatter\(const at::Tensor& in, at::Tensor& out, paratrain::reduce_op\)`; see docs/communicators\.md
// Sharding needs reduce_scatter; the message names it and the page that says who has it.
#include "paratrain/concepts/communicator.hpp"

struct OnlyReduces {
  int rank() const { return 0; }
  int size() const { return 1; }
  void all_reduce(at::Tensor&, paratrain::reduce_op) {}
  void broadcast(at::Tensor&, int) {}
  void barrier() {}
};

static_assert(paratrain::explain_sharding_communicator<OnlyReduces>());
