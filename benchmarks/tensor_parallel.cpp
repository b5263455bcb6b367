// Tensor parallelism beside PyTorch's (DTensor's parallelize_module with ColwiseParallel and
// RowwiseParallel), over MPI on the CPU: tensor_parallel.hpp's stack and measurement.
// benchmarks/tensor_parallel_vs_dtensor.sh runs it beside the Python side.
//   scripts/mpirun.sh 2 build-bench/benchmarks/bench_tensor_parallel --steps 20 --warmup 5
#include "paratrain/comm/mpi/mpi.hpp"
#include "tensor_parallel.hpp"

int main(int argc, char** argv) {
  paratrain::bench::tensor_parallel::Run run;
  CLI::App app("paratrain's tensor parallelism on a stack of GPT blocks, beside DTensor's");
  run.add_to(app);
  paratrain::comm::Mpi world;
  if (auto status = paratrain::bench::parse(app, argc, argv)) return *status;
  return paratrain::bench::tensor_parallel::measure(world, torch::kCPU, run, "mpi");
}
