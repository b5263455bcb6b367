#pragma once
// The run of bench_zero (zero.cpp, over MPI) and bench_zero_rendezvous (zero_rendezvous.cpp,
// NCCL on GPUs or Gloo on the CPU): DataParallel at one ZeRO stage on the model and data of
// benchmarks/zero_vs_torch.py, timed, with what it holds, what paratrain::plan predicts and
// the peak memory. Prints one JSON line on rank 0.
//
// MLP of `layers` x Linear(2048, 2048) with ReLU and a Linear(2048, 10) head, each layer a
// paratrain::Unit; Adam(lr 1e-4); cross-entropy; batch 32 per rank of random inputs and
// labels, made on the model's device (the step is measured, not the input pipeline).
#include <sys/resource.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>

#include "paratrain/memory/counting_allocator.hpp"
#include "paratrain/memory/usage.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/plan/plan.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "paratrain/strategy/unit.hpp"
#include "cli.hpp"
#include "timing.hpp"
#include "wide_mlp.hpp"

namespace paratrain::bench {

struct ZeroRun {
  std::string strategy = "ddp";  // ddp, zero1, zero2 or zero3
  int layers = 4, steps = 30, warmup = 3;
  bool bf16 = false;  // forward under bf16 autocast (and ZeRO-3's gathers: Note [Gathers in the compute type])
  /// Where rank 0's peak goes: its tensors' peak, counted at LibTorch's allocator, and its
  /// resident memory after the steps by kind (memory::usage), each above the baseline.
  bool breakdown = false;

  /// Its options (bench_zero's and bench_zero_rendezvous's).
  void add_to(CLI::App& app) {
    app.add_option("--strategy", strategy, "ddp, zero1, zero2 or zero3")
        ->check(CLI::IsMember({"ddp", "zero1", "zero2", "zero3"}))
        ->capture_default_str();
    app.add_option("--layers", layers, "wide layers of the MLP (wide_mlp.hpp)")->check(CLI::Range(1, 4096))->capture_default_str();
    app.add_option("--steps", steps, "timed steps")->check(CLI::Range(1, 1 << 20))->capture_default_str();
    app.add_option("--warmup", warmup, "steps before the timed ones")->check(CLI::Range(0, 1 << 20))->capture_default_str();
    app.add_flag("--bf16", bf16, "forward under bf16 autocast (and ZeRO-3's units gathered in bf16)");
    app.add_flag("--breakdown", breakdown,
                 "rank 0's peak by kind: tensors (counted at the allocator), heap in use and free, shared memory, ...");
  }
};

/// This process's peak resident set, MiB.
inline double peak_rss_mib() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;  // Linux: KiB
}

/// This process's resident set now, MiB (VmRSS).
inline double rss_mib() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  return 0;
}

/// Calls `f.template operator()<Update>(stage)` with the update `strategy` names (ddp,
/// zero1, zero2, zero3; Adam underneath); false for a name it does not know.
template <class F>
bool with_zero_stage(std::string_view strategy, F&& f) {
  using Adam = torch::optim::Adam;
  using paratrain::plan::stage;
  namespace zero = paratrain::zero;
  if (strategy == "ddp") return f.template operator()<Adam>(stage::ddp), true;
  if (strategy == "zero1") return f.template operator()<Sharded<Adam, zero::stage1>>(stage::stage1), true;
  if (strategy == "zero2") return f.template operator()<Sharded<Adam, zero::stage2>>(stage::stage2), true;
  if (strategy == "zero3") return f.template operator()<Sharded<Adam, zero::stage3>>(stage::stage3), true;
  return false;
}

/// One configuration over `world`, the model on `device`. `extra()` is called on every rank
/// after the timed steps (it may be collective) and its text, ", \"key\": value" pairs, ends
/// rank 0's JSON line.
template <class Update, class Comm, class Extra>
void run_zero(Comm world, const torch::Device& device, const Ranks& ranks, const ZeroRun& run,
              paratrain::plan::stage stage, const char* communicator, Extra&& extra) {
  constexpr std::int64_t batch = 32, pool = 8;
  const int rank = world.rank(), size = world.size();
  torch::manual_seed(1 + rank);
  const auto x = torch::randn({pool * batch, wide_mlp_width}).to(device);
  const auto y = torch::randint(0, 10, {pool * batch}, torch::kLong).to(device);
  // The baseline: the process before the model (LibTorch's pools started by one operation).
  (void)torch::mm(x.narrow(0, 0, batch), x.narrow(0, 0, batch).t()).sum().item<float>();
  const double base = rss_mib();
  const double baseline = ranks.max(base);
  const auto usage_before = paratrain::memory::usage();
  std::optional<paratrain::memory::CountingCpuAllocator::Scope> counting;
  if (run.breakdown) counting.emplace();
  // Built by the strategy: at stage 3 sharded as it is built (Note [Sharded construction]).
  torch::manual_seed(7);
  DataParallel<WideMlp, Comm, Update> s([&] { return WideMlp(run.layers); }, std::move(world),
                                        torch::optim::AdamOptions(1e-4),
                                        {.precision = {.autocast = run.bf16 ? std::optional(at::kBFloat16) : std::nullopt},
                                         .build = {.device = device}});
  const double construction = ranks.max(peak_rss_mib() - base);
  torch::manual_seed(1 + rank);
  const auto loss = [](const torch::Tensor& out, const torch::Tensor& target) {
    return torch::nn::functional::cross_entropy(out, target);
  };
  std::int64_t next = 0;
  double exposed = 0;  // seconds blocked on communication: gradients after backward, ZeRO's gathers
  int calls = 0;       // steps that `exposed` sums over
  const auto step = [&] {
    const auto start = (next++ % pool) * batch;
    s.step({x.narrow(0, start, batch), y.narrow(0, start, batch)}, loss);
    exposed += s.exposed_communication_seconds();
    ++calls;
  };
  for (int i = 0; i < run.warmup; ++i) step();
  exposed = 0, calls = 0;
  const auto seconds = time_alternating(ranks, 3, run.steps / 3, {step});
  const auto held = s.model_state_bytes();
  std::int64_t parameters = 0;
  for (const auto& p : s.model()->parameters()) parameters += p.numel();
  const auto planned = paratrain::plan::per_rank({.parameters = static_cast<double>(parameters),
                                                  .param_bytes = 4,
                                                  .grad_bytes = 4,
                                                  .optimizer_bytes = paratrain::plan::optimizer_bytes("adam"),
                                                  .ranks = size},
                                                 stage);
  const double rss = ranks.max(peak_rss_mib());  // the largest over the ranks
  const double above = ranks.max(peak_rss_mib() - base);
  const double plan_peak = s.planned_peak().total() / double(1 << 20);
  std::string more = extra();
  if (run.breakdown) {
    // Rank 0's own: its peak, its tensors' peak, and where its resident memory is now (the
    // heap keeps its high-water mark: Note [Allocator]), all above its baseline.
    const auto now = paratrain::memory::usage();
    const auto above_mib = [](std::int64_t a, std::int64_t b) { return double(a - b) / double(1 << 20); };
    char text[640];
    std::snprintf(text, sizeof text,
                  ", \"r0_peak_above_baseline_mib\": %.1f, \"r0_tensors_peak_mib\": %.1f, \"r0_resident_above_mib\": %.1f, "
                  "\"r0_heap_resident_mib\": %.1f, \"r0_anonymous_resident_mib\": %.1f, \"r0_shared_resident_mib\": %.1f, "
                  "\"r0_file_resident_mib\": %.1f, \"r0_heap_in_use_mib\": %.1f, \"r0_heap_free_mib\": %.1f, "
                  "\"r0_heap_mapped_mib\": %.1f",
                  above_mib(now.peak_resident, usage_before.resident), double(counting->peak()) / double(1 << 20),
                  above_mib(now.resident, usage_before.resident),
                  above_mib(now.heap_resident, usage_before.heap_resident),
                  above_mib(now.anonymous_resident, usage_before.anonymous_resident),
                  above_mib(now.shared_resident, usage_before.shared_resident),
                  above_mib(now.file_resident, usage_before.file_resident),
                  above_mib(now.heap_in_use, usage_before.heap_in_use), above_mib(now.heap_free, usage_before.heap_free),
                  above_mib(now.heap_mapped, usage_before.heap_mapped));
    more += text;
  }
  const double mib = 1 << 20;
  if (rank == 0)
    std::printf(
        "{\"implementation\": \"paratrain\", \"strategy\": \"%s\", \"communicator\": \"%s\", \"device\": \"%s\", "
        "\"ranks\": %d, \"layers\": %d, \"parameters\": %lld, \"batch_per_rank\": %lld, \"steps\": %d, "
        "\"steps_per_s\": %.3f, \"peak_rss_mib\": %.1f, \"exposed_comm_share\": %.3f, \"held_mib\": %.1f, "
        "\"planned_mib\": %.1f, \"baseline_mib\": %.1f, \"peak_above_baseline_mib\": %.1f, \"plan_peak_mib\": %.1f, "
        "\"construction_above_baseline_mib\": %.1f, \"bf16\": %s%s}\n",
        std::string(run.strategy).c_str(), communicator, device.str().c_str(), size, run.layers,
        static_cast<long long>(parameters), static_cast<long long>(batch), run.steps / 3 * 3, 1 / seconds[0], rss,
        exposed / double(calls) / seconds[0], double(held.total()) / mib, planned.total() / mib, baseline, above,
        plan_peak, construction, run.bf16 ? "true" : "false", more.c_str());
  std::fflush(stdout);
}

}  // namespace paratrain::bench
