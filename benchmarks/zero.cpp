// DataParallel at every ZeRO stage over MPI, one configuration per process (so that its
// peak RSS is its own): step rate, peak RSS, what the strategy holds and what
// paratrain::plan predicts for it (zero.hpp). benchmarks/zero_vs_torch.sh runs it beside
// PyTorch's DDP and ZeroRedundancyOptimizer; one intra-op thread per rank.
//   scripts/mpirun.sh 2 build/benchmarks/bench_zero <ddp|zero1|zero2|zero3> [layers 4] [steps 30]
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "driver.hpp"
#include "paratrain/comm/mpi/mpi.hpp"
#include "zero.hpp"

int main(int argc, char** argv) {
  paratrain::comm::Mpi::Environment env(argc, argv);
  torch::set_num_threads(1);
  const paratrain::bench::ZeroRun run{.strategy = argc > 1 ? argv[1] : "ddp",
                                      .layers = argc > 2 ? std::atoi(argv[2]) : 4,
                                      .steps = argc > 3 ? std::atoi(argv[3]) : 30,
                                      .warmup = argc > 4 ? std::atoi(argv[4]) : 3,
                                      .bf16 = argc > 5 && std::string_view(argv[5]) == "bf16"};
  paratrain::comm::Mpi world;
  const auto ranks = paratrain::bench::ranks_of(world.native());
  const bool known = paratrain::bench::with_zero_stage(run.strategy, [&]<class Update>(paratrain::plan::stage stage) {
    paratrain::bench::run_zero<Update>(world, torch::kCPU, ranks, run, stage, "mpi", [] { return std::string(); });
  });
  if (known) return 0;
  std::fprintf(stderr, "usage: bench_zero <ddp|zero1|zero2|zero3> [layers] [steps] [warmup] [bf16]\n");
  return 2;
}
