// examples/gpt: a GPT-style decoder trained with tensor (and sequence) parallelism beside
// data parallelism, the degree on the command line:
//
//   mpirun -n 2 build/examples/gpt_ddp --tensor-parallel 2 [--sequence-parallel]
//   mpirun -n 4 build/examples/gpt_ddp --tensor-parallel 2      (2 replicas of 2 tensor ranks)
//   mpirun -n 4 build/examples/gpt_ddp --experts 8 --expert-parallel 4   (a mixture of 8 experts
//                                                   a block, 2 on each of 4 ranks)
//   mpirun -n 4 build/examples/gpt_ddp --context-parallel 4 --sequence 16 [--attention all_to_all]
//                                                  (each sequence cut over 4 ranks)
//
// The strategy alias is the build's (gpt_ddp: DDP, gpt_zero3: ZeRO-3 over the data ranks);
// the mesh is {data, context cp, expert ep, tensor t} from the degrees. The data: sequences of a fixed random bigram
// chain (each token's successor drawn from 4 candidates), the same global batch each step
// whatever the layout, so that the losses printed at t = 1, 2, 4 agree (dropout included:
// its masks are keyed by place, Note [Keyed dropout]). With --experts the same holds across
// expert degrees at one world size: the ranks see the same samples, each its tokens' one
// capacity group. It prints each step's loss, then a JSON line with the median step time and
// the bytes the expert group's all-to-alls sent a step.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "model.hpp"
#include "../../benchmarks/cli.hpp"
#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/program/main.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "paratrain/tensor_parallel/cross_entropy.hpp"

#if defined(GPT_ZERO3)
using Update = paratrain::Sharded<torch::optim::AdamW, paratrain::zero::stage3>;
#else
using Update = torch::optim::AdamW;
#endif
using Strategy = paratrain::DataParallel<gpt::Gpt, paratrain::comm::Mpi, Update>;

namespace {

struct Run {
  gpt::Config model;
  int tensor_parallel = 1, expert_parallel = 1, context_parallel = 1, steps = 8;
  std::string attention;  // "": tp::SelfAttention unless context_parallel > 1; ring or all_to_all
  std::string layout = "zigzag";
  bool sequence_parallel = false;
  double aux_weight = 0.01;  // Switch's
  std::int64_t batch = 8;  // sequences per step, over all data replicas
  double lr = 3e-3;
};

// Step k's global batch: ids [batch, positions] and their successors.
std::pair<torch::Tensor, torch::Tensor> batch_of(const Run& run, int step) {
  const auto& c = run.model;
  auto table_gen = at::make_generator<at::CPUGeneratorImpl>(12345);
  const auto next = at::randint(c.vocabulary, {c.vocabulary, 4}, table_gen, at::kLong);  // 4 successors each
  auto g = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  auto ids = at::empty({run.batch, c.positions + 1}, at::kLong);
  ids.select(1, 0).copy_(at::randint(c.vocabulary, {run.batch}, g, at::kLong));
  const auto pick = at::randint(4, {run.batch, c.positions}, g, at::kLong);
  for (std::int64_t t = 0; t < c.positions; ++t)
    ids.select(1, t + 1).copy_(next.index({ids.select(1, t), pick.select(1, t)}));
  return {ids.narrow(1, 0, c.positions).contiguous(), ids.narrow(1, 1, c.positions).contiguous()};
}

}  // namespace

int main(int argc, char** argv) {
  return paratrain::main(argc, argv, [&] {
    Run run;
    CLI::App app("A GPT-style decoder with tensor and sequence parallelism");
    app.add_option("--tensor-parallel", run.tensor_parallel, "ranks per tensor group (divides the world)")
        ->capture_default_str();
    app.add_flag("--sequence-parallel", run.sequence_parallel, "cut the activations between blocks by sequence");
    app.add_option("--steps", run.steps, "training steps")->capture_default_str();
    app.add_option("--batch", run.batch, "sequences per step over all replicas")->capture_default_str();
    app.add_option("--layers", run.model.layers, "blocks")->capture_default_str();
    app.add_option("--hidden", run.model.hidden, "features")->capture_default_str();
    app.add_option("--heads", run.model.heads, "attention heads")->capture_default_str();
    app.add_option("--ffn", run.model.ffn, "the MLP's inner features")->capture_default_str();
    app.add_option("--vocabulary", run.model.vocabulary, "tokens")->capture_default_str();
    app.add_option("--sequence", run.model.positions, "tokens per sequence")->capture_default_str();
    app.add_option("--dropout", run.model.dropout, "dropout")->capture_default_str();
    app.add_option("--lr", run.lr, "AdamW's learning rate")->capture_default_str();
    app.add_option("--experts", run.model.experts, "experts a block (0: a dense MLP)")->capture_default_str();
    app.add_option("--expert-parallel", run.expert_parallel, "ranks per expert group (divides the experts)")
        ->capture_default_str();
    app.add_option("--top-k", run.model.top_k, "experts per token")->capture_default_str();
    app.add_option("--capacity-factor", run.model.capacity_factor, "each expert's capacity (0: dropless)")
        ->capture_default_str();
    app.add_option("--aux-weight", run.aux_weight, "the auxiliary load-balancing loss's weight")->capture_default_str();
    app.add_option("--context-parallel", run.context_parallel, "ranks per context group: each sequence cut over them")
        ->capture_default_str();
    app.add_option("--attention", run.attention,
                   "context-parallel attention: ring or all_to_all (default ring with --context-parallel above 1)")
        ->check(CLI::IsMember({"ring", "all_to_all"}));
    app.add_option("--layout", run.layout, "how sequences are cut over the context group")
        ->check(CLI::IsMember({"zigzag", "contiguous"}))
        ->capture_default_str();
    if (auto status = paratrain::bench::parse(app, argc, argv)) return *status;

    if (run.model.experts > 0 && run.sequence_parallel)
      throw paratrain::error("gpt", -1,
                             "--experts with --sequence-parallel: the experts would see each tensor rank's sequence "
                             "shard, and their tensor ranks must route the same tokens; leave one out");
    run.model.context = run.context_parallel > 1 || !run.attention.empty();
    run.model.algorithm = run.attention == "all_to_all" ? paratrain::cp::Algorithm::all_to_all : paratrain::cp::Algorithm::ring;
    run.model.layout = run.layout == "contiguous" ? paratrain::cp::Layout::contiguous : paratrain::cp::Layout::zigzag;
    torch::manual_seed(1);  // the weights: the same on every rank, at every degree
    Strategy s([&] { return gpt::Gpt(run.model); }, torch::optim::AdamWOptions(run.lr),
               {.tensor_parallel = run.tensor_parallel,
                .sequence_parallel = run.sequence_parallel,
                .context_parallel = run.context_parallel,
                .expert_parallel = run.expert_parallel});
    const paratrain::tp::CrossEntropy cross_entropy{s.tensor_group()};
    const auto loss = [&](const torch::Tensor& logits, const torch::Tensor& targets) {
      // Under context parallelism the logits are this rank's positions: the targets' alike.
      const auto l = cross_entropy(
          logits, run.model.context ? paratrain::cp::shard(targets, 1, s.context_group(), run.model.layout) : targets);
      return run.model.experts > 0 ? l + run.aux_weight * s.model()->aux_loss() : l;
    };
    const auto data = s.data_shard();
    if (run.batch % data.count != 0)
      throw paratrain::error("gpt", s.rank(),
                             "--batch " + std::to_string(run.batch) + " does not split over " +
                                 std::to_string(data.count) + " data replicas");
    const auto mine = run.batch / data.count;
    double last = 0;
    std::vector<double> seconds;
    for (int step = 0; step < run.steps; ++step) {
      const auto [ids, targets] = batch_of(run, step);
      const auto start = std::chrono::steady_clock::now();
      const auto r = s.step(paratrain::Batch(ids.narrow(0, data.index * mine, mine),
                                             targets.narrow(0, data.index * mine, mine)),
                            loss);
      seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      // The mean over every replica's sequences: each replica's mean, weighted.
      auto mean = torch::tensor({r.loss * static_cast<double>(r.samples)}, torch::kDouble);
      s.all_reduce(mean, paratrain::reduce_op::sum);
      // Every tensor and context rank reported its replica's samples: each rank's mean, over
      // its positions under context parallelism.
      last = mean.item<double>() / (r.global_samples * s.mesh().size(paratrain::Dims{paratrain::Dim::tensor,
                                                                                     paratrain::Dim::context}));
      if (s.rank() == 0) std::printf("step %d loss %.8f\n", step + 1, last);
    }
    // The median step, the first left out (it allocates); the slowest rank's.
    std::sort(seconds.begin() + (seconds.size() > 1 ? 1 : 0), seconds.end());
    auto median = torch::tensor({seconds[(seconds.size() + (seconds.size() > 1 ? 1 : 0)) / 2]}, torch::kDouble);
    s.all_reduce(median, paratrain::reduce_op::max);
    const auto all_to_all = s.expert_group().traffic().all_to_all_bytes / std::max(run.steps, 1);
    const auto parameters = [&] {
      std::int64_t n = 0;
      for (const auto& p : s.full_parameters()) n += p.numel();
      return n;
    }();
    // The model state rank 0 holds between steps (parameters, gradients, optimizer state), and
    // what the plan says of it (without its padding bound).
    const auto held = s.model_state_bytes();
    const auto planned = s.planned_peak().states;
    if (s.rank() == 0)
      std::printf("{\"example\": \"gpt\", \"ranks\": %d, \"tensor_parallel\": %d, \"sequence_parallel\": %s, "
                  "\"experts\": %d, \"expert_parallel\": %d, \"context_parallel\": %d, \"steps\": %d, \"loss\": %.8f, "
                  "\"parameters_per_rank\": %lld, \"step_ms\": %.3f, \"all_to_all_bytes_per_step\": %lld, "
                  "\"gradient_bytes_per_step\": %lld, \"model_state_bytes\": %lld, \"planned_state_bytes\": %.0f}\n",
                  s.world_size(), run.tensor_parallel, run.sequence_parallel ? "true" : "false", run.model.experts,
                  run.expert_parallel, run.context_parallel, run.steps, last, static_cast<long long>(parameters),
                  1e3 * median.item<double>(), static_cast<long long>(all_to_all),
                  static_cast<long long>(s.gradient_bytes_sent()), static_cast<long long>(held.total()),
                  planned.parameters + planned.gradients + planned.optimizer_state);
    return 0;
  });
}
