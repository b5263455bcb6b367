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
// The model is a small MLP on Fashion-MNIST; no line of it knows about failures. The
// strategy's communicator is Gloo: ranks meet through torchrun's store (MASTER_ADDR,
// MASTER_PORT), so no MPI is needed.
#include <torch/torch.h>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <fstream>
#include <optional>
#include <string>

#include "paratrain/paratrain.hpp"

namespace {

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(28 * 28, 128));
    fc2 = register_module("fc2", torch::nn::Linear(128, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x.flatten(1)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Mlp);

using Strategy = paratrain::DataParallel<Mlp, paratrain::comm::Gloo, torch::optim::SGD>;

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
  app.add_option("--seed", a.seed, "initial weights and sample order")->capture_default_str();
  try {
    app.parse(argc, argv);
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    if (paratrain::detail::known_rank() <= 0) return app.exit(e);
    return e.get_exit_code();
  }
}

int train(const Args& args) {
  const paratrain::data::IdxDataset all(args.data + "/train-images-idx3-ubyte.gz",
                                        args.data + "/train-labels-idx1-ubyte.gz", {.mean = 0.2860, .std = 0.3530});
  const paratrain::data::Subset data(all, torch::arange(std::min(args.train_samples, all.size()), torch::kLong));
  // The ranks meet where the launcher says (torchrun's MASTER_ADDR:MASTER_PORT); a new
  // start is a new meeting, at the world size it was given.
  Strategy s(torch::optim::SGDOptions(0.05).momentum(0.9), {.deterministic = {.shards = args.shards}});
  const auto result = paratrain::fit(s, data,
                                     {.epochs = args.epochs,
                                      .batch_size = args.batch,
                                      .global_batch_size = args.global_batch,
                                      .log_every = 50,
                                      .checkpoint = {.directory = args.checkpoint_dir,
                                                     .every_steps = args.checkpoint_every}});
  if (s.rank() == 0) {
    std::printf("%d rank(s), %lld steps in all%s%s\n", s.world_size(), static_cast<long long>(result.steps),
                result.resumed_from ? ", resumed from " : "",
                result.resumed_from ? result.resumed_from->c_str() : "");
    if (!args.save_parameters.empty()) {
      std::ofstream out(args.save_parameters, std::ios::binary);
      for (const auto& p : s.model()->parameters()) {
        const auto c = p.detach().to(torch::kCPU).contiguous();
        out.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.nbytes()));
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  if (const auto status = parse(argc, argv, args)) return *status;
  return paratrain::main(argc, argv, [&] { return train(args); }, {.seed = args.seed});
}
