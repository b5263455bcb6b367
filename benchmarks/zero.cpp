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
  paratrain::bench::ZeroRun run;
  CLI::App app("bench_zero: DDP and ZeRO 1-3 on a wide MLP over MPI: steps/s, memory, bytes sent");
  run.add_to(app);
  if (const auto status = paratrain::bench::parse(app, argc, argv)) return *status;
  paratrain::comm::Mpi world;
  const auto ranks = paratrain::bench::ranks_of(world.native());
  const bool known = paratrain::bench::with_zero_stage(run.strategy, [&]<class Update>(paratrain::plan::stage stage) {
    paratrain::bench::run_zero<Update>(world, torch::kCPU, ranks, run, stage, "mpi", [] { return std::string(); });
  });
  return known ? 0 : 2;  // --strategy is checked: always known
}
