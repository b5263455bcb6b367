// Context-parallel attention with the context group the whole world: run at 1, 2 and 4
// ranks (scripts/bench.sh context_attention). Per rank:
//  - the bytes attention keeps for backward, counted at the allocator
//    (memory::CountingCpuAllocator) beside plan::attention_activations, for ring and
//    all-to-all attention;
//  - forward and backward of ring attention with its exchanges overlapped and one after the
//    other, and those exchanges alone (3cp-2 passes of a key-value block, Note [Ring
//    attention]); the share of a step its exchanges leave exposed is exchanges / sequential
//    without overlap and (overlapped - (sequential - exchanges)) / overlapped with it;
//  - causal ring attention in the contiguous and zigzag layouts (the slowest rank's time:
//    Note [Sequence layouts]).
// Times are the slowest rank's, median of 5 trials. The allocator: glibc with paratrain's
// settings (memory::install(), as DataParallel makes them: M_MMAP_THRESHOLD 64 MiB,
// M_TRIM_THRESHOLD 2 GiB) at every degree.
#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "cli.hpp"
#include "driver.hpp"
#include "paratrain/comm/mesh.hpp"
#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/context/ring_attention.hpp"
#include "paratrain/memory/allocator.hpp"
#include "paratrain/memory/counting_allocator.hpp"
#include "paratrain/plan/plan.hpp"

namespace {

namespace cp = paratrain::cp;
namespace tp = paratrain::tp;

struct Shape {
  std::int64_t batch = 1, sequence = 4096, heads = 8, width = 64;
};

double mib(double bytes) { return bytes / (1 << 20); }

}  // namespace

int main(int argc, char** argv) {
  paratrain::comm::Mpi::Environment env(argc, argv);
  Shape x;
  int iterations = 3;
  CLI::App app("context_attention: ring and all-to-all attention over the world as a context group");
  app.add_option("--batch", x.batch, "sequences (b)");
  app.add_option("--sequence", x.sequence, "positions of a whole sequence (s)");
  app.add_option("--heads", x.heads, "heads (a)");
  app.add_option("--width", x.width, "head width (d)");
  app.add_option("--iterations", iterations, "forward-backward passes a trial");
  if (const auto status = paratrain::bench::parse(app, argc, argv)) return *status;

  paratrain::comm::Mpi world;
  (void)paratrain::memory::install();
  const int n = world.size();
  paratrain::Mesh<paratrain::comm::Mpi> mesh(paratrain::comm::Mpi(), {.context = n});
  const tp::Group g(mesh, paratrain::Dim::context);
  const auto local = x.sequence / n;
  const auto drawn = [&] { return torch::randn({x.batch, local, x.heads, x.width}).requires_grad_(); };
  const auto q = drawn(), k = drawn(), v = drawn();
  const auto pass = [&](const cp::AttentionOptions& o) {
    cp::attention(q, k, v, g, o).sum().backward();
    q.mutable_grad().reset(), k.mutable_grad().reset(), v.mutable_grad().reset();
  };

  if (world.rank() == 0)
    std::printf("\ncontext-parallel attention, cp = %d: b %lld, s %lld, a %lld, d %lld, float32\n\n"
                "| algorithm | kept for backward | planned | measured / planned | peak of forward and backward |\n"
                "|---|---:|---:|---:|---:|\n",
                n, static_cast<long long>(x.batch), static_cast<long long>(x.sequence),
                static_cast<long long>(x.heads), static_cast<long long>(x.width));
  for (const auto algorithm : {cp::Algorithm::all_to_all, cp::Algorithm::ring}) {
    if (algorithm == cp::Algorithm::all_to_all && x.heads % n != 0) continue;
    const bool ring = algorithm == cp::Algorithm::ring;
    double kept = 0, peak = 0;
    {
      paratrain::memory::CountingCpuAllocator::Scope scope;
      auto out = cp::attention(q, k, v, g, {.algorithm = algorithm});
      kept = static_cast<double>(scope.live());
      out.sum().backward();
      peak = static_cast<double>(scope.peak());
    }
    q.mutable_grad().reset(), k.mutable_grad().reset(), v.mutable_grad().reset();
    kept = paratrain::bench::max_over_ranks(world.native(), kept);
    peak = paratrain::bench::max_over_ranks(world.native(), peak);
    const double planned = paratrain::plan::attention_activations(
        {.sequence = double(x.sequence), .batch = double(x.batch), .heads = double(x.heads),
         .head_width = double(x.width), .context = n, .ring = ring});
    if (world.rank() == 0)
      std::printf("| %s | %.1f MiB | %.1f MiB | %.3f | %.1f MiB |\n", ring ? "ring" : "all-to-all", mib(kept),
                  mib(planned), kept / planned, mib(peak));
  }

  // Ring attention's exchanges alone: what forward and backward pass, key-value blocks.
  const auto block = torch::randn({2, x.batch, x.heads, local, x.width});
  const auto exchanges = [&] {
    for (int i = 0; i < 3 * n - 2; ++i) (void)g.shift_async(block).wait();
  };
  const auto seconds = paratrain::bench::time_alternating(
      world.native(), /*trials=*/5, iterations,
      {[&] { pass({.overlap = true}); }, [&] { pass({.overlap = false}); }, exchanges,
       [&] { pass({.causal = true, .layout = cp::Layout::contiguous}); },
       [&] { pass({.causal = true, .layout = cp::Layout::zigzag}); }});
  if (world.rank() == 0) {
    const double overlapped = seconds[0], sequential = seconds[1], alone = n > 1 ? seconds[2] : 0.0;
    const double compute = sequential - alone;
    std::printf("\n| ring, cp = %d | overlapped | sequential | exchanges alone | exposed, sequential | exposed, "
                "overlapped | causal, contiguous | causal, zigzag | zigzag / contiguous |\n"
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
                "| forward + backward | %.1f ms | %.1f ms | %.1f ms | %.1f%% | %.1f%% | %.1f ms | %.1f ms | %.2f |\n",
                n, overlapped * 1e3, sequential * 1e3, alone * 1e3, 100 * alone / sequential,
                100 * std::max(0.0, overlapped - compute) / overlapped, seconds[3] * 1e3, seconds[4] * 1e3,
                seconds[4] / seconds[3]);
  }
}
