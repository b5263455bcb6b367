// Checkpoint save and load: seconds, seconds training is blocked, bytes per rank, for
// DDP and ZeRO-3 with Adam, sharded training checkpoints (sync and async) and the
// whole-model file. The model is bench_zero's (`layers` x Linear(2048, 2048) + head):
// 4 layers are 16.8M parameters, 12 are 50.4M. Prints one JSON line per measurement on
// rank 0; benchmarks/checkpoint_vs_torch.sh runs it beside torch.save / torch.load.
//   scripts/mpirun.sh 2 build/benchmarks/bench_checkpoint <ddp|zero3> [layers 4] [dir]
#include <sys/resource.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "paratrain/checkpoint/checkpoint.hpp"
#include "paratrain/comm/mpi.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "paratrain/strategy/unit.hpp"
#include "wide_mlp.hpp"

namespace {

namespace fs = std::filesystem;
constexpr std::int64_t batch = 32;
using clock_type = std::chrono::steady_clock;

using Mlp = paratrain::bench::WideMlp;
constexpr std::int64_t width = paratrain::bench::wide_mlp_width;

double seconds_since(clock_type::time_point t) { return std::chrono::duration<double>(clock_type::now() - t).count(); }

template <class Update>
int run(std::string_view name, int layers, const fs::path& dir) {
  paratrain::comm::Mpi world;
  const int rank = world.rank();
  torch::manual_seed(1 + rank);
  const auto x = torch::randn({batch, width});
  const auto y = torch::randint(0, 10, {batch}, torch::kLong);
  using S = paratrain::DataParallel<Mlp, paratrain::comm::Mpi, Update>;
  S s(Mlp(layers), world, torch::optim::AdamOptions(1e-4));
  const auto loss = [](const torch::Tensor& o, const torch::Tensor& t) { return torch::nn::functional::cross_entropy(o, t); };
  const auto step = [&] { s.step({x, y}, loss); };
  step();  // the optimizer's state exists
  std::int64_t parameters = 0;
  for (const auto& p : s.model()->parameters()) parameters += p.numel();
  const auto barrier = [&] { MPI_Barrier(world.native()); };
  const auto max_over_ranks = [&](double v) {
    MPI_Allreduce(MPI_IN_PLACE, &v, 1, MPI_DOUBLE, MPI_MAX, world.native());
    return v;
  };
  const auto report = [&](const char* what, const char* mode, double seconds, double blocked, double bytes) {
    if (rank == 0)
      std::printf("{\"implementation\": \"paratrain\", \"strategy\": \"%s\", \"ranks\": %d, \"parameters\": %lld, "
                  "\"what\": \"%s\", \"mode\": \"%s\", \"seconds\": %.3f, \"blocked_seconds\": %.3f, "
                  "\"mib_per_rank\": %.1f}\n",
                  std::string(name).c_str(), world.size(), static_cast<long long>(parameters), what, mode, seconds,
                  blocked, bytes / double(1 << 20));
    std::fflush(stdout);
  };
  if (rank == 0) fs::remove_all(dir), fs::create_directories(dir);
  barrier();
  // One warm-up save, so that every measurement finds the page cache alike.
  paratrain::checkpoint::save(s, dir / "warm", 1);
  std::int64_t id = 2;
  for (int rep = 0; rep < 2; ++rep) {
    // Synchronous: training waits for the whole save.
    barrier();
    auto t = clock_type::now();
    paratrain::checkpoint::save(s, dir / "sync", id);
    const double sync = max_over_ranks(seconds_since(t));
    const auto path = paratrain::checkpoint::path_of(dir / "sync", id++);
    const double bytes = max_over_ranks(double(fs::file_size(path / ("rank-0000" + std::to_string(rank) + ".bin"))));
    if (rep == 1) report("sharded save", "sync", sync, sync, bytes);

    // Asynchronous: blocked while snapshotting and at each step's poll; training goes on.
    paratrain::checkpoint::Checkpointer<S> saver(s, {.directory = dir / "async", .async = true});
    barrier();
    t = clock_type::now();
    saver.save(id++);
    double blocked = seconds_since(t);
    int steps = 0;
    for (;;) {
      const auto p = clock_type::now();
      const bool published = saver.poll();
      blocked += seconds_since(p);
      if (published) break;
      step();
      ++steps;
    }
    const double total = max_over_ranks(seconds_since(t));
    blocked = max_over_ranks(blocked);
    if (rep == 1) report("sharded save", "async", total, blocked, bytes);

    barrier();
    t = clock_type::now();
    paratrain::checkpoint::load(s, path);
    const double load = max_over_ranks(seconds_since(t));
    if (rep == 1) report("sharded load", "sync", load, load, bytes);

    barrier();
    t = clock_type::now();
    paratrain::checkpoint::save_model(s, dir / "model.pt");
    const double save_model = max_over_ranks(seconds_since(t));
    const double model_bytes = rank == 0 ? double(fs::file_size(dir / "model.pt")) : 0.0;
    if (rep == 1) report("full save", "sync", save_model, save_model, max_over_ranks(model_bytes));
    barrier();
    t = clock_type::now();
    paratrain::checkpoint::load_model(s, dir / "model.pt");
    const double load_model = max_over_ranks(seconds_since(t));
    if (rep == 1) report("full load", "sync", load_model, load_model, max_over_ranks(model_bytes));
    if (rank == 0) fs::remove_all(dir / "sync"), fs::remove_all(dir / "async");
    barrier();
  }
  if (rank == 0) fs::remove_all(dir);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  paratrain::comm::Mpi::Environment env(argc, argv);
  torch::set_num_threads(1);
  const std::string_view strategy = argc > 1 ? argv[1] : "ddp";
  const int layers = argc > 2 ? std::atoi(argv[2]) : 4;
  const fs::path dir = argc > 3 ? argv[3] : "bench_checkpoint.tmp";
  using Adam = torch::optim::Adam;
  if (strategy == "ddp") return run<Adam>(strategy, layers, dir);
  if (strategy == "zero3") return run<paratrain::Sharded<Adam, paratrain::zero::stage3>>(strategy, layers, dir);
  std::fprintf(stderr, "usage: bench_checkpoint <ddp|zero3> [layers] [dir]\n");
  return 2;
}
