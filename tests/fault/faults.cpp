// A training program that misbehaves on purpose, for the fault-injection tests
// (tests/fault/inject.sh): one rank is killed, stopped, skips a collective, or throws, at a
// chosen step, under DDP, ZeRO-3 or a two-stage pipeline. docs/reliability.md.
#include <cstdlib>
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <csignal>
#include <cstdio>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>

#include "paratrain/paratrain.hpp"

namespace {

using paratrain::comm::Mpi;

struct Fault {
  std::string kind = "none";  // none, kill, stop, skip, throw
  int rank = 1;
  std::int64_t step = 3;
  bool armed = false;  // set after `step` on `rank`: the next collective is skipped
};
Fault fault;

// comm::Mpi, but the rank at fault leaves out its first collective with peers after it is armed.
struct SkippingMpi : Mpi {
  SkippingMpi() = default;
  explicit SkippingMpi(Mpi m) : Mpi(std::move(m)) {}
  [[nodiscard]] SkippingMpi split(int color, int key = 0) const { return SkippingMpi(Mpi::split(color, key)); }
  [[nodiscard]] SkippingMpi duplicate() const { return SkippingMpi(Mpi::duplicate()); }

  // Only collectives with peers: leaving out one over a communicator of one (a pipeline
  // stage without replicas) changes nothing.
  bool skip() const {
    if (!fault.armed || size() < 2) return false;
    fault.armed = false;
    std::fprintf(stderr, "faults: rank %d skips a collective\n", fault.rank);
    return true;
  }
  void all_reduce(at::Tensor& t, paratrain::reduce_op op) {
    if (!skip()) Mpi::all_reduce(t, op);
  }
  [[nodiscard]] Request iall_reduce(at::Tensor& t, paratrain::reduce_op op) {
    return skip() ? Request() : Mpi::iall_reduce(t, op);
  }
  void reduce_scatter(const at::Tensor& in, at::Tensor& out, paratrain::reduce_op op) {
    if (!skip()) Mpi::reduce_scatter(in, out, op);
  }
  [[nodiscard]] Request ireduce_scatter(const at::Tensor& in, at::Tensor& out, paratrain::reduce_op op) {
    return skip() ? Request() : Mpi::ireduce_scatter(in, out, op);
  }
  void all_gather(const at::Tensor& in, at::Tensor& out) {
    if (!skip()) Mpi::all_gather(in, out);
  }
  [[nodiscard]] Request iall_gather(const at::Tensor& in, at::Tensor& out) {
    return skip() ? Request() : Mpi::iall_gather(in, out);
  }
};

constexpr int features = 16, width = 32, classes = 4;

struct EntryImpl : torch::nn::Module {
  EntryImpl() { fc = register_module("fc", paratrain::Unit<torch::nn::Linear>(features, width)); }
  torch::Tensor forward(torch::Tensor x) { return torch::relu(fc(x)); }
  paratrain::Unit<torch::nn::Linear> fc{nullptr};
};
TORCH_MODULE(Entry);

struct HeadImpl : torch::nn::Module {
  HeadImpl() { fc = register_module("fc", paratrain::Unit<torch::nn::Linear>(width, classes)); }
  torch::Tensor forward(torch::Tensor h) { return fc(h); }
  paratrain::Unit<torch::nn::Linear> fc{nullptr};
};
TORCH_MODULE(Head);

struct WholeImpl : torch::nn::Module {
  WholeImpl() {
    entry = register_module("0", Entry());
    head = register_module("1", Head());
  }
  torch::Tensor forward(torch::Tensor x) { return head(entry(x)); }
  Entry entry{nullptr};
  Head head{nullptr};
};
TORCH_MODULE(Whole);

void inject(const paratrain::StepInfo& step, int rank) {
  if (rank != fault.rank || step.step != fault.step) return;
  std::fprintf(stderr, "faults: rank %d: %s after step %lld\n", rank, fault.kind.c_str(),
               static_cast<long long>(step.step));
  std::fflush(stderr);
  if (fault.kind == "kill") std::raise(SIGKILL);
  if (fault.kind == "stop") std::raise(SIGSTOP);
  if (fault.kind == "skip") fault.armed = true;
  if (fault.kind == "throw") throw std::runtime_error("injected fault after step " + std::to_string(step.step));
}

template <class Strategy>
void train(Strategy& strategy, std::int64_t steps, int micro_batches = 1) {
  torch::manual_seed(1);
  const auto n = steps * 8 * micro_batches * strategy.data_shard().count;
  const paratrain::data::TensorDataset data(torch::randn({n, features}), torch::randint(classes, {n}));
  paratrain::fit(strategy, data,
                 {.epochs = 1, .batch_size = 8, .accumulation = micro_batches, .shuffle = false, .progress = false,
                  .on_step = [&](const paratrain::StepInfo& s) { inject(s, strategy.rank()); }});
}

}  // namespace

int main(int argc, char** argv) {
  // fit's deadline (Note [Ending before the time limit]) must not come from a Slurm job that
  // happens to run the tests; the tests that want one set SLURM_JOB_END_TIME themselves.
  ::unsetenv("SLURM_JOB_END_TIME");
  Mpi::Environment env(argc, argv);
  torch::set_num_threads(1);
  CLI::App app("paratrain's fault-injection program");
  std::string strategy = "ddp";
  std::int64_t steps = 12;
  app.add_option("--strategy", strategy, "ddp, zero3 or pipeline")->check(CLI::IsMember({"ddp", "zero3", "pipeline"}));
  app.add_option("--fault", fault.kind, "none, kill, stop, skip or throw")
      ->check(CLI::IsMember({"none", "kill", "stop", "skip", "throw"}));
  app.add_option("--rank", fault.rank, "the rank at fault");
  app.add_option("--step", fault.step, "the fault comes after this step (from 0)");
  app.add_option("--steps", steps, "steps to train");
  CLI11_PARSE(app, argc, argv);

  return paratrain::guarded([&] {
    torch::manual_seed(0);
    const auto sgd = torch::optim::SGDOptions(0.1);
    if (strategy == "ddp") {
      paratrain::DataParallel<Whole, SkippingMpi, torch::optim::SGD> s(Whole(), sgd);
      train(s, steps);
    } else if (strategy == "zero3") {
      paratrain::DataParallel<Whole, SkippingMpi, paratrain::Sharded<torch::optim::SGD, paratrain::zero::stage3>> s(
          Whole(), sgd);
      train(s, steps);
    } else {
      paratrain::DataParallel<paratrain::Pipeline<Entry, Head>, SkippingMpi, torch::optim::SGD> s(
          paratrain::Pipeline<Entry, Head>([] { return Entry(); }, [] { return Head(); }), sgd);
      train(s, steps, 2);
    }
    std::printf("faults: trained without a fault\n");
  });
}
