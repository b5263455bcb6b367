// The fixture of the observe.* ctest tests: a short fit on synthetic data with every
// observe output on, under mpirun. Usage: write_logs <dir> [epochs, default 2]
// Writes <dir>/tb (rank 0's events, rank<r>/ per rank), <dir>/trace.json,
// <dir>/metrics.jsonl, <dir>/metrics.csv; tests/observe/check_*.py read them, and
// scripts/plot.py draws docs/plots from a longer run (docs/observability.md).
#include <cstdlib>
#include <torch/torch.h>

#include <filesystem>
#include <iostream>
#include <string>

#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/fit/fit.hpp"
#include "paratrain/strategy/data_parallel.hpp"

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

paratrain::data::TensorDataset make_data(std::int64_t n, std::uint64_t seed) {
  torch::manual_seed(seed);
  auto x = torch::randn({n, 8});
  return {x, x.narrow(1, 0, 4).argmax(1)};
}

}  // namespace

int main(int argc, char** argv) try {
  // fit's deadline (Note [Ending before the time limit]) must not come from a Slurm job that
  // happens to run the tests; the tests that want one set SLURM_JOB_END_TIME themselves.
  ::unsetenv("SLURM_JOB_END_TIME");
  paratrain::comm::Mpi::Environment env(argc, argv);
  if (argc != 2 && argc != 3) {
    std::cerr << "usage: write_logs <dir> [epochs]\n";
    return 2;
  }
  const int epochs = argc == 3 ? std::stoi(argv[2]) : 2;
  const std::filesystem::path dir = argv[1];
  paratrain::comm::Mpi world;
  if (world.rank() == 0) std::filesystem::remove_all(dir);
  world.barrier();

  torch::manual_seed(1);
  // Small buckets: several all-reduces per step, overlapping backward.
  paratrain::DataParallel<Net, paratrain::comm::Mpi, torch::optim::Adam> s(
      Net(), world, torch::optim::AdamOptions(1e-2), {.bucket_cap_bytes = 1024, .first_bucket_cap_bytes = 512});
  const auto train = make_data(256, 1), test = make_data(64, 2);
  paratrain::fit(s, train,
                 {.epochs = epochs,
                  .batch_size = 16,
                  .eval = &test,
                  .log_every = 2,
                  .progress = false,
                  .on_step = [](const paratrain::StepInfo& i) { i.metrics->log("custom", 2.0 * i.epoch); },
                  .observe = {.tensorboard_dir = (dir / "tb").string(),
                              .tensorboard_per_rank = true,
                              .trace_file = (dir / "trace.json").string(),
                              .metrics_jsonl = (dir / "metrics.jsonl").string(),
                              .metrics_csv = (dir / "metrics.csv").string(),
                              .straggler_report = true}});
  return 0;
} catch (const std::exception& e) {
  std::cerr << e.what() << "\n";
  return 1;
}
