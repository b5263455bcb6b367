// The Transformer example's model trained under elastic::fit over Gloo, for
// benchmarks/elastic_restart.py: what a lost rank costs the Transformer without a restart. The
// example itself runs over MPI, which cannot recover in-process (Open MPI 4.1 has no ULFM).
// The ranks meet in PARATRAIN_STORE_FILE; the first rank started prints "step N/M" after each
// step, as the example does.
//
//   for r in 0 1; do PARATRAIN_STORE_FILE=/tmp/s RANK=$r WORLD_SIZE=2 bench_elastic_transformer & done
#include <torch/torch.h>

#include <cstdio>
#include <string>

#include "../examples/transformer/model.hpp"
#include "cli.hpp"
#include "paratrain/paratrain.hpp"

namespace {

using Strategy = paratrain::DataParallel<transformer::Transformer, paratrain::comm::Gloo, torch::optim::Adam>;

// The example's batches: inputs (src, tgt), target tgt (a cross-entropy over dim 1).
struct Rows {
  torch::Tensor src, tgt;
  [[nodiscard]] std::int64_t size() const { return src.size(0); }
  [[nodiscard]] paratrain::Batch get(const torch::Tensor& indices) const {
    auto t = tgt.index_select(0, indices);
    return paratrain::Batch({src.index_select(0, indices), t}, t);
  }
};

}  // namespace

int main(int argc, char** argv) {
  transformer::Config c{.d_model = 256, .nhead = 4, .encoder_layers = 2, .decoder_layers = 2, .dim_feedforward = 1024,
                        .samples = 16000};
  std::int64_t global_batch = 32, every = 50, steps = 100000;
  std::string checkpoint_dir = "elastic-transformer";
  CLI::App app("The Transformer example's model under elastic::fit over Gloo (benchmarks/elastic_restart.py)");
  app.add_option("--d-model", c.d_model)->capture_default_str();
  app.add_option("--heads", c.nhead)->capture_default_str();
  app.add_option("--ff", c.dim_feedforward)->capture_default_str();
  app.add_option("--samples", c.samples)->capture_default_str();
  app.add_option("--global-batch", global_batch, "samples per step over all ranks")->capture_default_str();
  app.add_option("--max-steps", steps)->capture_default_str();
  app.add_option("--checkpoint-dir", checkpoint_dir)->capture_default_str();
  app.add_option("--checkpoint-every", every)->capture_default_str();
  if (const auto status = paratrain::bench::parse(app, argc, argv)) return *status;
  return paratrain::main(argc, argv, [&] {
    torch::manual_seed(1);
    const Rows rows{torch::rand({c.samples, c.src_len, c.d_model}), torch::rand({c.samples, c.tgt_len, c.d_model})};
    auto make = [&c](paratrain::comm::Gloo& group) {
      return Strategy(transformer::Transformer(c), group, torch::optim::AdamOptions(1e-3));
    };
    const auto on_step = [steps](const paratrain::StepInfo& i) {
      if (paratrain::detect_placement().rank != 0) return;
      std::printf("step %lld/%lld: %.1f ms\n", static_cast<long long>(i.step) + 1, static_cast<long long>(steps),
                  1e3 * i.seconds);
      std::fflush(stdout);
    };
    paratrain::elastic::fit(make, rows,
                            {.epochs = 1000,
                             .batch_size = global_batch,
                             .global_batch_size = global_batch,
                             .max_steps = steps,
                             .progress = false,
                             .on_step = on_step,
                             .checkpoint = {.directory = checkpoint_dir, .every_steps = every}},
                            {}, paratrain::CrossEntropy{});
  });
}
