#pragma once
// The pipeline equivalence harness, for any communicator: stages that take two inputs and
// pass one on untouched (tuples of activations, one needing no gradient), micro-batches
// that differ in size across micro-batches and replicas, and the independent reference:
// plain LibTorch on one process, the same stages from the same seeds chained over the
// concatenated batch, mean loss, SGD with momentum (a wrong gradient scale shows).
#include <torch/torch.h>

#include <algorithm>
#include <optional>
#include <span>
#include <tuple>
#include <vector>

#include "paratrain/fit/fit.hpp"
#include "paratrain/pipeline/schedule.hpp"
#include "paratrain/pipeline/schedule_check.hpp"
#include "paratrain/pipeline/pipeline.hpp"
#include "paratrain/strategy/recompute.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "paratrain/strategy/unit.hpp"
#include "support/doctest.hpp"
#include "support/equivalence.hpp"

namespace paratrain_test::pipe {

namespace zero = paratrain::zero;
namespace pipeline = paratrain::pipeline;
using paratrain::Pipeline;
using paratrain::PipelineOptions;
using Tensor = torch::Tensor;

constexpr int features = 6, width = 8, classes = 3;

// The type a stage's last output was computed in: bf16 where autocast ran, whatever the
// parameters' type (check_pipeline asserts it under mixed precision).
struct Computed {
  at::ScalarType out_dtype = at::kDouble;
  Tensor noted(Tensor t) {
    out_dtype = t.scalar_type();
    return t;
  }
};

// (x, z) -> (h, z)
struct EntryImpl : torch::nn::Module, Computed {
  EntryImpl() { fc = register_module("fc", paratrain::Unit<torch::nn::Linear>(features, width)); }
  std::tuple<Tensor, Tensor> forward(Tensor x, Tensor z) { return {noted(torch::tanh(fc(x))), z}; }
  paratrain::Unit<torch::nn::Linear> fc{nullptr};
};
TORCH_MODULE(Entry);

// Mid's and Head's functions of h, with their layers fc and gate; also computed by the
// recomputed blocks below. `a` comes from parameters and an input that needs no gradient,
// and is used twice on the path to the output: ZB-H1's weight half must count its
// gradient once.
template <class Layer>
Tensor mid_of(Layer& fc, Layer& gate, const Tensor& h, const Tensor& z) {
  auto a = torch::tanh(gate(z));
  return torch::tanh(fc(h * a)) + a;
}
template <class Layer>
Tensor head_of(Layer& fc, Layer& gate, const Tensor& h, const Tensor& z) {
  auto a = torch::tanh(gate(z));
  return fc(h * a + a);
}

// (h, z) -> (h', z).
struct MidImpl : torch::nn::Module, Computed {
  MidImpl() {
    fc = register_module("fc", paratrain::Unit<torch::nn::Linear>(width, width));
    gate = register_module("gate", paratrain::Unit<torch::nn::Linear>(width, width));
  }
  std::tuple<Tensor, Tensor> forward(Tensor h, Tensor z) { return {noted(mid_of(fc, gate, h, z)), z}; }
  paratrain::Unit<torch::nn::Linear> fc{nullptr}, gate{nullptr};
};
TORCH_MODULE(Mid);

// (h, z) -> logits, with a gate like Mid's.
struct HeadImpl : torch::nn::Module, Computed {
  HeadImpl() {
    fc = register_module("fc", paratrain::Unit<torch::nn::Linear>(width, classes));
    gate = register_module("gate", paratrain::Unit<torch::nn::Linear>(width, width));
  }
  Tensor forward(Tensor h, Tensor z) { return noted(head_of(fc, gate, h, z)); }
  paratrain::Unit<torch::nn::Linear> fc{nullptr}, gate{nullptr};
};
TORCH_MODULE(Head);

// Mid and Head computed by one block each, whose activations are recomputed in backward
// (paratrain::Recompute, a ZeRO-3 unit): the same functions, and the same parameters
// drawn in the same order (fc, then gate) from the same seed.
struct MidBlockImpl : torch::nn::Module {
  MidBlockImpl() {
    fc = register_module("fc", torch::nn::Linear(width, width));
    gate = register_module("gate", torch::nn::Linear(width, width));
  }
  Tensor forward(Tensor h, Tensor z) { return mid_of(fc, gate, h, z); }
  torch::nn::Linear fc{nullptr}, gate{nullptr};
};
TORCH_MODULE(MidBlock);

struct RecomputedMidImpl : torch::nn::Module {
  RecomputedMidImpl() { block = register_module("block", paratrain::Unit<paratrain::Recompute<MidBlock>>()); }
  std::tuple<Tensor, Tensor> forward(Tensor h, Tensor z) { return {block(h, z), z}; }
  paratrain::Unit<paratrain::Recompute<MidBlock>> block{nullptr};
};
TORCH_MODULE(RecomputedMid);

struct HeadBlockImpl : torch::nn::Module {
  HeadBlockImpl() {
    fc = register_module("fc", torch::nn::Linear(width, classes));
    gate = register_module("gate", torch::nn::Linear(width, width));
  }
  Tensor forward(Tensor h, Tensor z) { return head_of(fc, gate, h, z); }
  torch::nn::Linear fc{nullptr}, gate{nullptr};
};
TORCH_MODULE(HeadBlock);

struct RecomputedHeadImpl : torch::nn::Module {
  RecomputedHeadImpl() { block = register_module("block", paratrain::Unit<paratrain::Recompute<HeadBlock>>()); }
  Tensor forward(Tensor h, Tensor z) { return block(h, z); }
  paratrain::Unit<paratrain::Recompute<HeadBlock>> block{nullptr};
};
TORCH_MODULE(RecomputedHead);

// Entry, S-2 Mids, Head.
template <std::size_t S, class = std::make_index_sequence<S - 2>>
struct Chain;
template <std::size_t S, std::size_t... I>
struct Chain<S, std::index_sequence<I...>> {
  template <std::size_t>
  using mid = Mid;
  using type = Pipeline<Entry, mid<I>..., Head>;
};
template <std::size_t S>
using ChainOf = typename Chain<S>::type;

// The type of the stages' parameters and inputs: double, so that the fp32-free reference
// agrees to 1e-9 in the losses; float under mixed precision, since autocast leaves double
// alone (it would then compute in bf16 nowhere).
inline at::ScalarType dtype_for(const std::optional<at::ScalarType>& autocast) {
  return autocast ? torch::kFloat : torch::kDouble;
}

// Stage i, the same on every rank and in the reference.
template <class Stage>
Stage make_stage(std::size_t i, at::ScalarType dtype = torch::kDouble) {
  torch::manual_seed(100 + static_cast<int>(i));
  Stage s;
  s->to(dtype);
  return s;
}

template <class... Stage>
Pipeline<Stage...> seeded(Pipeline<Stage...>*, at::ScalarType dtype = torch::kDouble) {
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    return Pipeline<Stage...>([dtype] { return make_stage<Stage>(I, dtype); }...);
  }(std::index_sequence_for<Stage...>{});
}

// Replica r's micro-batch m of step t: 2 to 4 samples, so sizes differ everywhere (drawn in
// double, then given `dtype`).
inline paratrain::Batch micro_batch(int t, int r, int m, at::ScalarType dtype = torch::kDouble) {
  torch::manual_seed(1000 * t + 37 * r + m);
  const int n = 2 + (t + r + m) % 3;
  auto x = torch::randn({n, features}, torch::kDouble).to(dtype);
  auto z = torch::randn({n, width}, torch::kDouble).to(dtype);
  auto y = torch::randint(classes, {n}, torch::kLong);
  return {{x, z}, y};
}

inline torch::optim::SGDOptions sgd_options() { return torch::optim::SGDOptions(0.1).momentum(0.9); }

// What single-device training on the union of every replica's micro-batches gives.
struct Trained {
  std::vector<std::vector<Tensor>> params;  // per stage, after the last step
  std::vector<std::vector<double>> loss;    // [step][replica]: the mean loss over that replica's samples
};

// Single-device training on the union of every replica's micro-batches, `steps` steps.
template <class... Stage>
struct Reference {
template <class Optim, class Options>
static Trained run(int replicas, int micro, int steps, Options options, double clip = 0,
                   std::optional<at::ScalarType> autocast = {}) {
  return run_shaped<Optim>(std::vector<Shape>(static_cast<std::size_t>(steps), {replicas, micro}), options, clip,
                           autocast);
}

// Step t's batch: the micro-batches micro_batch(t, r, m) of replicas r < shape[t].replicas,
// m < shape[t].micro (a pipeline reshaped by a checkpoint between steps changes them).
struct Shape {
  int replicas, micro;
};
template <class Optim, class Options>
static Trained run_shaped(const std::vector<Shape>& shape, Options options, double clip = 0,
                          std::optional<at::ScalarType> autocast = {}) {
  const int steps = static_cast<int>(shape.size());
  const auto dtype = dtype_for(autocast);
  auto stages = [&]<std::size_t... I>(std::index_sequence<I...>) {
    return std::tuple<Stage...>{make_stage<Stage>(I, dtype)...};
  }(std::index_sequence_for<Stage...>{});
  std::vector<Tensor> params;
  std::apply([&](auto&... s) { (..., [&] { for (auto& p : s->parameters()) params.push_back(p); }()); }, stages);
  Optim sgd(params, options);
  Trained trained;
  for (int t = 0; t < steps; ++t) {
    const int replicas = shape[static_cast<std::size_t>(t)].replicas, micro = shape[static_cast<std::size_t>(t)].micro;
    std::vector<Tensor> xs, zs, ys;
    std::vector<std::int64_t> rows(static_cast<std::size_t>(replicas), 0);  // each replica's samples
    for (int r = 0; r < replicas; ++r)
      for (int m = 0; m < micro; ++m) {
        auto b = micro_batch(t, r, m, dtype);
        xs.push_back(b.inputs[0]), zs.push_back(b.inputs[1]), ys.push_back(b.target);
        rows[static_cast<std::size_t>(r)] += b.size();
      }
    sgd.zero_grad();
    std::optional<CpuAutocast> autocasting(std::in_place, autocast);
    auto out = std::apply(
        [&](auto& first, auto&... rest) {
          auto acts = first->forward(torch::cat(xs), torch::cat(zs));
          // Each later stage takes the previous one's tuple.
          Tensor logits;
          auto feed = [&](auto& stage) {
            if constexpr (std::is_same_v<std::decay_t<decltype(stage)>, Head>)
              logits = std::apply([&](auto&&... a) { return stage->forward(a...); }, acts);
            else
              acts = std::apply([&](auto&&... a) { return stage->forward(a...); }, acts);
          };
          (feed(rest), ...);
          return logits;
        },
        stages);
    const auto y = torch::cat(ys);
    auto& losses = trained.loss.emplace_back();
    const auto whole = torch::nn::functional::cross_entropy(out, y);  // as the pipeline: under autocast
    {
      torch::NoGradGuard no_grad;
      std::int64_t begin = 0;
      for (const auto n : rows) {
        losses.push_back(torch::nn::functional::cross_entropy(out.narrow(0, begin, n), y.narrow(0, begin, n))
                             .template item<double>());
        begin += n;
      }
    }
    autocasting.reset();
    whole.backward();
    if (clip > 0) torch::nn::utils::clip_grad_norm_(params, clip);
    sgd.step();
  }
  std::apply([&](auto&... s) { (trained.params.push_back(s->parameters()), ...); }, stages);
  return trained;
}
};

// `Ref`: the pipeline whose stages the reference chains, where P's compute the same
// functions from the same parameters in another way (recomputing activations).
// `tolerance`: of the parameters, relative; the losses agree to 1e-9 relative (double),
// or to `tolerance` under mixed precision (float and bf16).
template <class Comm, class Update, class P, class Ref = P>
void check_pipeline(Comm world, PipelineOptions options, int micro, int steps = 20, double tolerance = 1e-5) {
  const double clip = options.data_parallel.max_grad_norm;
  using Strategy = paratrain::DataParallel<P, Comm, Update>;
  const auto autocast = options.data_parallel.precision.autocast;
  const auto dtype = dtype_for(autocast);
  Strategy s(seeded(static_cast<P*>(nullptr), dtype), std::move(world), sgd_options(), options);
  const int K = s.pipeline_size(), R = s.replicas();
  CAPTURE(K);
  CAPTURE(R);
  CAPTURE(micro);
  CAPTURE(s.schedule_for(micro).name);
  const auto want = [&]<class... Stage>(Pipeline<Stage...>*) {
    return Reference<Stage...>::template run<torch::optim::SGD>(R, micro, steps, sgd_options(), clip,
                                                                 options.data_parallel.precision.autocast);
  }(static_cast<Ref*>(nullptr));
  int peak = 0;
  for (int t = 0; t < steps; ++t) {
    std::vector<paratrain::Batch> mine;
    for (int m = 0; m < micro; ++m) mine.push_back(micro_batch(t, s.replica(), m, dtype));
    const auto r = s.step(std::span<const paratrain::Batch>(mine), paratrain::CrossEntropy{});
    // The last stage reports its replica's mean loss over the step's micro-batches.
    CHECK(r.has_loss == s.owns(static_cast<int>(P::size) - 1));
    if (r.has_loss)
      CHECK(r.loss == doctest::Approx(want.loss[static_cast<std::size_t>(t)][static_cast<std::size_t>(s.replica())])
                          .epsilon(autocast ? tolerance : 1e-9));
    peak = std::max(peak, s.last_step_stats().peak_stashed);
  }
  // The stages this rank runs computed in autocast's type (bf16), or in the parameters'.
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (..., [&] {
      if constexpr (std::is_base_of_v<Computed, typename std::tuple_element_t<I, typename P::stages>::ContainedType>)
        if (s.owns(static_cast<int>(I))) {
          CAPTURE(I);
          CHECK((s.template stage_at<I>()->out_dtype == autocast.value_or(dtype)));
        }
    }());
  }(std::make_index_sequence<P::size>{});
  std::vector<Tensor> expected;
  for (int i = 0; i < static_cast<int>(P::size); ++i)
    if (s.owns(i)) expected.insert(expected.end(), want.params[i].begin(), want.params[i].end());
  CHECK(max_relative_difference(s.full_parameters(), expected) <= tolerance);
  // 1F1B and ZB-H1 keep at most K micro-batches' activations (rank r: K - r); GPipe all M.
  const auto kind = options.schedule;
  if (kind == pipeline::Kind::one_f_one_b) CHECK(peak <= std::min(K - s.pipeline_rank(), micro));
  if (kind == pipeline::Kind::zero_bubble_h1) CHECK(peak <= std::min(K, micro));
  if (kind == pipeline::Kind::gpipe) CHECK(peak == micro);
}

}  // namespace paratrain_test::pipe
