// DataParallel<Mlp, comm::Mpi, Adam> steps against the same steps without communication.
//
// The model and data of benchmarks/ddp_vs_torch.py (PyTorch's own DDP, the reference):
// MLP 784-1024-1024-10 with ReLU, Adam(lr 1e-3), cross-entropy, batch 64 per rank of
// random inputs and labels, one intra-op thread per rank. Candidates:
//   - ddp:      paratrain::DataParallel::step (forward, backward with overlapped
//               all-reduce, Adam step);
//   - no_comm:  the same step in plain LibTorch on a second replica, no communication:
//               the rate DDP would reach if communication were free.
// Trials alternate the two so that drift hits both alike (benchmarks/driver.hpp).
// --hook fp16, bf16 or powersgd sums the gradients through that gradient hook (Note
// [Gradient hooks]; PyTorch's comm hooks on the Python side); the JSON line then has the
// bytes each rank sent per step. Prints one JSON line on rank 0.
// benchmarks/ddp_vs_torch.sh and benchmarks/hooks_vs_torch.sh run it beside PyTorch:
//   scripts/mpirun.sh 2 build/benchmarks/bench_ddp_vs_torch [--steps N] [--hook powersgd]
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "cli.hpp"
#include "driver.hpp"
#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/strategy/buckets/hooks.hpp"
#include "paratrain/strategy/buckets/powersgd.hpp"
#include "paratrain/strategy/data_parallel.hpp"

namespace {

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(784, 1024));
    fc2 = register_module("fc2", torch::nn::Linear(1024, 1024));
    fc3 = register_module("fc3", torch::nn::Linear(1024, 10));
  }
  torch::Tensor forward(torch::Tensor x) { return fc3(torch::relu(fc2(torch::relu(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Mlp);

torch::Tensor loss_fn(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(out, target);
}

// A few batches of random samples, cycled: the same shapes as the Python side.
struct Data {
  static constexpr std::int64_t batch = 64, pool = 16;
  torch::Tensor x = torch::randn({pool * batch, 784});
  torch::Tensor y = torch::randint(0, 10, {pool * batch}, torch::kLong);
  std::int64_t next = 0;
  paratrain::Batch get() {
    const auto start = (next++ % pool) * batch;
    return {x.narrow(0, start, batch), y.narrow(0, start, batch)};
  }
};

}  // namespace

int main(int argc, char** argv) {
  paratrain::comm::Mpi::Environment env(argc, argv);
  torch::set_num_threads(1);
  int steps = 200, trials = 5, warmup = 20;
  paratrain::DataParallelOptions options;
  CLI::App app("bench_ddp_vs_torch: paratrain's DDP step against a hand-written LibTorch loop with one all-reduce");
  app.add_option("--steps", steps, "timed steps per candidate")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_option("--trials", trials, "the steps are split into this many alternating trials")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  app.add_option("--warmup", warmup, "steps before the timed ones")->check(CLI::Range(0, 1 << 20))->capture_default_str();
  app.add_option("--bucket-cap-bytes", options.bucket_cap_bytes, "DataParallelOptions::bucket_cap_bytes")
      ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 40))
      ->capture_default_str();
  app.add_option("--first-bucket-cap-bytes", options.first_bucket_cap_bytes,
                 "DataParallelOptions::first_bucket_cap_bytes")
      ->check(CLI::Range(std::size_t{0}, std::size_t{1} << 40))
      ->capture_default_str();
  std::string hook = "none";
  paratrain::PowerSgdOptions powersgd{.start_step = 0};
  app.add_option("--hook", hook, "the gradients' hook: none (the exact sum), fp16, bf16 or powersgd")
      ->check(CLI::IsMember({"none", "fp16", "bf16", "powersgd"}))
      ->capture_default_str();
  app.add_option("--powersgd-rank", powersgd.rank, "PowerSgdOptions::rank")->check(CLI::Range(1, 1024))->capture_default_str();
  if (const auto status = paratrain::bench::parse(app, argc, argv)) return *status;

  paratrain::comm::Mpi world;
  torch::manual_seed(1 + world.rank());
  Data data;
  paratrain::DataParallel<Mlp, paratrain::comm::Mpi, torch::optim::Adam> ddp(
      Mlp(), world, torch::optim::AdamOptions(1e-3), options);
  if (hook == "fp16") ddp.register_gradient_hook(paratrain::NarrowGradients(at::kHalf));
  if (hook == "bf16") ddp.register_gradient_hook(paratrain::NarrowGradients(at::kBFloat16));
  if (hook == "powersgd") ddp.register_gradient_hook(paratrain::PowerSgd(powersgd));  // from the first step, as timed
  Mlp local;
  torch::optim::Adam local_optim(local->parameters(), torch::optim::AdamOptions(1e-3));

  double exposed = 0;
  long ddp_steps = 0;
  const auto ddp_step = [&] {
    ddp.step(data.get(), loss_fn);
    exposed += ddp.exposed_communication_seconds();
    ++ddp_steps;
  };
  const auto local_step = [&] {
    auto b = data.get();
    local_optim.zero_grad();
    auto l = loss_fn(local->forward(b.input()), b.target);
    l.backward();
    (void)l.item<double>();  // as DataParallel::step reads the loss
    local_optim.step();
  };
  for (int i = 0; i < warmup; ++i) ddp_step(), local_step();
  exposed = 0, ddp_steps = 0;

  const auto seconds =
      paratrain::bench::time_alternating(world.native(), trials, steps / trials, {ddp_step, local_step});
  // The mean over ranks of the exposed wait per step, as a share of the median step.
  double exposed_per_step = exposed / static_cast<double>(ddp_steps);
  MPI_Allreduce(MPI_IN_PLACE, &exposed_per_step, 1, MPI_DOUBLE, MPI_SUM, world.native());
  exposed_per_step /= world.size();
  if (world.rank() == 0)
    std::printf(
        "{\"implementation\": \"paratrain\", \"ranks\": %d, \"batch_per_rank\": %lld, \"steps\": %d, \"trials\": %d, "
        "\"threads\": %d, \"buckets\": %zu, \"steps_per_s\": %.3f, \"no_comm_steps_per_s\": %.3f, "
        "\"exposed_comm_s_per_step\": %.6f, \"exposed_comm_share\": %.4f, \"hook\": \"%s\", \"powersgd_rank\": %d, "
        "\"bytes_sent_per_step\": %lld}\n",
        world.size(), static_cast<long long>(Data::batch), steps / trials * trials, trials, torch::get_num_threads(),
        ddp.bucket_count(), 1 / seconds[0], 1 / seconds[1], exposed_per_step, exposed_per_step / seconds[0],
        hook.c_str(), hook == "powersgd" ? powersgd.rank : 0, static_cast<long long>(ddp.gradient_bytes_sent()));
}
