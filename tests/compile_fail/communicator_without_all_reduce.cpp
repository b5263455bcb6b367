// expect: paratrain: not a communicator: it needs `all_reduce\(at::Tensor&, paratrain::reduce_op\)`
// A type that misses one requirement is told which, in one line.
#include "paratrain/concepts/communicator.hpp"

struct NoAllReduce {
  int rank() const { return 0; }
  int size() const { return 1; }
  void broadcast(at::Tensor&, int) {}
  void barrier() {}
};

static_assert(paratrain::explain_communicator<NoAllReduce>());
