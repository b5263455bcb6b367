#pragma once
// The equivalence harness of the DataParallel tests: a small MLP, synthetic data split
// into per-rank batches, plain-LibTorch single-device training on the union of the
// ranks' batches (the independent reference), and the same training through
// paratrain::DataParallel over any communicator.
#include <torch/torch.h>

#include <algorithm>
#include <vector>

#include "paratrain/data/batch.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "support/doctest.hpp"

namespace paratrain_test {

namespace F = torch::nn::functional;

struct Features {
  bool unused_parameter = false;  // a head that forward never uses
  bool buffer = false;            // a buffer forward reads, different on each rank before the broadcast
};

struct MlpImpl : torch::nn::Module {
  MlpImpl(Features f, int rank) : features(f) {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
    if (f.unused_parameter) head = register_module("head", torch::nn::Linear(16, 4));
    if (f.buffer) scale = register_buffer("scale", torch::full({8}, 1.0 + 0.25 * rank));
  }
  torch::Tensor forward(torch::Tensor x) {
    if (features.buffer) x = x * scale;
    return fc2(torch::tanh(fc1(x)));
  }
  Features features;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, head{nullptr};
  torch::Tensor scale;
};
TORCH_MODULE(Mlp);

inline Mlp make_model(Features f, int rank) {
  torch::manual_seed(1234 + rank);
  return Mlp(f, rank);
}

inline torch::Tensor loss_fn(const torch::Tensor& out, const torch::Tensor& target) { return F::cross_entropy(out, target); }

struct Scenario {
  int steps = 24;
  std::int64_t batch = 4;  // per rank
  int micro_batches = 1;   // gradient accumulation: micro-batches per step
  bool uneven = false;     // rank r has steps - r batches
  Features features;
  paratrain::DataParallelOptions options;
};

// The samples of rank r at step k: a fixed slice of one synthetic data set.
struct Data {
  torch::Tensor x, y;
  Data() {
    torch::manual_seed(99);
    x = torch::randn({4096, 8});
    y = torch::randint(0, 4, {4096}, torch::kLong);
  }
  [[nodiscard]] paratrain::Batch of(int world, int rank, int step, std::int64_t b) const {
    const auto start = (static_cast<std::int64_t>(step) * world + rank) * b;
    return {x.narrow(0, start, b), y.narrow(0, start, b)};
  }
};

inline int batches_of(const Scenario& s, int rank) { return s.uneven ? s.steps - rank : s.steps; }

template <class Optim, class Opts>
std::vector<torch::Tensor> reference(const Scenario& s, int world, Opts opts) {
  const Data data;
  auto model = make_model(s.features, 0);
  Optim optim(model->parameters(), opts);
  for (int k = 0; k < s.steps; ++k) {
    std::vector<torch::Tensor> xs, ys;
    for (int r = 0; r < world; ++r)
      if (k < batches_of(s, r)) {
        auto b = data.of(world, r, k, s.batch);
        xs.push_back(b.input);
        ys.push_back(b.target);
      }
    optim.zero_grad();
    loss_fn(model->forward(torch::cat(xs)), torch::cat(ys)).backward();
    optim.step();
  }
  return model->parameters();
}

template <class Comm, class Optim, class Opts>
std::vector<torch::Tensor> distributed(const Scenario& s, Comm c, Opts opts) {
  const Data data;
  const int world = c.size(), rank = c.rank();
  paratrain::DataParallel<Mlp, Comm, Optim> dp(make_model(s.features, rank), std::move(c), opts, s.options);
  const int mine = batches_of(s, rank);
  for (int k = 0;; ++k) {
    paratrain::StepResult r;
    if (k < mine) {
      auto b = data.of(world, rank, k, s.batch);
      const auto micro = s.batch / s.micro_batches;
      for (int m = 0; m + 1 < s.micro_batches; ++m)
        dp.accumulate({b.input.narrow(0, m * micro, micro), b.target.narrow(0, m * micro, micro)}, loss_fn);
      const auto last = (s.micro_batches - 1) * micro;
      r = dp.step({b.input.narrow(0, last, s.batch - last), b.target.narrow(0, last, s.batch - last)}, loss_fn,
                  k + 1 < mine);
    } else {
      r = dp.join();
    }
    if (r.ranks_with_next == 0) break;
  }
  return dp.model()->parameters();
}

inline double max_relative_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, ((a[i] - b[i]).abs().max() / b[i].abs().max().clamp_min(1e-12)).item<double>());
  return worst;
}

}  // namespace paratrain_test
