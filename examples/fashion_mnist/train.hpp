#pragma once
// The demo's training program, the same for every strategy: each of single.cpp, ddp.cpp,
// ddp_gloo.cpp, ddp_nccl.cpp and zero3.cpp names a strategy in one alias and calls
// run<Strategy>() (every other alias: examples/quickstart, built once per alias).
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "net.hpp"
#include "paratrain/comm/device.hpp"
#include "paratrain/paratrain.hpp"

namespace fashion_mnist {

struct Args {
  int epochs = 5;
  std::int64_t batch = 64;  // per process
  double lr = 2e-3;
  std::string data = "/usr/share/datasets/fashion-mnist";
  std::int64_t train_samples = 0;  // 0: all 60000; fewer for a quick smoke run
  std::string checkpoint_dir;      // checkpoints here, and resume from the newest one
  std::int64_t checkpoint_every = 200;  // steps between checkpoints (and one after every epoch)
  int workers = paratrain::data::LoaderOptions{}.workers;  // threads preparing the next batches
  std::string device;  // cpu or cuda; empty: cuda where there is a GPU the strategy can use, else cpu
  std::int64_t max_steps = 0;  // 0: the epochs decide
  double time_limit = 0;       // seconds; 0: none (and SLURM's job end, where Slurm sets it)
  std::uint64_t seed = 0;      // initial weights and sample order
  int powersgd_rank = 0;       // compress gradients with PowerSGD of this rank; 0: exact sums
  std::int64_t powersgd_start = 100;  // steps summed exactly before PowerSGD starts
};

// The options, by CLI11: --help, and values checked (a missing or malformed one is an error
// that names the option). Returns the exit status when the program should end now.
inline std::optional<int> parse(int argc, char** argv, Args& a) {
  CLI::App app("Fashion-MNIST with paratrain: the same training loop under every strategy");
  app.add_option("--epochs", a.epochs, "epochs to train (0: none)")->check(CLI::Range(0, 1000000))->capture_default_str();
  app.add_option("--batch", a.batch, "samples per process per step")->check(CLI::Range(1, 1 << 30))->capture_default_str();
  app.add_option("--lr", a.lr, "Adam's learning rate")->check(CLI::Range(1e-12, 1e3))->capture_default_str();
  app.add_option("--data", a.data, "the directory of the IDX files")->capture_default_str();
  app.add_option("--train-samples", a.train_samples, "train on the first N samples (0: all 60000)")
      ->check(CLI::Range(0, 1 << 30));
  app.add_option("--checkpoint-dir", a.checkpoint_dir, "save checkpoints here, and resume from the newest");
  app.add_option("--checkpoint-every", a.checkpoint_every, "steps between checkpoints")
      ->check(CLI::Range(1, 1 << 30))->capture_default_str();
  app.add_option("--device", a.device,
                 "cpu or cuda (default: cuda where LibTorch sees a GPU and this build reduces there: not over MPI; "
                 "else cpu)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--workers", a.workers, "threads per process reading the next batches (0: on the training thread)")
      ->check(CLI::Range(0, 64))->capture_default_str();
  app.add_option("--max-steps", a.max_steps, "stop after N optimizer steps (0: the epochs decide)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 40));
  app.add_option("--time-limit", a.time_limit,
                 "seconds: stop before they run out, with a checkpoint in --checkpoint-dir (also before "
                 "SLURM_JOB_END_TIME, where Slurm sets it)")
      ->check(CLI::Range(0.0, 1e9));
  app.add_option("--seed", a.seed, "initial weights and sample order")->capture_default_str();
  app.add_option("--powersgd-rank", a.powersgd_rank,
                 "compress the gradients with PowerSGD of this rank (the DDP builds; 0: exact sums)")
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--powersgd-start", a.powersgd_start, "steps summed exactly before PowerSGD starts")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 40))->capture_default_str();
  try {
    app.parse(argc, argv);
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    // Every rank parses the same command line; one of them prints.
    if (paratrain::detail::known_rank() <= 0) return app.exit(e);
    return e.get_exit_code();
  }
}

// Whether strategy S communicates through C (LocalDataParallel has no communicator).
template <class S, class C>
constexpr bool communicates_over() {
  if constexpr (requires { typename S::communicator_type; }) return std::same_as<typename S::communicator_type, C>;
  else return false;
}

// MPI is started only for the strategies that communicate through it. comm::Nccl is made from
// a meeting of the ranks (torchrun's variables, or srun's with MASTER_ADDR and MASTER_PORT):
// it needs no MPI.
#if PARATRAIN_HAS_MPI
template <class S>
constexpr bool uses_mpi = communicates_over<S, paratrain::comm::Mpi>();
#else
template <class S>
constexpr bool uses_mpi = false;
#endif
#if PARATRAIN_HAS_NCCL
template <class S>
constexpr bool uses_nccl = communicates_over<S, paratrain::comm::Nccl>();
#else
template <class S>
constexpr bool uses_nccl = false;
#endif

// What the alias chose, for the summary line.
template <class S>
constexpr const char* name_of() {
  if constexpr (!requires { typename S::communicator_type; }) return "dp";
  else if constexpr (communicates_over<S, paratrain::comm::SingleDevice>()) return "single";
#if PARATRAIN_HAS_GLOO
  else if constexpr (communicates_over<S, paratrain::comm::Gloo>()) return "ddp-gloo";
#endif
  else if constexpr (uses_nccl<S>) return "ddp-nccl";
  else if constexpr (S::stage > 0) {
    constexpr const char* zero[] = {"", "zero1", "zero2", "zero3"};
    return zero[S::stage];
  } else return "ddp";
}

// The device to train on: --device, or by default a GPU where there is one and the
// strategy's communicator can reduce there (comm::Mpi reduces host memory only).
template <class S>
torch::Device device_for(const Args& args) {
  if (args.device.empty() && uses_mpi<S>) return torch::kCPU;
  if (args.device == "cuda" && uses_mpi<S>)
    throw std::runtime_error("--device cuda: this build reduces over MPI, in host memory; on GPUs run "
                             "fashion_mnist_ddp_nccl (or fashion_mnist_ddp_gloo)");
  if (args.device != "cuda" && uses_nccl<S>) {
    if (args.device == "cpu") throw std::runtime_error("--device cpu: this build reduces over NCCL, on GPUs only");
    return paratrain::local_device("cuda");
  }
  return paratrain::local_device(args.device);
}

// The strategy's options for `device`, the one thing its type changes: LocalDataParallel's
// replicas on the CPU for --device cpu; DataParallel's model placed on `device` (the strategy
// builds it: at ZeRO stage 3 each layer is sharded as it is built and no rank ever holds the
// whole model, docs/sharding.md; under comm::Nccl, the local rank's GPU).
template <class S>
typename S::Options options_for(const torch::Device& device) {
  if constexpr (!requires { typename S::communicator_type; }) return {.cpu = device.is_cpu()};
  else return {.build = {.device = device}};
}

// One split of the IDX files, through the library's reader: uint8 in memory, converted to
// normalised float batches by the loader's workers.
inline paratrain::data::IdxDataset load(const std::string& dir, const std::string& prefix) {
  const auto images = dir + "/" + prefix + "-images-idx3-ubyte.gz";
  if (!std::filesystem::exists(images))
    throw std::runtime_error("cannot open " + images + " (is dataset-fashion-mnist installed?)");
  // Fashion-MNIST's training-set mean and standard deviation.
  return {images, dir + "/" + prefix + "-labels-idx1-ubyte.gz", {.mean = 0.2860, .std = 0.3530}};
}

template <paratrain::strategy Strategy>
int train(const Args& args) {
  const auto start = std::chrono::steady_clock::now();

  const auto all = load(args.data, "train"), test = load(args.data, "t10k");
  const auto n = args.train_samples > 0 ? std::min(args.train_samples, all.size()) : all.size();
  const paratrain::data::Subset train(all, torch::arange(n, torch::kLong));

  const auto device = device_for<Strategy>(args);
  Strategy strategy(torch::optim::AdamOptions(args.lr), options_for<Strategy>(device));
  const bool root = strategy.rank() == 0;
  if (args.powersgd_rank > 0) {
    // PowerSGD compresses whole gradients: the strategies whose ranks keep them (DDP, ZeRO-1).
    if constexpr (requires { Strategy::stage; }) {
      if constexpr (Strategy::stage < 2)
        strategy.register_gradient_hook(
            paratrain::PowerSgd({.rank = args.powersgd_rank, .start_step = args.powersgd_start}));
      else
        throw std::runtime_error("--powersgd-rank: ZeRO-2 and ZeRO-3 keep a shard of each gradient, and PowerSGD "
                                 "compresses whole ones; use a DDP build");
    } else {
      throw std::runtime_error("--powersgd-rank: this build has no gradient buckets to compress (use the DDP build)");
    }
  }
  if (root)
    std::printf("Fashion-MNIST, %s, %d process(es) on %s, batch %lld per process, %d epochs%s\n", name_of<Strategy>(),
                strategy.world_size(), strategy.device().str().c_str(), static_cast<long long>(args.batch), args.epochs,
                args.powersgd_rank > 0 ? (", PowerSGD rank " + std::to_string(args.powersgd_rank)).c_str() : "");

  std::optional<double> seconds_to_90;
  auto elapsed = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
  const auto result = paratrain::fit(strategy, train,
                                     {.epochs = args.epochs,
                                      .batch_size = args.batch,
                                      .eval = &test,
                                      .loader = {.workers = args.workers, .depth = std::max(args.workers, 2)},
                                      .lr_schedule = [&](double epoch) {  // cosine decay to 0
                                        return 0.5 * (1 + std::cos(3.141592653589793 * epoch / args.epochs));
                                      },
                                      .max_steps = args.max_steps,
                                      .time_limit = {.seconds = args.time_limit},
                                      .log_every = 200,
                                      .on_epoch = [&](const paratrain::EpochInfo& e) {
                                        if (!seconds_to_90 && e.eval_accuracy >= 0.90) seconds_to_90 = elapsed();
                                      },
                                      // Stopped (Ctrl-C, kill, a time limit), the same command resumes.
                                      .checkpoint = {.directory = args.checkpoint_dir,
                                                     .every_steps = args.checkpoint_every,
                                                     .every_epoch = true}});
  if (result.resumed_from && root) std::printf("resumed from %s\n", result.resumed_from->c_str());
  if (result.epochs.empty()) {
    if (root && args.epochs == 0) std::printf("0 epochs: nothing to train\n");
    else if (root) std::printf("nothing left to train: the newest checkpoint is after epoch %d\n", args.epochs);
    return 0;
  }
  const auto& last = result.epochs.back();
  if (root) {
    std::printf("test accuracy %.2f%% after %d epochs; %.0f samples/s; %.1f s wall%s\n", 100 * last.eval_accuracy,
                args.epochs, result.samples_per_second, elapsed(),
                seconds_to_90 ? (", 90% reached after " + std::to_string(*seconds_to_90).substr(0, 5) + " s").c_str()
                              : ", 90% not reached");
    std::printf(
        "{\"strategy\": \"%s\", \"world_size\": %d, \"epochs\": %d, \"test_accuracy\": %.4f, \"samples_per_second\": "
        "%.1f, \"wall_seconds\": %.2f, \"seconds_to_90\": %s}\n",
        name_of<Strategy>(), strategy.world_size(), args.epochs, last.eval_accuracy, result.samples_per_second,
        elapsed(), seconds_to_90 ? std::to_string(*seconds_to_90).c_str() : "null");
  }
  return 0;
}

template <paratrain::strategy Strategy>
int run(int argc, char** argv) {
  Args args;
  if (const auto status = parse(argc, argv, args)) return *status;
  // MPI started where the strategy's communicator needs it, one intra-op thread per process,
  // --seed on every rank (initial weights and sample order); an error on any rank: one
  // "paratrain: ..." line, and the whole job ends.
  return paratrain::main(argc, argv, [&] { return train<Strategy>(args); }, {.seed = args.seed});
}

}  // namespace fashion_mnist
