// comm::Nccl's operations on GPUs, against the formulas every communicator's tests share
// (support/collectives.hpp, the buffers on this rank's GPU): over the launch's processes
// where each has a GPU of its own, else a world of one in each process (gpu_suite::nccl_world).
// Part of the GPU suite, so that they need no MPI (a GPU machine with a pip-installed PyTorch
// has none) and run wherever scripts/gpu-check.sh runs; compiled everywhere with NCCL.
#include "paratrain/core/config.hpp"
#if PARATRAIN_HAS_NCCL
#include <torch/torch.h>

#include <cuda_runtime.h>

#include <vector>

#include "gpu/gpu_support.hpp"
#include "paratrain/comm/nccl/nccl.hpp"
#include "support/collectives.hpp"
#include "support/doctest.hpp"
#include "support/gpt_reference.hpp"

namespace nccl_gpu {

using paratrain::reduce_op;
namespace comm = paratrain::comm;

bool no_nccl_here() { return gpu_suite::skipped(!gpu_suite::gpu().is_cuda(), "NCCL needs a GPU"); }

TEST_CASE("[gpu] tensor parallelism over comm::Nccl at degree = its world equals the single-device model") {
  if (nccl_gpu::no_nccl_here()) return;
  auto world = gpu_suite::nccl_world();
  const bool sequence_parallel = world.size() > 1;
  CHECK(paratrain_test::gpt::tensor_parallel_against_reference(std::move(world), sequence_parallel) <= 1e-5);
}

}  // namespace nccl_gpu

TEST_CASE("[gpu] comm::Nccl: all_reduce, broadcast, reduce_scatter and all_gather equal the formulas") {
  if (nccl_gpu::no_nccl_here()) return;
  auto c = gpu_suite::nccl_world();
  collectives::check_all_reduce(c);
  collectives::check_broadcast(c);
  collectives::check_reduce_scatter(c);
  collectives::check_all_gather(c);
  collectives::check_ireduce_scatter(c);
  collectives::check_iall_gather(c);
  collectives::check_all_gather_in_place(c);
  collectives::check_pending_segments(c);
  collectives::check_requests(c);
  collectives::check_all_to_all(c);
  c.barrier();
}

TEST_CASE("[gpu] comm::Nccl: the raw-pointer forms reduce the same bytes") {
  if (nccl_gpu::no_nccl_here()) return;
  auto c = gpu_suite::nccl_world();
  const auto on = torch::TensorOptions().device(torch::kCUDA, c.device());
  for (auto dtype : collectives::all_dtypes) {
    CAPTURE(c10::toString(dtype));
    auto t = collectives::values(c.rank(), 1001, dtype).to(on.device());
    c.iall_reduce(t.data_ptr(), 1001, dtype, reduce_op::sum).wait();
    CHECK(collectives::same(t, collectives::expected(reduce_op::sum, c.size(), 1001, dtype)));
  }
}

TEST_CASE("[gpu] comm::Nccl: misuse throws paratrain::error before reaching NCCL") {
  if (nccl_gpu::no_nccl_here()) return;
  auto c = gpu_suite::nccl_world();
  collectives::check_misuse(c);
  collectives::check_reduce_scatter_padding(c);
  collectives::check_all_to_all_misuse(c);
  auto cpu = torch::ones({4});
  CHECK_THROWS_WITH_AS(c.all_reduce(cpu, reduce_op::sum), doctest::Contains("comm::Nccl takes CUDA tensors"),
                       paratrain::error);
  const auto on = torch::TensorOptions().device(torch::kCUDA, c.device());
  auto t = torch::ones({4}, on);
  CHECK_THROWS_WITH_AS(c.send(t, c.rank()), doctest::Contains("NCCL cannot send to itself"), paratrain::error);
  if (c.size() > 1)
    CHECK_THROWS_WITH_AS(c.send(t, (c.rank() + 1) % c.size(), -1), doctest::Contains("is negative"), paratrain::error);
  c.barrier();  // the ranks are still in step
}

TEST_CASE("[gpu] comm::Nccl: split groups ranks by colour, ordered by key") {
  if (nccl_gpu::no_nccl_here()) return;
  auto c = gpu_suite::nccl_world();
  collectives::check_split(c);
  // Reversed order within each colour: key -rank.
  const int colour = c.rank() % 2;
  auto half = c.split(colour, -c.rank());
  int higher = 0;
  for (int r = c.rank() + 1; r < c.size(); ++r) higher += r % 2 == colour ? 1 : 0;
  CHECK(half.rank() == higher);
}

TEST_CASE("[gpu] comm::Nccl: validation and the fingerprint name a collective that differs between ranks") {
  if (nccl_gpu::no_nccl_here()) return;
  comm::Nccl::Options checked;
  checked.validate = true;
  auto validated = gpu_suite::nccl_world(checked);
  collectives::check_validation(validated);
  auto fresh = gpu_suite::nccl_world();  // its fingerprint counts from the first collective
  collectives::check_fingerprint(fresh);
}

TEST_CASE("[gpu] comm::Nccl: sends and receives around a ring, one by one and as one group") {
  if (nccl_gpu::no_nccl_here() ||
      gpu_suite::skipped(!gpu_suite::nccl_across(), "a ring needs NCCL across processes, one GPU each"))
    return;
  auto c = gpu_suite::nccl_world();
  const int next = (c.rank() + 1) % c.size(), prev = (c.rank() + c.size() - 1) % c.size();
  const auto on = torch::TensorOptions().device(torch::kCUDA, c.device());
  for (auto dtype : collectives::all_dtypes) {
    CAPTURE(c10::toString(dtype));
    const auto mine = collectives::values(c.rank(), 1001, dtype).to(on.device());
    auto theirs = torch::zeros({1001}, on.dtype(dtype));
    // A send holds the stream until its peer's receive matches it (Note [NCCL point-to-point]):
    // even ranks send first, odd ranks receive first.
    if (c.rank() % 2 == 0) {
      c.send(mine, next, 1);
      c.recv(theirs, prev, 1);
    } else {
      c.recv(theirs, prev, 1);
      c.send(mine, next, 1);
    }
    CHECK(collectives::same(theirs, collectives::values(prev, 1001, dtype)));
    // Every rank sends first: only one group (iexchange) makes that safe.
    theirs.zero_();
    const std::vector<comm::Nccl::Message> sends{{mine, next, 3}}, recvs{{theirs, prev, 3}};
    c.iexchange(sends, recvs).wait();
    CHECK(collectives::same(theirs, collectives::values(prev, 1001, dtype)));
  }
}
#endif
