#pragma once
// The tensor-parallelism benchmark's model, options and measurement (tensor_parallel.cpp over
// MPI, tensor_parallel_rendezvous.cpp over Gloo or NCCL): a stack of paratrain::tp::TransformerBlock
// at tensor degree = the world size, trained with SGD and momentum on one fixed batch (mean
// squared error against a fixed target), built from the seed as
// benchmarks/tensor_parallel_vs_dtensor.py builds its blocks, so both sides start from the same
// weights. One JSON line: the slowest rank's mean step time over the timed steps, the first and
// last losses, the tensor group's bytes per step by collective (Note [Tensor groups]),
// parameters per rank, peak RSS. With --weights-out, rank 0 writes every parameter whole
// (float32, named_parameters() order) and a JSON index, as the Python side does, for
// benchmarks/compare_weights.py.
#include <torch/torch.h>

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>

#include "cli.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/tensor_parallel/regions.hpp"
#include "paratrain/tensor_parallel/sharding.hpp"
#include "paratrain/tensor_parallel/transformer_block.hpp"

namespace paratrain::bench::tensor_parallel {

namespace tp = paratrain::tp;

struct Run {
  int steps = 20, warmup = 5, layers = 4;
  std::int64_t batch = 8, seq = 64, hidden = 256, heads = 8, ffn = 1024;
  double lr = 0.01, momentum = 0.9;
  std::uint64_t seed = 1;
  bool sequence_parallel = false;
  std::string weights_out;

  void add_to(CLI::App& app) {
    app.add_option("--steps", steps, "steps in all")->capture_default_str();
    app.add_option("--warmup", warmup, "first steps left out of the timing")->capture_default_str();
    app.add_option("--layers", layers, "blocks")->capture_default_str();
    app.add_option("--batch", batch, "sequences per step")->capture_default_str();
    app.add_option("--seq", seq, "tokens per sequence")->capture_default_str();
    app.add_option("--hidden", hidden, "features")->capture_default_str();
    app.add_option("--heads", heads, "attention heads")->capture_default_str();
    app.add_option("--ffn", ffn, "the MLP's inner features")->capture_default_str();
    app.add_option("--lr", lr, "SGD's learning rate")->capture_default_str();
    app.add_option("--momentum", momentum, "SGD's momentum")->capture_default_str();
    app.add_option("--seed", seed, "the weights' seed (the data's: seed + 1)")->capture_default_str();
    app.add_flag("--sequence-parallel", sequence_parallel, "cut the activations between blocks along the sequence");
    app.add_option("--weights-out", weights_out, "rank 0 writes the final weights here (and a .json index)");
  }
};

struct StackImpl : torch::nn::Module {
  explicit StackImpl(const Run& r) {
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < r.layers; ++i)
      blocks->push_back(tp::TransformerBlock(tp::TransformerBlockOptions(r.hidden, r.heads).ffn(r.ffn)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& b : *blocks) x = b->as<tp::TransformerBlockImpl>()->forward(x);
    return x;
  }
  torch::nn::ModuleList blocks{nullptr};
};
TORCH_MODULE(Stack);

inline double peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

/// Trains the stack over `world` (tensor degree = its size) on `device` as `run` says and
/// prints the JSON line from rank 0. `sync` waits for the device before a clock is read.
template <class Comm>
int measure(Comm world, const torch::Device& device, const Run& run, const char* communicator,
            const std::function<void()>& sync = [] {}) {
  at::set_num_threads(1);
  const int ranks = world.size(), rank = world.rank();
  torch::manual_seed(run.seed);
  using Strategy = paratrain::DataParallel<Stack, Comm, torch::optim::SGD>;
  Strategy s(
      [&] {
        Stack stack(run);
        stack->to(device);
        return stack;
      },
      world, torch::optim::SGDOptions(run.lr).momentum(run.momentum),
      {.tensor_parallel = ranks, .sequence_parallel = run.sequence_parallel});
  torch::manual_seed(run.seed + 1);
  const auto x = torch::randn({run.batch, run.seq, run.hidden}), target = torch::randn({run.batch, run.seq, run.hidden});
  const auto group = s.tensor_group();
  // Under sequence parallelism the blocks take and give this rank's sequence shard.
  const auto mine = [&](const torch::Tensor& t) {
    return (run.sequence_parallel ? group.part(t, 1) : t).contiguous().to(device);
  };
  const paratrain::Batch batch(mine(x), mine(target));
  const auto loss = [&](const torch::Tensor& out, const torch::Tensor& y) {
    auto l = torch::nn::functional::mse_loss(out, y);
    if (!run.sequence_parallel || ranks == 1) return l;
    // Each rank holds 1/t of the tokens: the whole batch's mean is the mean of the ranks'
    // means, whose gradients are then each rank's own (Note [Regions]: a reduce whose
    // backward is the identity).
    return tp::reduce_from_region(l, group) / static_cast<double>(ranks);
  };

  double first = 0, last = 0, seconds = 0;
  group.reset_traffic();
  for (int i = 0; i < run.steps; ++i) {
    if (i == run.warmup) group.reset_traffic();
    world.barrier();
    sync();
    const auto start = std::chrono::steady_clock::now();
    const auto r = s.step(batch, loss);  // reads the loss: the step is complete
    sync();
    const auto took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (i >= run.warmup) seconds += took;
    if (i == 0) first = r.loss;
    last = r.loss;
  }
  const int timed = run.steps - run.warmup;
  const auto traffic = group.traffic();
  auto slowest = torch::tensor({seconds / std::max(1, timed)}, torch::kDouble).to(device);
  world.all_reduce(slowest, paratrain::reduce_op::max);
  std::int64_t local_parameters = 0;
  for (const auto& p : s.model()->parameters()) local_parameters += p.numel();

  // Every parameter whole on rank 0: the sharded ones gathered along their dimension.
  const auto shards = tp::sliced_parameters_of(*s.model());
  std::ofstream bin, index;
  if (rank == 0 && !run.weights_out.empty()) {
    bin.open(run.weights_out, std::ios::binary);
    index.open(run.weights_out + ".json");
    index << "[";
  }
  std::int64_t whole_parameters = 0;
  bool comma = false;
  for (const auto& p : s.model()->named_parameters()) {
    at::Tensor w = p.value().detach();
    if (const auto it = shards.find(p.key()); it != shards.end()) w = group.all_gather(w, it->second.slice.dim);
    whole_parameters += w.numel();
    if (!bin.is_open()) continue;
    const at::Tensor c = w.contiguous().to(torch::kFloat).cpu();
    bin.write(reinterpret_cast<const char*>(c.data_ptr<float>()), static_cast<std::streamsize>(c.numel() * 4));
    index << (comma ? ", " : "") << "{\"name\": \"" << p.key() << "\", \"shape\": [";
    for (std::int64_t d = 0; d < c.dim(); ++d) index << (d ? ", " : "") << c.size(d);
    index << "]}";
    comma = true;
  }
  if (index.is_open()) index << "]\n";
  if (rank == 0)
    std::printf(
        "{\"implementation\": \"paratrain\", \"torch\": \"%d.%d\", \"communicator\": \"%s\", \"device\": \"%s\", "
        "\"world_size\": %d, \"tensor_parallel\": %d, "
        "\"sequence_parallel\": %s, \"layers\": %d, \"hidden\": %lld, \"heads\": %lld, \"ffn\": %lld, \"batch\": %lld, "
        "\"seq\": %lld, \"steps\": %d, \"warmup\": %d, \"ms_per_step\": %.3f, \"parameters\": %lld, "
        "\"parameters_per_rank\": %lld, \"loss_first\": %.8g, \"loss_last\": %.8g, \"all_reduce_bytes_per_step\": %lld, "
        "\"all_gather_bytes_per_step\": %lld, \"reduce_scatter_bytes_per_step\": %lld, \"bus_bytes_per_step\": %.0f, "
        "\"peak_rss_mb\": %.1f}\n",
        TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, communicator, device.is_cuda() ? "cuda" : "cpu", ranks, ranks,
        run.sequence_parallel ? "true" : "false", run.layers, static_cast<long long>(run.hidden),
        static_cast<long long>(run.heads), static_cast<long long>(run.ffn), static_cast<long long>(run.batch),
        static_cast<long long>(run.seq), run.steps, run.warmup, 1e3 * slowest.item<double>(),
        static_cast<long long>(whole_parameters), static_cast<long long>(local_parameters), first, last,
        static_cast<long long>(traffic.all_reduce_bytes / std::max(1, timed)),
        static_cast<long long>(traffic.all_gather_bytes / std::max(1, timed)),
        static_cast<long long>(traffic.reduce_scatter_bytes / std::max(1, timed)),
        traffic.bus_bytes() / std::max(1, timed), peak_rss_mb());
  return 0;
}

}  // namespace paratrain::bench::tensor_parallel
