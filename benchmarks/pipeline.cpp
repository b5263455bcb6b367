// The pipeline bubble: each schedule's measured idle share per stage beside its theory,
// and the activation memory GPipe and 1F1B keep, at K = 2 pipeline ranks.
//
// Model: an MLP of 2L x Linear(width, width) + ReLU cut into two stages of L layers (the
// second with a Linear(width, 10) head); interleaved 1F1B cuts it into four stages of L/2,
// two per rank. Micro-batches of `micro` random samples, M = 1, 2, 4, 8, 16 per step, SGD.
// One rank per core, one intra-op thread each. Each step starts behind a barrier; a
// rank's bubble is 1 - (its seconds computing) / (the slowest rank's span of the step),
// the median over the timed steps. Theory: (K-1)/(M+K-1) for GPipe and 1F1B,
// (K-1)/(vM+K-1) for interleaved (M a multiple of K), and for ZB-H1 Qi et al.'s
// (K-1)(F+B-W) idle per rank with the F, B and W this run measured
// (pipeline::theoretical_bubble). Memory: the most bytes glibc's heap held above the
// step's start, sampled every 100 us while the step runs (separate steps from the timed ones).
//   scripts/mpirun.sh 2 build/benchmarks/bench_pipeline [width 1024] [L 4] [micro 16] [steps 7]
#include <malloc.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "cli.hpp"
#include "driver.hpp"
#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/pipeline/schedule.hpp"
#include "paratrain/pipeline/schedule_simulation.hpp"
#include "paratrain/pipeline/pipeline.hpp"

namespace {

namespace pipeline = paratrain::pipeline;
using paratrain::Pipeline;

struct Shape {
  std::int64_t width = 1024;
  int layers = 4;  // per stage of the two-stage cut
  std::int64_t micro = 16;
  int steps = 7;
};

// `shift` (first stage only) makes the first layer compute its input's gradient too, as
// every later stage's first layer does for the stage before it: balanced stages, which
// is what the theory assumes.
struct BlockImpl : torch::nn::Module {
  BlockImpl(std::int64_t width, int layers, bool first = false) {
    if (first) shift = register_parameter("shift", torch::zeros({width}));
    for (int i = 0; i < layers; ++i) {
      seq->push_back(torch::nn::Linear(width, width));
      seq->push_back(torch::nn::ReLU());
    }
    register_module("seq", seq);
  }
  torch::Tensor forward(torch::Tensor x) { return seq->forward(shift.defined() ? x + shift : x); }
  torch::nn::Sequential seq;
  torch::Tensor shift;
};
TORCH_MODULE(Block);

struct LastImpl : torch::nn::Module {
  LastImpl(std::int64_t width, int layers) : block(width, layers), head(width, 10) {
    register_module("block", block);
    register_module("head", head);
  }
  torch::Tensor forward(torch::Tensor x) { return head(block(x)); }
  Block block;
  torch::nn::Linear head;
};
TORCH_MODULE(Last);

double now_in_use() {
  const auto m = mallinfo2();
  return static_cast<double>(m.uordblks + m.hblkhd);
}

struct Row {
  double bubble[2] = {0, 0};  // per rank: median over steps
  double theory = 0;
  double costs[3] = {0, 0, 0};  // mean F, B (whole, or input half), W seconds
  int peak_stashed = 0;
  double peak_mib = 0;
  double step_ms = 0;
};


template <class P>
Row measure(P stages, pipeline::Kind kind, int v, int M, const Shape& shape, paratrain::comm::Mpi& world) {
  paratrain::DataParallel<P, paratrain::comm::Mpi, torch::optim::SGD> s(std::move(stages), world, torch::optim::SGDOptions(1e-3),
                                                     {.schedule = kind, .virtual_stages = v});
  torch::manual_seed(1);
  std::vector<paratrain::Batch> batches;
  for (int m = 0; m < M; ++m)
    batches.push_back({torch::randn({shape.micro, shape.width}), torch::randint(0, 10, {shape.micro}, torch::kLong)});
  const auto loss = [](const torch::Tensor& out, const torch::Tensor& y) {
    return torch::nn::functional::cross_entropy(out, y);
  };
  const auto step = [&] {
    world.barrier();
    s.step(std::span<const paratrain::Batch>(batches), loss);
  };
  step();  // warm-up
  Row row;
  std::vector<double> bubbles, spans;
  double sums[4] = {0, 0, 0, 0};
  int counts[4] = {0, 0, 0, 0};
  for (int t = 0; t < shape.steps; ++t) {
    step();
    const auto& st = s.last_step_stats();
    const double makespan = paratrain::bench::max_over_ranks(world.native(), st.span_seconds);
    bubbles.push_back(1 - st.busy_seconds() / makespan);
    spans.push_back(makespan);
    for (int k = 0; k < 4; ++k) sums[k] += st.seconds[k], counts[k] += st.count[k];
    row.peak_stashed = std::max(row.peak_stashed, st.peak_stashed);
  }
  // Every rank's median bubble, to rank 0.
  auto mine = torch::zeros({2}, torch::kDouble);
  mine[world.rank()] = paratrain::bench::median(bubbles);
  world.all_reduce(mine, paratrain::reduce_op::sum);
  row.bubble[0] = mine[0].item<double>(), row.bubble[1] = mine[1].item<double>();
  row.step_ms = 1e3 * paratrain::bench::median(spans);
  // Costs: forward, backward (or its input half), weight half; averaged over the ranks.
  auto c = torch::tensor({sums[0] / std::max(1, counts[0]),
                          (sums[1] + sums[2]) / std::max(1, counts[1] + counts[2]),
                          sums[3] / std::max(1, counts[3])},
                         torch::kDouble);
  world.all_reduce(c, paratrain::reduce_op::sum);
  for (int k = 0; k < 3; ++k) row.costs[k] = c[k].item<double>() / world.size();
  const int K = world.size();
  // The published formula (pipeline::theoretical_bubble) where it holds; the schedule's
  // simulation with the measured costs where it does not: ZB-H1's closed form assumes
  // W <= F, and interleaved 1F1B at M < K runs chunk by chunk (schedule_for).
  // A whole backward (no W measured) is cost_of(backward) = backward_input + backward_weight:
  // split it in halves, so that the simulation charges it once.
  const bool split = row.costs[2] > 0;
  const pipeline::Costs costs{row.costs[0], split ? row.costs[1] : row.costs[1] / 2,
                              split ? row.costs[2] : row.costs[1] / 2};
  const bool formula = kind == pipeline::Kind::gpipe || kind == pipeline::Kind::one_f_one_b ||
                       (kind == pipeline::Kind::interleaved_1f1b && M % K == 0);
  if (formula) {
    row.theory = pipeline::theoretical_bubble(kind, K, M, v, costs);
  } else {
    const auto sim = pipeline::simulate(s.schedule_for(M), costs);
    row.theory = (sim.bubble[0] + sim.bubble[1]) / 2;
  }
  // Memory: separate steps, sampled from a thread while each runs.
  if (kind == pipeline::Kind::gpipe || kind == pipeline::Kind::one_f_one_b) {
    double peak = 0;
    for (int t = 0; t < 3; ++t) {
      world.barrier();
      const double base = now_in_use();
      std::atomic<bool> done{false};
      std::atomic<double> high{base};
      std::thread sampler([&] {
        while (!done.load()) {
          const double u = now_in_use();
          if (u > high.load()) high.store(u);
          std::this_thread::sleep_for(std::chrono::microseconds(100));
        }
      });
      s.step(std::span<const paratrain::Batch>(batches), loss);
      done = true;
      sampler.join();
      peak = std::max(peak, high.load() - base);
    }
    row.peak_mib = paratrain::bench::max_over_ranks(world.native(), peak) / (1 << 20);
  }
  return row;
}

const char* name_of(pipeline::Kind k) {
  switch (k) {
    case pipeline::Kind::gpipe: return "GPipe";
    case pipeline::Kind::one_f_one_b: return "1F1B";
    case pipeline::Kind::interleaved_1f1b: return "interleaved 1F1B (v=2)";
    case pipeline::Kind::zero_bubble_h1: return "ZB-H1";
  }
  return "?";
}

}  // namespace

int main(int argc, char** argv) {
  paratrain::comm::Mpi::Environment env(argc, argv);
  torch::set_num_threads(1);
  Shape shape;
  CLI::App app("bench_pipeline: each schedule's bubble on 2 ranks against theory, and activation memory");
  app.add_option("--width", shape.width, "the layers' width")->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20))->capture_default_str();
  app.add_option("--layers", shape.layers, "layers L per stage (the MLP has 2L; even: interleaved 1F1B cuts L / 2)")->check(CLI::Range(2, 4096))->capture_default_str();
  app.add_option("--micro", shape.micro, "samples per micro-batch")->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20))->capture_default_str();
  app.add_option("--steps", shape.steps, "timed steps")->check(CLI::Range(1, 1 << 20))->capture_default_str();
  if (const auto status = paratrain::bench::parse(app, argc, argv)) return *status;
  paratrain::comm::Mpi world;
  if (world.size() != 2 || shape.layers % 2 != 0) {
    if (world.rank() == 0) std::fprintf(stderr, "bench_pipeline runs on 2 ranks, with an even L\n");
    return 2;
  }
  const auto w = shape.width;
  const int L = shape.layers, half = L / 2;
  using Two = Pipeline<Block, Last>;
  using Four = Pipeline<Block, Block, Block, Last>;
  if (world.rank() == 0)
    std::printf("| schedule | M | bubble rank 0 | bubble rank 1 | theory | measured / theory | peak stashed | "
                "peak activation MiB | step ms | F / B / W ms |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
  for (const auto kind : {pipeline::Kind::gpipe, pipeline::Kind::one_f_one_b, pipeline::Kind::interleaved_1f1b,
                          pipeline::Kind::zero_bubble_h1})
    for (int M : {1, 2, 4, 8, 16}) {
      const Row r = kind == pipeline::Kind::interleaved_1f1b
                        ? measure(Four([=] { return Block(w, half, true); }, [=] { return Block(w, half); },
                                       [=] { return Block(w, half); }, [=] { return Last(w, half); }),
                                  kind, 2, M, shape, world)
                        : measure(Two([=] { return Block(w, L, true); }, [=] { return Last(w, L); }), kind, 1, M, shape,
                                  world);
      const double mean = (r.bubble[0] + r.bubble[1]) / 2;
      if (world.rank() == 0) {
        char w_ms[32] = "—";
        if (r.costs[2] > 0) std::snprintf(w_ms, sizeof w_ms, "%.1f", 1e3 * r.costs[2]);
        std::printf("| %s | %d | %.3f | %.3f | %.3f | %.2f | %d | %s | %.1f | %.1f / %.1f / %s |\n", name_of(kind), M,
                    r.bubble[0], r.bubble[1], r.theory, r.theory > 0 ? mean / r.theory : 0.0, r.peak_stashed,
                    r.peak_mib > 0 ? std::to_string(static_cast<int>(r.peak_mib + 0.5)).c_str() : "—", r.step_ms,
                    1e3 * r.costs[0], 1e3 * r.costs[1], w_ms);
        std::fflush(stdout);
      }
    }
  return 0;
}
