// DataParallel at every ZeRO stage, one configuration per process (so that its peak
// RSS is its own): step rate, peak RSS, what the strategy holds and what paratrain::plan
// predicts for it.
//
// The model and data of benchmarks/zero_vs_torch.py (PyTorch DDP and
// ZeroRedundancyOptimizer, the reference): MLP of `layers` x Linear(2048, 2048) with ReLU
// and a Linear(2048, 10) head, each layer a paratrain::Unit; Adam(lr 1e-4); cross-entropy;
// batch 32 per rank of random inputs and labels; one intra-op thread per rank.
// Prints one JSON line on rank 0. benchmarks/zero_vs_torch.sh runs it beside PyTorch:
//   scripts/mpirun.sh 2 build/benchmarks/bench_zero <ddp|zero1|zero2|zero3> [layers 4] [steps 30]
#include <sys/resource.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "driver.hpp"
#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/strategy/plan.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "paratrain/strategy/unit.hpp"
#include "wide_mlp.hpp"

namespace {

constexpr std::int64_t batch = 32, pool = 8;

using Mlp = paratrain::bench::WideMlp;
constexpr std::int64_t width = paratrain::bench::wide_mlp_width;

torch::Tensor loss_fn(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(out, target);
}

double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // Linux: KiB
}

template <class Update>
int run(std::string_view name, paratrain::plan::stage stage, int layers, int steps, int warmup) {
  paratrain::comm::Mpi world;
  torch::manual_seed(1 + world.rank());
  const auto x = torch::randn({pool * batch, width});
  const auto y = torch::randint(0, 10, {pool * batch}, torch::kLong);
  paratrain::DataParallel<Mlp, paratrain::comm::Mpi, Update> s(Mlp(layers), world, torch::optim::AdamOptions(1e-4));
  std::int64_t next = 0;
  double exposed = 0;  // seconds waited for gradient reductions after backward
  int calls = 0;       // steps that `exposed` sums over
  const auto step = [&] {
    const auto start = (next++ % pool) * batch;
    s.step({x.narrow(0, start, batch), y.narrow(0, start, batch)}, loss_fn);
    exposed += s.exposed_communication_seconds();
    ++calls;
  };
  for (int i = 0; i < warmup; ++i) step();
  exposed = 0, calls = 0;
  const auto seconds = paratrain::bench::time_alternating(world.native(), 3, steps / 3, {step});
  const auto held = s.model_state_bytes();
  std::int64_t parameters = 0;
  for (const auto& p : s.model()->parameters()) parameters += p.numel();
  const auto planned = paratrain::plan::per_rank({.parameters = static_cast<double>(parameters),
                                                  .param_bytes = 4,
                                                  .grad_bytes = 4,
                                                  .optimizer_bytes = paratrain::plan::optimizer_bytes("adam"),
                                                  .ranks = world.size()},
                                                 stage);
  // The largest peak RSS over the ranks.
  const double rss = paratrain::bench::max_over_ranks(world.native(), peak_rss_mib());
  const double mib = 1 << 20;
  if (world.rank() == 0)
    std::printf(
        "{\"implementation\": \"paratrain\", \"strategy\": \"%s\", \"ranks\": %d, \"layers\": %d, \"parameters\": %lld, "
        "\"batch_per_rank\": %lld, \"steps\": %d, \"steps_per_s\": %.3f, \"peak_rss_mib\": %.1f, "
        "\"exposed_comm_share\": %.3f, \"held_mib\": %.1f, \"planned_mib\": %.1f}\n",
        std::string(name).c_str(), world.size(), layers, static_cast<long long>(parameters),
        static_cast<long long>(batch), steps / 3 * 3, 1 / seconds[0], rss,
        exposed / double(calls) / seconds[0], double(held.total()) / mib,
        planned.total() / mib);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  paratrain::comm::Mpi::Environment env(argc, argv);
  torch::set_num_threads(1);
  const std::string_view strategy = argc > 1 ? argv[1] : "ddp";
  const int layers = argc > 2 ? std::atoi(argv[2]) : 4;
  const int steps = argc > 3 ? std::atoi(argv[3]) : 30;
  const int warmup = argc > 4 ? std::atoi(argv[4]) : 3;
  using Adam = torch::optim::Adam;
  using paratrain::Sharded;
  using paratrain::plan::stage;
  namespace zero = paratrain::zero;
  if (strategy == "ddp") return run<Adam>(strategy, stage::ddp, layers, steps, warmup);
  if (strategy == "zero1") return run<Sharded<Adam, zero::stage1>>(strategy, stage::stage1, layers, steps, warmup);
  if (strategy == "zero2") return run<Sharded<Adam, zero::stage2>>(strategy, stage::stage2, layers, steps, warmup);
  if (strategy == "zero3") return run<Sharded<Adam, zero::stage3>>(strategy, stage::stage3, layers, steps, warmup);
  std::fprintf(stderr, "usage: bench_zero <ddp|zero1|zero2|zero3> [layers] [steps] [warmup]\n");
  return 2;
}
