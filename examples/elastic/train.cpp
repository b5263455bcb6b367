// Elastic training: the same program wherever a launcher starts it, at whatever world size.
// A lost rank ends the job (every survivor within seconds); torchrun's elastic agent, a
// requeued SLURM job or a new mpirun starts it again on the ranks there are, and each start
// resumes from the newest complete checkpoint in --checkpoint-dir, resharded to the new
// world, with the first start's global batch: the same samples in the same steps as if
// nothing had happened. With --deterministic-shards, the same bits too.
//
//   # four "nodes" of one process each, any 2 to 4 of them; an agent restarts its worker
//   # when a rank is lost (docs/elastic.md)
//   torchrun --nnodes=2:4 --nproc-per-node=1 --max-restarts=10 --rdzv-backend=c10d \
//     --rdzv-endpoint=HOST:29400 --rdzv-id=job --no-python ./elastic_train --checkpoint-dir ckpt
//
// With --recover, a lost rank costs no restart: the survivors meet again in a store file that
// outlives every rank (PARATRAIN_STORE_FILE), rebuild the strategy over their new group and go
// on from the state they hold (paratrain::elastic::fit):
//
//   PARATRAIN_STORE_FILE=/shared/job-store RANK=r WORLD_SIZE=4 ./elastic_train --recover ...
//
// The model is a small MLP on Fashion-MNIST; no line of it knows about failures. The
// strategy's communicator is Gloo: ranks meet through torchrun's store (MASTER_ADDR,
// MASTER_PORT), or the store file, so no MPI is needed. --shard-group G trains with ZeRO-3,
// hybrid: sharded over groups of G ranks, replicated across them.
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <fstream>
#include <optional>
#include <string>

#include "paratrain/paratrain.hpp"

namespace {

// Each layer a unit: what ZeRO-3 gathers at a time (--shard-group); DDP does not look.
struct MlpImpl : torch::nn::Module {
  explicit MlpImpl(std::int64_t hidden = 128) {
    fc1 = register_module("fc1", paratrain::Unit<torch::nn::Linear>(28 * 28, hidden));
    fc2 = register_module("fc2", paratrain::Unit<torch::nn::Linear>(hidden, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x.flatten(1)))); }
  paratrain::Unit<torch::nn::Linear> fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Mlp);

using Strategy = paratrain::DataParallel<Mlp, paratrain::comm::Gloo, torch::optim::SGD>;
using Hybrid = paratrain::DataParallel<Mlp, paratrain::comm::Gloo,
                                       paratrain::Sharded<torch::optim::SGD, paratrain::zero::stage3>>;

struct Args {
  std::string data = "/usr/share/datasets/fashion-mnist";
  std::string checkpoint_dir = "elastic-checkpoints";
  std::int64_t checkpoint_every = 20;  // steps
  std::int64_t train_samples = 6000;
  std::int64_t global_batch = 96;      // every world size up to 4 (and 6, 8, 12) divides it
  std::int64_t batch = 96;             // the largest micro-batch a rank's share is cut into
  int epochs = 2;
  std::int64_t shards = 0;             // deterministic mode's virtual shards; 0: off
  std::string save_parameters;         // rank 0 writes the final parameters' bytes here
  bool recover = false;                // survive a lost rank in-process (elastic::fit)
  int shard_group = 0;                 // ZeRO-3 over groups of this many ranks; 0: DDP
  std::int64_t hidden = 128;           // the MLP's width
  std::uint64_t seed = 0;
};

std::optional<int> parse(int argc, char** argv, Args& a) {
  CLI::App app("Elastic training with paratrain: resumes at any world size from --checkpoint-dir");
  app.add_option("--data", a.data, "the directory of Fashion-MNIST's IDX files")->capture_default_str();
  app.add_option("--checkpoint-dir", a.checkpoint_dir, "checkpoints go here; each start resumes from the newest")
      ->capture_default_str();
  app.add_option("--checkpoint-every", a.checkpoint_every, "steps between checkpoints")
      ->check(CLI::Range(1, 1 << 30))->capture_default_str();
  app.add_option("--train-samples", a.train_samples, "train on the first N samples")
      ->check(CLI::Range(1, 60000))->capture_default_str();
  app.add_option("--global-batch", a.global_batch, "samples per step over all ranks, kept by every resume")
      ->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_option("--batch", a.batch, "the largest micro-batch per rank")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_option("--epochs", a.epochs, "epochs to train")->check(CLI::Range(0, 1000000))->capture_default_str();
  app.add_option("--deterministic-shards", a.shards,
                 "deterministic mode with this many virtual shards (a multiple of every world size the job runs "
                 "at): the same bits at any of them; 0: off")
      ->check(CLI::Range(0, 1 << 20))->capture_default_str();
  app.add_option("--save-parameters", a.save_parameters, "rank 0 writes the final parameters' bytes to this file");
  app.add_flag("--recover", a.recover,
               "survive a lost rank without a restart: the others go on (needs PARATRAIN_STORE_FILE)");
  app.add_option("--shard-group", a.shard_group,
                 "ZeRO-3 over groups of this many ranks, replicated across the groups (all ranks where the group "
                 "does not divide the world); 0: DDP")
      ->check(CLI::Range(0, 1 << 10))->capture_default_str();
  app.add_option("--hidden", a.hidden, "the MLP's hidden width (128: 101,770 parameters; 4096: 3.3M)")
      ->check(CLI::Range(1, 1 << 20))->capture_default_str();
  app.add_option("--seed", a.seed, "initial weights and sample order")->capture_default_str();
  try {
    app.parse(argc, argv);
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    if (paratrain::detail::known_rank() <= 0) return app.exit(e);
    return e.get_exit_code();
  }
}

paratrain::DataParallelOptions strategy_options(const Args& a, int world) {
  paratrain::DataParallelOptions o;
  o.deterministic.shards = a.shards;
  if (a.shard_group > 0) o.shard_group = world % a.shard_group == 0 ? a.shard_group : 0;
  return o;
}

paratrain::FitOptions fit_options(const Args& a) {
  return {.epochs = a.epochs,
          .batch_size = a.batch,
          .global_batch_size = a.global_batch,
          .log_every = 50,
          .checkpoint = {.directory = a.checkpoint_dir, .every_steps = a.checkpoint_every}};
}

// Rank 0 reports; every rank takes part in gathering the parameters (ZeRO-3 holds shards).
template <class S>
void report(S& s, const paratrain::FitResult& result, const Args& args) {
  const auto parameters = s.full_parameters();
  if (s.rank() != 0) return;
  std::printf("%d rank(s), %lld steps in all%s%s\n", s.world_size(), static_cast<long long>(result.steps),
              result.resumed_from ? ", resumed from " : "", result.resumed_from ? result.resumed_from->c_str() : "");
  if (args.save_parameters.empty()) return;
  std::ofstream out(args.save_parameters, std::ios::binary);
  for (const auto& p : parameters) {
    const auto c = p.detach().to(torch::kCPU).contiguous();
    out.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.nbytes()));
  }
}

// A start resumes from the newest checkpoint; a lost rank ends every rank (the restart path).
template <class S, class D>
int train_restartable(const D& data, const Args& args) {
  // The ranks meet where the launcher says (torchrun's MASTER_ADDR:MASTER_PORT); a new
  // start is a new meeting, at the world size it was given.
  S s([&args] { return Mlp(args.hidden); }, torch::optim::SGDOptions(0.05).momentum(0.9),
      strategy_options(args, paratrain::detect_placement().world_size));
  report(s, paratrain::fit(s, data, fit_options(args)), args);
  return 0;
}

// A lost rank costs the survivors a meeting and a save: each generation's strategy is made
// over its group, laid out for its size.
template <class S, class D>
int train_recovering(const D& data, const Args& args) {
  auto make = [&args](paratrain::comm::Gloo& group) {
    return S(Mlp(args.hidden), group, torch::optim::SGDOptions(0.05).momentum(0.9),
             strategy_options(args, group.size()));
  };
  auto [result, s] = paratrain::elastic::fit(make, data, fit_options(args));
  report(*s, result, args);
  return 0;
}

int train(const Args& args) {
  const paratrain::data::IdxDataset all(args.data + "/train-images-idx3-ubyte.gz",
                                        args.data + "/train-labels-idx1-ubyte.gz", {.mean = 0.2860, .std = 0.3530});
  const paratrain::data::Subset data(all, torch::arange(std::min(args.train_samples, all.size()), torch::kLong));
  if (args.shard_group > 0)
    return args.recover ? train_recovering<Hybrid>(data, args) : train_restartable<Hybrid>(data, args);
  return args.recover ? train_recovering<Strategy>(data, args) : train_restartable<Strategy>(data, args);
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (const auto status = parse(argc, argv, args)) return *status;
  return paratrain::main(argc, argv, [&] { return train(args); }, {.seed = args.seed});
}
