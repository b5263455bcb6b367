#pragma once
// The equivalence harness of the DataParallel tests (DDP and every ZeRO stage): a small
// MLP, synthetic data split into per-rank batches, plain-LibTorch single-device training
// on the union of the ranks' batches (the independent reference), and the same training
// through paratrain::DataParallel over any communicator and update policy.
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "paratrain/core/batch.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/strategy/recompute.hpp"
#include "paratrain/strategy/unit.hpp"
#include "support/doctest.hpp"

namespace paratrain_test {

namespace F = torch::nn::functional;

struct Features {
  bool unused_parameter = false;  // a head that forward never uses
  bool buffer = false;            // a buffer forward reads, different on each rank before the broadcast
};

// Its layers are ZeRO-3 units (paratrain::Unit): inert under every other strategy.
struct MlpImpl : torch::nn::Module {
  MlpImpl(Features f, int rank) : features(f) {
    fc1 = register_module("fc1", paratrain::Unit<torch::nn::Linear>(8, 16));
    fc2 = register_module("fc2", paratrain::Unit<torch::nn::Linear>(16, 4));
    if (f.unused_parameter) head = register_module("head", paratrain::Unit<torch::nn::Linear>(16, 4));
    if (f.buffer) scale = register_buffer("scale", torch::full({8}, 1.0 + 0.25 * rank));
  }
  torch::Tensor forward(torch::Tensor x) {
    if (features.buffer) x = x * scale;
    return fc2(torch::tanh(fc1(x)));
  }
  Features features;
  paratrain::Unit<torch::nn::Linear> fc1{nullptr}, fc2{nullptr}, head{nullptr};
  torch::Tensor scale;
};
TORCH_MODULE(Mlp);

// A dense layer, tanh after it or not: a block for paratrain::Recompute.
struct DenseImpl : torch::nn::Module {
  DenseImpl(std::int64_t in, std::int64_t out, bool tanh) : tanh(tanh) {
    linear = register_module("linear", torch::nn::Linear(in, out));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto y = linear(x);
    return tanh ? torch::tanh(y) : y;
  }
  bool tanh;
  torch::nn::Linear linear{nullptr};
};
TORCH_MODULE(Dense);

// Mlp's function and parameters (the same shapes, drawn in the same order from the same
// seed), each layer a ZeRO-3 unit whose activations are recomputed in backward.
struct RecomputedMlpImpl : torch::nn::Module {
  using Layer = paratrain::Unit<paratrain::Recompute<Dense>>;
  RecomputedMlpImpl(Features, int) {
    fc1 = register_module("fc1", Layer(8, 16, true));
    fc2 = register_module("fc2", Layer(16, 4, false));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(fc1(x)); }
  Layer fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(RecomputedMlp);

template <class Model = Mlp>
Model make_model(Features f, int rank) {
  torch::manual_seed(1234 + rank);
  return Model(f, rank);
}

// Autocast on the CPU as `with torch.autocast("cpu", dtype)` sets it, written out with
// LibTorch's own calls: the references' precision policy, independent of paratrain's
// AutocastScope. Nothing without a dtype.
class CpuAutocast {
 public:
  explicit CpuAutocast(std::optional<at::ScalarType> dtype) : on_(dtype.has_value()) {
    if (!on_) return;
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, *dtype);
#else
    at::autocast::set_cpu_enabled(true);
    at::autocast::set_autocast_cpu_dtype(*dtype);
#endif
    at::autocast::increment_nesting();
  }
  ~CpuAutocast() {
    if (!on_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    at::autocast::set_autocast_enabled(at::kCPU, false);
#else
    at::autocast::set_cpu_enabled(false);
#endif
  }
  CpuAutocast(const CpuAutocast&) = delete;
  CpuAutocast& operator=(const CpuAutocast&) = delete;

 private:
  bool on_;
};

inline torch::Tensor loss_fn(const torch::Tensor& out, const torch::Tensor& target) { return F::cross_entropy(out, target); }

// How the optimizer's parameters are grouped: one group, or weights with weight decay
// and biases without (AdamW's usual recipe).
enum class Groups { one, decay_weights_only };

struct Scenario {
  int steps = 24;
  std::int64_t batch = 4;     // per rank
  bool varied_batch = false;  // rank r has batch + r samples per step (exercises sample weighting)
  int micro_batches = 1;      // gradient accumulation: micro-batches per step
  bool uneven = false;        // rank r has steps - r batches
  Groups groups = Groups::one;
  Features features;
  paratrain::DataParallelOptions options;
  torch::Device device = torch::kCPU;  // where both models live; the batches start on the host
  // The strategy builds the model from a function, every rank from the reference's seed
  // (sharded as it is built at ZeRO stage 3: Note [Sharded construction]).
  bool built_by_strategy = false;
};

// The samples of rank r at step k: a fixed slice of one synthetic data set, b of the
// `stride` samples set aside for each rank and step.
struct Data {
  torch::Tensor x, y;
  Data() {
    torch::manual_seed(99);
    x = torch::randn({4096, 8});
    y = torch::randint(0, 4, {4096}, torch::kLong);
  }
  [[nodiscard]] paratrain::Batch of(int world, int rank, int step, std::int64_t b, std::int64_t stride = 0) const {
    const auto start = (static_cast<std::int64_t>(step) * world + rank) * std::max(b, stride);
    return {x.narrow(0, start, b), y.narrow(0, start, b)};
  }
};

inline int batches_of(const Scenario& s, int rank) { return s.uneven ? s.steps - rank : s.steps; }
inline std::int64_t batch_of(const Scenario& s, int rank) { return s.batch + (s.varied_batch ? rank : 0); }
inline std::int64_t stride_of(const Scenario& s) { return s.batch + (s.varied_batch ? 4 : 0); }  // up to 4 ranks

// The optimizer's parameter groups for `model`, built the same way for the reference
// and for the strategy: `weights` options for weights, weight decay 0 for biases.
template <class Opts, class Model>
paratrain::ParamGroups groups_of(const Scenario& s, const Model& model, const Opts& weights) {
  if (s.groups == Groups::one) return {torch::optim::OptimizerParamGroup(model->parameters())};
  std::vector<torch::Tensor> w, b;
  for (const auto& p : model->named_parameters()) (p.key().ends_with("bias") ? b : w).push_back(p.value());
  auto no_decay = weights;
  no_decay.weight_decay(0);
  return {torch::optim::OptimizerParamGroup(w, std::make_unique<Opts>(weights)),
          torch::optim::OptimizerParamGroup(b, std::make_unique<Opts>(no_decay))};
}

template <class Optim, class Opts>
std::vector<torch::Tensor> reference(const Scenario& s, int world, Opts opts) {
  const Data data;
  auto model = make_model(s.features, 0);
  model->to(s.device);
  Optim optim(groups_of(s, model, opts), opts);
  for (int k = 0; k < s.steps; ++k) {
    std::vector<torch::Tensor> xs, ys;
    for (int r = 0; r < world; ++r)
      if (k < batches_of(s, r)) {
        auto b = data.of(world, r, k, batch_of(s, r), stride_of(s));
        xs.push_back(b.input());
        ys.push_back(b.target);
      }
    optim.zero_grad();
    torch::Tensor loss;
    {
      // The same precision policy as the strategy's (Note [Mixed precision]), here by hand.
      const CpuAutocast autocast(s.options.precision.autocast);
      loss = loss_fn(model->forward(torch::cat(xs).to(s.device)), torch::cat(ys).to(s.device));
    }
    loss.backward();
    if (s.options.max_grad_norm > 0) torch::nn::utils::clip_grad_norm_(model->parameters(), s.options.max_grad_norm);
    optim.step();
  }
  return model->parameters();
}

// `Update` is DataParallel's third argument: an optimizer (DDP) or Sharded<Optimizer, Stage>.
// `Model`: Mlp, or one computing the same function from the same parameters.
template <class Comm, class Update, class Opts, class Model = Mlp>
std::vector<torch::Tensor> distributed(const Scenario& s, Comm c, Opts opts) {
  const Data data;
  const int world = c.size(), rank = c.rank();
  using Strategy = paratrain::DataParallel<Model, Comm, Update>;
  const auto make = [&]() -> std::unique_ptr<Strategy> {
    if (s.built_by_strategy) {
      auto options = s.options;
      options.build.device = s.device;
      return std::make_unique<Strategy>([&] { return make_model<Model>(s.features, 0); }, std::move(c),
                                        [&](Model& m) { return groups_of(s, m, opts); }, opts, options);
    }
    auto model = make_model<Model>(s.features, rank);
    model->to(s.device);  // the batches stay on the host: the strategy moves them
    auto groups = groups_of(s, model, opts);
    return std::make_unique<Strategy>(model, std::move(c), std::move(groups), opts, s.options);
  };
  const auto strategy = make();
  auto& dp = *strategy;
  const int mine = batches_of(s, rank);
  const auto batch = batch_of(s, rank);
  for (int k = 0;; ++k) {
    paratrain::StepResult r;
    if (k < mine) {
      auto b = data.of(world, rank, k, batch, stride_of(s));
      const auto micro = batch / s.micro_batches;
      for (int m = 0; m + 1 < s.micro_batches; ++m)
        dp.accumulate({b.input().narrow(0, m * micro, micro), b.target.narrow(0, m * micro, micro)}, loss_fn);
      const auto last = (s.micro_batches - 1) * micro;
      r = dp.step({b.input().narrow(0, last, batch - last), b.target.narrow(0, last, batch - last)}, loss_fn,
                  k + 1 < mine);
    } else {
      r = dp.join();
    }
    if (r.ranks_with_next == 0) break;
  }
  return dp.full_parameters();
}

// What `f` threw as paratrain::error, or "" when it did not throw.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const paratrain::error& e) {
    return e.what();
  }
  return {};
}

inline double max_relative_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, ((a[i] - b[i]).abs().max() / b[i].abs().max().clamp_min(1e-12)).item<double>());
  return worst;
}

}  // namespace paratrain_test
