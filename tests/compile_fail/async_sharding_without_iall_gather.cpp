// expect: paratrain: this communicator cannot overlap sharding: it needs `iall_gather\(const at::Tensor& in, at::Tensor& out\)` returning a request; see docs/communicators\.md
// Overlapped sharding needs the non-blocking all-gather; the message names it and the page
// that says which communicators have it (a list in the message went stale when Gloo came).
#include "paratrain/concepts/communicator.hpp"

struct BlockingGather {
  struct Request {
    void wait() {}
    bool test() { return true; }
  };
  int rank() const { return 0; }
  int size() const { return 1; }
  void all_reduce(at::Tensor&, paratrain::reduce_op) {}
  void broadcast(at::Tensor&, int) {}
  void barrier() {}
  void reduce_scatter(const at::Tensor&, at::Tensor&, paratrain::reduce_op) {}
  void all_gather(const at::Tensor&, at::Tensor&) {}
  Request ireduce_scatter(const at::Tensor&, at::Tensor&, paratrain::reduce_op) { return {}; }
};

static_assert(paratrain::explain_async_sharding_communicator<BlockingGather>());
