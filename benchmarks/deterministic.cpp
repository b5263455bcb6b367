// What deterministic mode costs (Note [Deterministic training]): one configuration per
// process, DDP or ZeRO-2 with Adam over MPI, on bench_zero's wide MLP or the Transformer
// example's model, with `--shards K` virtual shards or without (0). The global batch is the
// same either way (--batch per rank × ranks); prints one JSON line: ms per step, the slowest
// rank's median over trials. benchmarks/deterministic.sh runs the sides alternately.
//   scripts/mpirun.sh 2 build-bench/benchmarks/bench_deterministic --model mlp --layers 4 --strategy ddp --shards 2
#include <torch/torch.h>

#include <cstdio>
#include <string>

#include "../examples/transformer/model.hpp"
#include "cli.hpp"
#include "driver.hpp"
#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/core/shard_plan.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "timing.hpp"
#include "wide_mlp.hpp"

namespace {

struct Run {
  std::string model = "mlp", strategy = "ddp";
  int layers = 4, steps = 12, warmup = 2;
  std::int64_t shards = 0, batch = 32, d_model = 128;
};

using Adam = torch::optim::Adam;
using paratrain::bench::wide_mlp_width;

// `make()` builds the model, `inputs(rows)` its batch of `rows` samples (from a pool, so that
// steps read different samples).
template <class Update, class Model, class Make, class Inputs>
double ms_per_step(const Run& run, paratrain::comm::Mpi world, Make make, Inputs inputs) {
  const auto ranks = paratrain::bench::ranks_of(world.native());
  const int rank = world.rank(), size = world.size();
  const std::int64_t global = run.batch * size;
  const std::int64_t mine = run.shards > 0 ? paratrain::ShardPlan(global, run.shards).rank_samples(rank, size)
                                           : run.batch;
  torch::manual_seed(7);
  paratrain::DataParallel<Model, paratrain::comm::Mpi, Update> s(
      make(), std::move(world), torch::optim::AdamOptions(1e-4), {.deterministic = {.shards = run.shards}});
  torch::manual_seed(1 + rank);
  constexpr std::int64_t pool = 4;
  std::vector<paratrain::Batch> batches;
  for (std::int64_t i = 0; i < pool; ++i) batches.push_back(inputs(mine));
  std::int64_t next = 0;
  const auto step = [&] {
    s.step(batches[static_cast<std::size_t>(next++ % pool)], [](const torch::Tensor& out, const torch::Tensor& y) {
      return torch::nn::functional::cross_entropy(out, y);
    });
  };
  for (int i = 0; i < run.warmup; ++i) step();
  return 1e3 * paratrain::bench::time_alternating(ranks, 3, std::max(1, run.steps / 3), {step})[0];
}

template <class Update>
double measure(const Run& run, std::int64_t& parameters, paratrain::comm::Mpi world) {
  if (run.model == "mlp") {
    parameters = static_cast<std::int64_t>(run.layers) * (wide_mlp_width * wide_mlp_width + wide_mlp_width) +
                 wide_mlp_width * 10 + 10;
    return ms_per_step<Update, paratrain::bench::WideMlp>(
        run, world, [&] { return paratrain::bench::WideMlp(run.layers); },
        [](std::int64_t n) {
          return paratrain::Batch{torch::randn({n, wide_mlp_width}), torch::randint(0, 10, {n}, torch::kLong)};
        });
  }
  transformer::Config c;
  c.d_model = run.d_model, c.nhead = 4, c.encoder_layers = c.decoder_layers = run.layers;
  c.dim_feedforward = 4 * run.d_model;
  const auto [encoder, decoder] = transformer::parameter_counts(c);
  parameters = static_cast<std::int64_t>(encoder + decoder);
  return ms_per_step<Update, transformer::Transformer>(
      run, world, [&] { return transformer::Transformer(c); },
      [&](std::int64_t n) {
        auto src = torch::rand({n, c.src_len, c.d_model}), tgt = torch::rand({n, c.tgt_len, c.d_model});
        return paratrain::Batch({src, tgt}, tgt);
      });
}

}  // namespace

int main(int argc, char** argv) {
  paratrain::comm::Mpi::Environment env(argc, argv);
  torch::set_num_threads(1);
  Run run;
  CLI::App app("bench_deterministic: DDP or ZeRO-2 with and without deterministic mode: ms per step");
  app.add_option("--model", run.model, "mlp (bench_zero's) or transformer (the example's)")
      ->check(CLI::IsMember({"mlp", "transformer"}))
      ->capture_default_str();
  app.add_option("--strategy", run.strategy, "ddp or zero2")->check(CLI::IsMember({"ddp", "zero2"}))->capture_default_str();
  app.add_option("--layers", run.layers, "mlp: wide layers; transformer: encoder and decoder layers each")
      ->check(CLI::Range(1, 4096))
      ->capture_default_str();
  app.add_option("--d-model", run.d_model, "transformer: model width")->check(CLI::Range(8, 1 << 16))->capture_default_str();
  app.add_option("--shards", run.shards, "deterministic mode's virtual shards (0: off)")
      ->check(CLI::Range(0, 1 << 16))
      ->capture_default_str();
  app.add_option("--batch", run.batch, "samples per rank per step (global: times the ranks)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--steps", run.steps, "timed steps")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_option("--warmup", run.warmup, "steps before the timed ones")->check(CLI::Range(0, 1 << 20))->capture_default_str();
  if (const auto status = paratrain::bench::parse(app, argc, argv)) return *status;
  std::int64_t parameters = 0;
  paratrain::comm::Mpi world;
  const int rank = world.rank(), size = world.size();
  const double ms = run.strategy == "ddp"
                        ? measure<Adam>(run, parameters, std::move(world))
                        : measure<paratrain::Sharded<Adam, paratrain::zero::stage2>>(run, parameters, std::move(world));
  if (rank == 0)
    std::printf("{\"model\": \"%s\", \"parameters\": %lld, \"strategy\": \"%s\", \"shards\": %lld, \"ranks\": %d, "
                "\"batch_per_rank\": %lld, \"ms_per_step\": %.2f}\n",
                run.model.c_str(), static_cast<long long>(parameters), run.strategy.c_str(),
                static_cast<long long>(run.shards), size, static_cast<long long>(run.batch), ms);
  return 0;
}
