// Checkpoint save and load: seconds, seconds training is blocked, bytes per rank, for
// DDP and ZeRO-3 with Adam, sharded training checkpoints (sync and async) and the
// whole-model file. The model is bench_zero's (`layers` x Linear(2048, 2048) + head):
// 4 layers are 16.8M parameters, 12 are 50.4M. Prints one JSON line per measurement on
// rank 0; benchmarks/checkpoint_vs_torch.sh runs it beside torch.save / torch.load.
//   scripts/mpirun.sh 2 build/benchmarks/bench_checkpoint <ddp|zero3> [layers 4] [dir]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "cli.hpp"
#include "driver.hpp"
#include "paratrain/checkpoint/checkpoint.hpp"
#include "paratrain/comm/mpi/mpi.hpp"
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
  const auto slowest = [&](double v) { return paratrain::bench::max_over_ranks(world.native(), v); };
  // The best of two repetitions of each, as checkpoint_vs_torch.py takes PyTorch's.
  struct Best {
    double seconds = 1e300, blocked = 1e300;
    void add(double s, double b) { seconds = std::min(seconds, s), blocked = std::min(blocked, b); }
  } sync_save, async_save, sharded_load, full_save, full_load;
  const auto report = [&](const char* what, const char* mode, const Best& best, double bytes) {
    if (rank == 0)
      std::printf("{\"implementation\": \"paratrain\", \"strategy\": \"%s\", \"ranks\": %d, \"parameters\": %lld, "
                  "\"what\": \"%s\", \"mode\": \"%s\", \"seconds\": %.3f, \"blocked_seconds\": %.3f, "
                  "\"mib_per_rank\": %.1f}\n",
                  std::string(name).c_str(), world.size(), static_cast<long long>(parameters), what, mode,
                  best.seconds, best.blocked, bytes / double(1 << 20));
    std::fflush(stdout);
  };
  if (rank == 0) fs::remove_all(dir), fs::create_directories(dir);
  barrier();
  // One warm-up save, so that every measurement finds the page cache alike.
  paratrain::checkpoint::save(s, dir / "warm", 1);
  double bytes = 0, model_bytes = 0;
  std::int64_t id = 2;
  for (int rep = 0; rep < 2; ++rep) {
    // Synchronous: training waits for the whole save.
    barrier();
    auto t = clock_type::now();
    paratrain::checkpoint::save(s, dir / "sync", id);
    const double sync = slowest(seconds_since(t));
    sync_save.add(sync, sync);
    const auto path = paratrain::checkpoint::path_of(dir / "sync", id++);
    bytes = slowest(double(fs::file_size(path / paratrain::checkpoint::detail::rank_data_name(rank))));

    // Asynchronous: blocked while snapshotting and at each step's poll; training goes on.
    paratrain::checkpoint::Checkpointer<S> saver(s, {.directory = dir / "async", .async = true});
    barrier();
    t = clock_type::now();
    saver.save(id++);
    double blocked = seconds_since(t);
    for (;;) {
      const auto p = clock_type::now();
      const bool published = saver.poll();
      blocked += seconds_since(p);
      if (published) break;
      step();
    }
    async_save.add(slowest(seconds_since(t)), slowest(blocked));

    barrier();
    t = clock_type::now();
    paratrain::checkpoint::load(s, path);
    const double load = slowest(seconds_since(t));
    sharded_load.add(load, load);

    barrier();
    t = clock_type::now();
    paratrain::checkpoint::save_model(s, dir / "model.pt");
    const double save_model = slowest(seconds_since(t));
    full_save.add(save_model, save_model);
    model_bytes = slowest(rank == 0 ? double(fs::file_size(dir / "model.pt")) : 0.0);
    barrier();
    t = clock_type::now();
    paratrain::checkpoint::load_model(s, dir / "model.pt");
    const double load_model = slowest(seconds_since(t));
    full_load.add(load_model, load_model);
    if (rank == 0) fs::remove_all(dir / "sync"), fs::remove_all(dir / "async");
    barrier();
  }
  report("sharded save", "sync", sync_save, bytes);
  report("sharded save", "async", async_save, bytes);
  report("sharded load", "sync", sharded_load, bytes);
  report("full save", "sync", full_save, model_bytes);
  report("full load", "sync", full_load, model_bytes);
  if (rank == 0) fs::remove_all(dir);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  paratrain::comm::Mpi::Environment env(argc, argv);
  torch::set_num_threads(1);
  std::string strategy = "ddp", dir = "bench_checkpoint.tmp";
  int layers = 4;
  CLI::App app("bench_checkpoint: saving and loading a wide MLP's checkpoint, synchronously and in the background");
  app.add_option("--strategy", strategy, "ddp or zero3")->check(CLI::IsMember({"ddp", "zero3"}))->capture_default_str();
  app.add_option("--layers", layers, "wide layers of the MLP (wide_mlp.hpp)")->check(CLI::Range(1, 4096))->capture_default_str();
  app.add_option("--dir", dir, "where the checkpoints are written (removed after)")->capture_default_str();
  if (const auto status = paratrain::bench::parse(app, argc, argv)) return *status;
  using Adam = torch::optim::Adam;
  if (strategy == "ddp") return run<Adam>(strategy, layers, dir);
  return run<paratrain::Sharded<Adam, paratrain::zero::stage3>>(strategy, layers, dir);
}
