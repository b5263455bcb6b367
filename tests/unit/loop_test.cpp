// The loop for real programs (issue #25): losses of the model's whole output and the
// batch, evaluation metrics, stopping, budgets and schedules. Each is compared with an
// independent expectation: a plain LibTorch loop on one device over the union of the
// ranks' batches, a computation over the whole set in one process, or a formula.
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <bit>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <ctime>
#include <filesystem>
#include <functional>
#include <limits>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include "paratrain/checkpoint/checkpoint.hpp"
#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/fit/fit.hpp"
#include "paratrain/pipeline/pipeline.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/strategy/local_data_parallel.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "paratrain/strategy/unit.hpp"
#include "support/doctest.hpp"
#include "support/equivalence.hpp"
#include "support/fit_reference.hpp"
#include "support/shared_dir.hpp"
#include "support/test_data.hpp"

// A namespace of its own: this file shares a translation unit with others (Note [Unity groups]).
namespace loop_test {

namespace {

namespace comm = paratrain::comm;
namespace F = torch::nn::functional;
using paratrain::Batch;
using paratrain_test::max_relative_difference;
using Pair = std::tuple<torch::Tensor, torch::Tensor>;

// ---- two outputs and an auxiliary loss ---------------------------------------------
// The model returns the class scores and the features they come from; the loss is the
// per-sample weighted cross-entropy plus a penalty on the features' size (an auxiliary
// loss), both means over the batch's samples (Note [Losses of a batch]).

at::Tensor weighted_with_aux(const Pair& out, const Batch& b) {
  const auto& [scores, features] = out;
  const auto ce = F::cross_entropy(scores, b.target, F::CrossEntropyFuncOptions().reduction(torch::kNone));
  return (ce * b.extra.at("weight")).mean() + 0.1 * features.pow(2).sum(1).mean();
}

constexpr std::int64_t seed_of_heads = 6;

// One hidden layer: 8 -> 8, tanh.
struct HiddenImpl : torch::nn::Module {
  explicit HiddenImpl(std::int64_t seed) {
    torch::manual_seed(seed);
    fc = register_module("fc", torch::nn::Linear(8, 8));
  }
  torch::Tensor forward(torch::Tensor x) { return torch::tanh(fc(x)); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Hidden);

// The last stage: scores and features.
struct HeadsImpl : torch::nn::Module {
  HeadsImpl() {
    torch::manual_seed(seed_of_heads);
    fc = register_module("fc", torch::nn::Linear(8, 4));
  }
  Pair forward(torch::Tensor h) { return {fc(h), h}; }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Heads);

// The whole model for DataParallel, each layer a ZeRO-3 unit: Hidden(5) then the heads.
struct TwoOutputsImpl : torch::nn::Module {
  TwoOutputsImpl() {
    torch::manual_seed(5);
    hidden = register_module("hidden", paratrain::Unit<torch::nn::Linear>(8, 8));
    torch::manual_seed(seed_of_heads);
    heads = register_module("heads", paratrain::Unit<torch::nn::Linear>(8, 4));
  }
  Pair forward(torch::Tensor x) {
    const auto h = torch::tanh(hidden(x));
    return {heads(h), h};
  }
  paratrain::Unit<torch::nn::Linear> hidden{nullptr}, heads{nullptr};
};
TORCH_MODULE(TwoOutputs);

// The samples: features, classes and per-sample weights.
struct Samples {
  torch::Tensor x, y, w;
  Samples() {
    torch::manual_seed(42);
    x = torch::randn({2048, 8});
    y = torch::randint(0, 4, {2048}, torch::kLong);
    w = torch::rand({2048}) * 2;
  }
  // Micro-batch m of replica q at step t: 3 + q + m samples (every replica's size differs).
  [[nodiscard]] Batch of(int t, int q, int m) const {
    const auto start = (t * 64 + q * 16 + m * 8);
    const auto n = 3 + q + m;
    Batch b{x.narrow(0, start, n), y.narrow(0, start, n)};
    b.extra["weight"] = w.narrow(0, start, n);
    return b;
  }
};

torch::optim::SGDOptions momentum_sgd() { return torch::optim::SGDOptions(0.1).momentum(0.9); }

// Plain LibTorch on one device: hidden layers seeded `seeds`, then the heads, trained on
// the union of every replica's micro-batches of each step. Returns the parameters in
// stage order.
std::vector<torch::Tensor> reference_two_outputs(const std::vector<std::int64_t>& seeds, int replicas, int micro,
                                                 int steps) {
  const Samples data;
  std::vector<torch::nn::Linear> layers;
  for (auto seed : seeds) {
    torch::manual_seed(seed);
    layers.emplace_back(8, 8);
  }
  torch::manual_seed(seed_of_heads);
  torch::nn::Linear head(8, 4);
  std::vector<torch::Tensor> params;
  for (auto& l : layers)
    for (auto& p : l->parameters()) params.push_back(p);
  for (auto& p : head->parameters()) params.push_back(p);
  torch::optim::SGD sgd(params, momentum_sgd());
  for (int t = 0; t < steps; ++t) {
    std::vector<Batch> all;
    for (int q = 0; q < replicas; ++q)
      for (int m = 0; m < micro; ++m) all.push_back(data.of(t, q, m));
    std::vector<torch::Tensor> xs, ys, ws;
    for (const auto& b : all) xs.push_back(b.input()), ys.push_back(b.target), ws.push_back(b.extra.at("weight"));
    Batch whole{torch::cat(xs), torch::cat(ys)};
    whole.extra["weight"] = torch::cat(ws);
    sgd.zero_grad();
    auto h = whole.input();
    for (auto& l : layers) h = torch::tanh(l(h));
    weighted_with_aux(Pair{head(h), h}, whole).backward();
    sgd.step();
  }
  std::vector<torch::Tensor> out;
  for (auto& p : params) out.push_back(p.detach().clone());
  return out;
}

// Trains `s` (this rank is replica `q` of `replicas`) with the batch loss and returns its
// parameters, as full_parameters gives them.
template <class S>
std::vector<torch::Tensor> train_two_outputs(S& s, int q, int micro, int steps) {
  const Samples data;
  for (int t = 0; t < steps; ++t) {
    std::vector<Batch> mine;
    for (int m = 0; m < micro; ++m) mine.push_back(data.of(t, q, m));
    const auto r = s.step(std::span<const Batch>(mine), weighted_with_aux);
    if (r.has_loss) CHECK(std::isfinite(r.loss));
  }
  return s.full_parameters();
}

}  // namespace

TEST_CASE("a model with two outputs and an auxiliary, weighted loss trains as one device does (DDP, ZeRO-3)") {
  const int world = comm::Mpi().size();
  const int rank = comm::Mpi().rank();
  constexpr int micro = 2, steps = 6;
  const auto want = reference_two_outputs({5}, world, micro, steps);
  {
    paratrain::DataParallel<TwoOutputs, comm::Mpi, torch::optim::SGD> s(TwoOutputs(), comm::Mpi(), momentum_sgd());
    CHECK(max_relative_difference(train_two_outputs(s, rank, micro, steps), want) <= 1e-5);
  }
  {
    paratrain::DataParallel<TwoOutputs, comm::Mpi, paratrain::Sharded<torch::optim::SGD, paratrain::zero::stage3>> s(
        TwoOutputs(), comm::Mpi(), momentum_sgd());
    CHECK(max_relative_difference(train_two_outputs(s, rank, micro, steps), want) <= 1e-5);
  }
}

TEST_CASE("a pipeline whose last stage returns two outputs trains with the batch loss as one device does") {
  const int world = comm::Mpi().size();
  constexpr int micro = 3, steps = 6;
  const auto run = [&]<class... Stage>(paratrain::Pipeline<Stage...> stages, std::vector<std::int64_t> seeds,
                                       paratrain::PipelineOptions options) {
    paratrain::DataParallel<paratrain::Pipeline<Stage...>, comm::Mpi, torch::optim::SGD> s(
        std::move(stages), comm::Mpi(), momentum_sgd(), options);
    const auto want = reference_two_outputs(seeds, s.replicas(), micro, steps);
    const auto got = train_two_outputs(s, s.replica(), micro, steps);
    std::vector<torch::Tensor> expected;
    for (int i = 0; i < static_cast<int>(sizeof...(Stage)); ++i)
      if (s.owns(i)) expected.insert(expected.end(), want.begin() + 2 * i, want.begin() + 2 * i + 2);
    CHECK(max_relative_difference(got, expected) <= 1e-5);
  };
  using Two = paratrain::Pipeline<Hidden, Heads>;
  using Three = paratrain::Pipeline<Hidden, Hidden, Heads>;
  const auto two = [] { return Two([] { return Hidden(5); }, [] { return Heads(); }); };
  if (world % 2 == 0) run(two(), {5}, {});
  if (world == 1) run(two(), {5}, {.schedule = paratrain::pipeline::Kind::interleaved_1f1b, .virtual_stages = 2});
  if (world == 3)
    run(Three([] { return Hidden(5); }, [] { return Hidden(7); }, [] { return Heads(); }), {5, 7},
        {.schedule = paratrain::pipeline::Kind::zero_bubble_h1});
}

// ---- a weighted per-token loss ------------------------------------------------------
// Sequences of 6 tokens, a class per token, and a weight per token (0 for padding): the
// loss of a sample is the weighted sum of its tokens' cross-entropies over the sequence
// length, and the batch's the mean over its samples.

namespace {

template <class Layer>
struct TokensImpl : torch::nn::Cloneable<TokensImpl<Layer>> {
  TokensImpl() { reset(); }
  void reset() override {
    torch::manual_seed(11);
    fc1 = this->register_module("fc1", Layer(8, 16));
    fc2 = this->register_module("fc2", Layer(16, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::tanh(fc1(x))); }  // (N, T, 8) -> (N, T, 4)
  Layer fc1{nullptr}, fc2{nullptr};
};
template <class Layer>
struct Tokens : torch::nn::ModuleHolder<TokensImpl<Layer>> {
  using torch::nn::ModuleHolder<TokensImpl<Layer>>::ModuleHolder;
  Tokens() : torch::nn::ModuleHolder<TokensImpl<Layer>>() {}
};

at::Tensor per_token(const at::Tensor& scores, const Batch& b) {
  const auto n = scores.size(0), length = scores.size(1);
  const auto ce = F::cross_entropy(scores.reshape({n * length, 4}), b.target.reshape({n * length}),
                                   F::CrossEntropyFuncOptions().reduction(torch::kNone));
  return (ce.view({n, length}) * b.extra.at("weight")).sum(1).mean() / static_cast<double>(length);
}

struct Sequences {
  torch::Tensor x, y, w;
  Sequences() {
    torch::manual_seed(43);
    x = torch::randn({1024, 6, 8});
    y = torch::randint(0, 4, {1024, 6}, torch::kLong);
    w = (torch::rand({1024, 6}) > 0.3).to(torch::kFloat) * torch::rand({1024, 6}) * 2;  // ~30% padding
  }
  [[nodiscard]] Batch of(int t, int q, std::int64_t n) const {
    const auto start = t * 64 + q * 16;
    Batch b{x.narrow(0, start, n), y.narrow(0, start, n)};
    b.extra["weight"] = w.narrow(0, start, n);
    return b;
  }
};

std::vector<torch::Tensor> reference_tokens(int replicas, int steps) {
  const Sequences data;
  Tokens<torch::nn::Linear> net;
  torch::optim::SGD sgd(net->parameters(), momentum_sgd());
  for (int t = 0; t < steps; ++t) {
    std::vector<torch::Tensor> xs, ys, ws;
    for (int q = 0; q < replicas; ++q) {
      const auto b = data.of(t, q, 2 + q);
      xs.push_back(b.input()), ys.push_back(b.target), ws.push_back(b.extra.at("weight"));
    }
    Batch whole{torch::cat(xs), torch::cat(ys)};
    whole.extra["weight"] = torch::cat(ws);
    sgd.zero_grad();
    per_token(net->forward(whole.input()), whole).backward();
    sgd.step();
  }
  std::vector<torch::Tensor> out;
  for (auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

}  // namespace

TEST_CASE("a weighted per-token loss trains as one device does (DDP, ZeRO-2, ZeRO-3; in-process replicas)") {
  const int world = comm::Mpi().size(), rank = comm::Mpi().rank();
  constexpr int steps = 6;
  const Sequences data;
  const auto want = reference_tokens(world, steps);
  const auto train = [&](auto& s) {
    for (int t = 0; t < steps; ++t) s.step(data.of(t, rank, 2 + rank), per_token);
    return s.full_parameters();
  };
  using Units = Tokens<paratrain::Unit<torch::nn::Linear>>;
  {
    paratrain::DataParallel<Units, comm::Mpi, torch::optim::SGD> s(Units(), comm::Mpi(), momentum_sgd());
    CHECK(max_relative_difference(train(s), want) <= 1e-5);
  }
  {
    paratrain::DataParallel<Units, comm::Mpi, paratrain::Sharded<torch::optim::SGD, paratrain::zero::stage2>> s(
        Units(), comm::Mpi(), momentum_sgd());
    CHECK(max_relative_difference(train(s), want) <= 1e-5);
  }
  {
    paratrain::DataParallel<Units, comm::Mpi, paratrain::Sharded<torch::optim::SGD, paratrain::zero::stage3>> s(
        Units(), comm::Mpi(), momentum_sgd());
    CHECK(max_relative_difference(train(s), want) <= 1e-5);
  }
  if (rank == 0) {  // one process, `world` replicas: the whole union split among them
    using Plain = Tokens<torch::nn::Linear>;
    paratrain::LocalDataParallel<Plain, torch::optim::SGD> s(Plain(), momentum_sgd(), {.replicas = 2, .cpu = true});
    for (int t = 0; t < steps; ++t) {
      std::vector<Batch> parts;
      for (int q = 0; q < world; ++q) parts.push_back(data.of(t, q, 2 + q));
      s.step(std::span<const Batch>(parts), per_token);  // micro-batches: accumulated, then one step
    }
    std::vector<torch::Tensor> got;
    for (auto& p : s.model()->parameters()) got.push_back(p.detach());
    CHECK(max_relative_difference(got, want) <= 1e-5);
  }
}

// ---- metrics ------------------------------------------------------------------------

namespace {

// Scores of 5 classes with sizeable ties broken nowhere: a fixed random linear map.
struct ScoresImpl : torch::nn::Module {
  ScoresImpl() {
    torch::manual_seed(3);
    fc = register_module("fc", torch::nn::Linear(8, 5));
  }
  Pair forward(torch::Tensor x) {
    const auto s = fc(x);
    return {s, s.narrow(-1, 0, 2)};  // the scores, and a 2-value regression output
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Scores);

// The two outputs' losses: cross-entropy of the scores (over the last dimension; padding
// tokens, -100, left out) and the regression's squared error against Batch::extra "value".
at::Tensor scores_loss(const Pair& out, const Batch& b) {
  const auto& s = std::get<0>(out);
  return F::cross_entropy(s.reshape({-1, 5}), b.target.reshape({-1}), F::CrossEntropyFuncOptions().ignore_index(-100)) +
         F::mse_loss(std::get<1>(out), b.extra.at("value"));
}

// `n` samples: features (n, 8) or sequences (n, 3, 8); classes with some -100 (padding);
// values for the regression output.
paratrain::data::TensorDataset scored_data(std::int64_t n, bool sequences) {
  torch::manual_seed(77);
  auto x = sequences ? torch::randn({n, 3, 8}) : torch::randn({n, 8});
  auto y = sequences ? torch::randint(0, 5, {n, 3}, torch::kLong) : torch::randint(0, 5, {n}, torch::kLong);
  if (sequences) y.masked_fill_(torch::rand({n, 3}) < 0.2, -100);
  auto values = sequences ? torch::randn({n, 3, 2}) : torch::randn({n, 2});
  return paratrain::data::TensorDataset({x}, y, {{"value", values}});
}

// Counts a metric's sums from every rank but throws on one: the failure every rank must see.
struct ThrowsOnRank {
  int rank = -1;
  int here = -2;
  [[nodiscard]] std::string name() const { return "throws"; }
  [[nodiscard]] at::Tensor sums(std::span<const at::Tensor>, const Batch& b) const {
    if (here == rank) throw std::runtime_error("this metric fails on rank " + std::to_string(rank));
    return torch::tensor({double(b.size()), 1.0});
  }
  [[nodiscard]] double compute(const at::Tensor& t) const { return t[0].item<double>(); }
};
static_assert(paratrain::metric<ThrowsOnRank>);
static_assert(paratrain::metric<paratrain::metrics::Perplexity>);
static_assert(!paratrain::metric<int>);

}  // namespace

TEST_CASE("every provided metric equals its single-process computation over the whole set, at any world size") {
  comm::Mpi c;
  const int world = c.size();
  paratrain::DataParallel<Scores, comm::Mpi, torch::optim::SGD> s(Scores(), comm::Mpi(), torch::optim::SGDOptions(0.1));
  for (const bool sequences : {false, true}) {
    CAPTURE(sequences);
    const auto set = scored_data(97, sequences);  // 97: prime, no world divides it
    const auto e = paratrain::evaluate(s, set,
                                       {.batch_size = 6,
                                        .metrics = {paratrain::metrics::Accuracy{}, paratrain::metrics::TopK{2},
                                                    paratrain::metrics::TopK{.k = 5},
                                                    paratrain::metrics::MeanAbsoluteError{.output = 1, .extra = "value"},
                                                    paratrain::metrics::Perplexity{}}},
                                       scores_loss);
    // One process, the whole set, the formulas written out.
    torch::NoGradGuard no_grad;
    const auto [scores, values] = Scores()->forward(set.inputs());  // the same seed: the same weights
    const auto y = set.targets();
    const auto kept = y.ne(-100);
    const auto counted = kept.sum().item<double>();
    const auto predicted = scores.argmax(-1);
    // Padding tokens are left out of (top-k) accuracy, as of the cross-entropy.
    const double accuracy = (predicted.eq(y) & kept).sum().item<double>() / counted;
    const auto order = scores.argsort(-1, /*descending=*/true);
    const double top2 = (order.narrow(-1, 0, 2).eq(y.unsqueeze(-1)).any(-1)).sum().item<double>() / counted;
    const double mae = (values - set.extra().at("value")).abs().mean().item<double>();
    const auto nll = F::cross_entropy(scores.reshape({-1, 5}).to(torch::kDouble), y.reshape({-1}),
                                      F::CrossEntropyFuncOptions().ignore_index(-100));
    CHECK(e.samples == 97);
    CHECK(e.metrics.at("accuracy") == doctest::Approx(accuracy).epsilon(1e-12));
    CHECK(e.metrics.at("top2_accuracy") == doctest::Approx(top2).epsilon(1e-12));
    CHECK(e.metrics.at("top5_accuracy") == 1.0);  // 5 classes
    CHECK(e.metrics.at("mae") == doctest::Approx(mae).epsilon(1e-6));
    CHECK(e.metrics.at("perplexity") == doctest::Approx(std::exp(nll.item<double>())).epsilon(1e-6));
    if (!sequences)  // (with padding, a loss of token means is not a mean over samples)
      CHECK(e.loss == doctest::Approx(scores_loss(Pair{scores, values}, set.get(torch::arange(97))).item<double>())
                          .epsilon(1e-5));
    CHECK(e.metrics.size() == 5);
  }
  // A name twice is an error before anything is evaluated; a metric that throws on one
  // rank makes every rank throw, with that rank's message.
  const auto set = scored_data(30, false);
  CHECK_THROWS_WITH_AS(paratrain::evaluate(s, set, {.metrics = {paratrain::metrics::TopK{2}, paratrain::metrics::TopK{2}}},
                                           scores_loss),
                       doctest::Contains("two metrics are named 'top2_accuracy'"), paratrain::error);
  const auto failure = "this metric fails on rank " + std::to_string(world - 1);
  CHECK_THROWS_WITH_AS(
      paratrain::evaluate(s, set, {.batch_size = 4, .metrics = {ThrowsOnRank{.rank = world - 1, .here = c.rank()}}},
                          scores_loss),
      doctest::Contains(failure.c_str()), paratrain::error);
}

TEST_CASE("fit evaluates its metrics every epoch: in EpochInfo, the result and the epoch line") {
  comm::Mpi c;
  const auto train = scored_data(64, false), test = scored_data(41, false);
  paratrain::DataParallel<Scores, comm::Mpi, torch::optim::SGD> s(Scores(), comm::Mpi(), torch::optim::SGDOptions(0.05));
  std::vector<double> seen;
  const auto result = paratrain::fit(
      s, train,
      {.epochs = 2,
       .batch_size = 8,
       .eval = &test,
       .eval_batch_size = 5,
       .metrics = {paratrain::metrics::TopK{3}},
       .progress = false,
       .on_epoch = [&](const paratrain::EpochInfo& e) { seen.push_back(e.eval_metrics.at("top3_accuracy")); }},
      scores_loss);
  REQUIRE(result.epochs.size() == 2);
  REQUIRE(seen.size() == 2);
  // After training: the last epoch's value is the trained model's, over the whole test set.
  torch::NoGradGuard no_grad;
  const auto scores = std::get<0>(s.model()->forward(test.inputs()));
  const double top3 = scores.argsort(-1, true).narrow(-1, 0, 3).eq(test.targets().unsqueeze(-1)).any(-1).to(torch::kDouble)
                          .mean()
                          .item<double>();
  CHECK(result.epochs.back().eval_metrics.at("top3_accuracy") == doctest::Approx(top3).epsilon(1e-12));
  CHECK(seen.back() == result.epochs.back().eval_metrics.at("top3_accuracy"));
}

// ---- stopping, budgets, the best checkpoint ----------------------------------------

namespace {

using paratrain_test::fit_reference::make_data;
using paratrain_test::fit_reference::make_net;
using paratrain_test::fit_reference::Net;
using Ddp = paratrain::DataParallel<Net, comm::Mpi, torch::optim::SGD>;

// A value logged once per epoch (by the first step's callback), so that the epoch's mean of
// it is the table's entry: what the monitors read, independent of training.
std::function<void(const paratrain::StepInfo&)> log_per_epoch(const std::vector<double>& table, std::int64_t per_epoch) {
  return [=](const paratrain::StepInfo& i) {
    if (i.step % per_epoch == 0) i.metrics->log("score", table.at(static_cast<std::size_t>(i.epoch)));
  };
}

std::vector<torch::Tensor> parameters_of(Net& net) {
  std::vector<torch::Tensor> out;
  for (auto& p : net->parameters()) out.push_back(p.detach().clone());
  return out;
}

}  // namespace

TEST_CASE("max_steps stops mid-epoch after exactly that many steps, as the single-device loop over them") {
  comm::Mpi c;
  const int world = c.size();
  const auto train = make_data(203, 1);
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  Ddp s(make_net(), comm::Mpi(), sgd);
  const auto per_epoch = (203 / world + (203 % world ? 1 : 0) + 4) / 5;  // DistributedSampler pads; batch 5
  const std::int64_t max_steps = per_epoch + 3;                          // in the second epoch
  int calls = 0;
  const auto result = paratrain::fit(s, train,
                                     {.epochs = 4, .batch_size = 5, .seed = 3, .max_steps = max_steps,
                                      .progress = false, .on_step = [&](const paratrain::StepInfo&) { ++calls; }});
  CHECK(result.stopped == "max_steps");
  CHECK(result.steps == max_steps);
  CHECK(calls == max_steps);
  REQUIRE(result.epochs.size() == 2);
  CHECK(result.epochs[0].complete);
  CHECK_FALSE(result.epochs[1].complete);
  auto net = make_net();
  paratrain_test::fit_reference::train(net, train, world, 4, 5, 3, sgd, torch::kCPU, max_steps);
  CHECK(max_relative_difference(parameters_of(s.model()), parameters_of(net)) <= 1e-5);
}

TEST_CASE("early stopping stops after `patience` epochs without an improvement of more than min_delta") {
  comm::Mpi c;
  const auto train = make_data(64, 1);
  const std::int64_t per_epoch = (64 / c.size() + 7) / 8;
  // Improves by more than 0.05 at epochs 1, 5, 6 and 7; not at 2-4 (3.96 is within min_delta of 4).
  const std::vector<double> table{5, 4, 4.5, 3.96, 4.2, 3, 2, 1};
  struct Case {
    paratrain::Goal goal;
    int patience;
    std::size_t epochs;  // trained: the formula's answer, worked out by hand
  };
  for (const auto& k : {Case{paratrain::Goal::minimize, 3, 5}, Case{paratrain::Goal::minimize, 4, 8},
                        Case{paratrain::Goal::maximize, 2, 3}}) {
    CAPTURE(k.patience);
    Ddp s(make_net(), comm::Mpi(), torch::optim::SGDOptions(0.01));
    auto options = paratrain::FitOptions{.epochs = 8,
                                         .batch_size = 8,
                                         .early_stopping = {.monitor = {"score", k.goal}, .patience = k.patience,
                                                            .min_delta = 0.05},
                                         .progress = false,
                                         .on_step = log_per_epoch(table, per_epoch)};
    const auto result = paratrain::fit(s, train, options);
    CHECK(result.epochs.size() == k.epochs);
    CHECK((result.stopped.empty() == (k.epochs == 8)));
    if (!result.stopped.empty()) CHECK(result.stopped.find("early stopping: score") == 0);
  }
  // A name no epoch has: an error on every rank, naming what there is.
  Ddp s(make_net(), comm::Mpi(), torch::optim::SGDOptions(0.01));
  CHECK_THROWS_WITH_AS(paratrain::fit(s, train, {.batch_size = 8, .early_stopping = {.monitor = {"scor"}}, .progress = false}),
                       doctest::Contains("the monitored value 'scor' is not one this epoch has (train_loss, eval_loss, "
                                         "eval_accuracy, loss)"),
                       paratrain::error);
  CHECK_THROWS_WITH_AS(
      paratrain::fit(s, train, {.batch_size = 8, .early_stopping = {.monitor = {"eval_loss"}}, .progress = false}),
      doctest::Contains("needs an evaluation set"), paratrain::error);
}

TEST_CASE("a callback's request to stop, on one rank, stops every rank after that step") {
  comm::Mpi c;
  const int world = c.size(), rank = c.rank();
  const auto train = make_data(200, 1);
  Ddp s(make_net(), comm::Mpi(), torch::optim::SGDOptions(0.01));
  const auto result = paratrain::fit(s, train,
                                     {.epochs = 3, .batch_size = 4, .progress = false,
                                      .on_step = [&](const paratrain::StepInfo& i) {
                                        if (rank == world - 1 && i.step == 5) i.stop->request("enough");
                                      }});
  CHECK(result.stopped == "enough");
  CHECK(result.steps == 6);
  // From on_epoch: after the first epoch.
  const auto second = paratrain::fit(s, train,
                                     {.epochs = 3, .batch_size = 4, .progress = false,
                                      .on_epoch = [&](const paratrain::EpochInfo& e) {
                                        if (rank == 0) e.stop->request("one epoch is plenty");
                                      }});
  CHECK(second.stopped == "one epoch is plenty");
  CHECK(second.epochs.size() == 1);
  CHECK(second.epochs[0].stop == nullptr);
}

TEST_CASE("a time limit saves a checkpoint and returns; the next run resumes to the uninterrupted result") {
  comm::Mpi c;
  const int world = c.size();
  const auto dir = paratrain_test::shared_dir(c, "time-limit");
  const auto train = make_data(203, 1);
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  paratrain::FitOptions options{.epochs = 2, .batch_size = 5, .seed = 3, .progress = false,
                                .checkpoint = {.directory = dir / "ckpt", .async = false}};
  // The reserve alone outlasts the limit: the first check, after step 1, stops.
  options.time_limit = {.seconds = 3600, .reserve_seconds = 3600};
  Ddp first(make_net(), comm::Mpi(), sgd);
  const auto stopped = paratrain::fit(first, train, options);
  CHECK(stopped.stopped == "time limit");
  CHECK(stopped.steps == 1);
  CHECK(paratrain::checkpoint::latest(dir / "ckpt").has_value());
  // From SLURM's end time, already past.
  setenv("SLURM_JOB_END_TIME", std::to_string(std::time(nullptr)).c_str(), 1);
  options.time_limit = {};
  Ddp second(make_net(), comm::Mpi(), sgd);
  const auto again = paratrain::fit(second, train, options);
  unsetenv("SLURM_JOB_END_TIME");
  CHECK(again.stopped == "time limit");
  CHECK(again.steps == 2);  // resumed after step 1, stopped after step 2
  // A run resumed at or past max_steps trains nothing.
  Ddp past(make_net(), comm::Mpi(), sgd);
  auto capped = options;
  capped.max_steps = 2;
  const auto nothing = paratrain::fit(past, train, capped);
  CHECK(nothing.stopped == "max_steps");
  CHECK(nothing.epochs.empty());
  CHECK(nothing.steps == 2);
  // The next job: no limit, resumes and finishes; as one uninterrupted run.
  Ddp third(make_net(), comm::Mpi(), sgd);
  const auto done = paratrain::fit(third, train, options);
  CHECK(done.stopped.empty());
  CHECK(done.resumed_from.has_value());
  auto net = make_net();
  paratrain_test::fit_reference::train(net, train, world, 2, 5, 3, sgd, torch::kCPU);
  CHECK(max_relative_difference(parameters_of(third.model()), parameters_of(net)) <= 1e-5);
  paratrain_test::remove_shared_dir(c, dir);
}

TEST_CASE("checkpoint.best keeps the checkpoint of the best epoch by the monitored value") {
  comm::Mpi c;
  const auto dir = paratrain_test::shared_dir(c, "best");
  const auto train = make_data(64, 1);
  const std::int64_t per_epoch = (64 / c.size() + 7) / 8;
  const std::vector<double> table{0.2, 0.5, 0.4, 0.7, 0.6};  // maximised: epoch 3 is the best
  Ddp s(make_net(), comm::Mpi(), torch::optim::SGDOptions(0.05));
  std::vector<std::vector<torch::Tensor>> after_epoch;
  paratrain::fit(s, train,
                 {.epochs = 5,
                  .batch_size = 8,
                  .progress = false,
                  .on_step = log_per_epoch(table, per_epoch),
                  .on_epoch = [&](const paratrain::EpochInfo&) { after_epoch.push_back(parameters_of(s.model())); },
                  .checkpoint = {.directory = dir, .keep = 1, .best = {"score", paratrain::Goal::maximize}}});
  const auto best = paratrain::checkpoint::latest(dir / "best");
  REQUIRE(best.has_value());
  CHECK(*paratrain::checkpoint::step_of(*best) == 4 * per_epoch);  // after epoch 3
  Ddp loaded(make_net(), comm::Mpi(), torch::optim::SGDOptions(0.05));
  paratrain::checkpoint::load(loaded, *best);
  CHECK(max_relative_difference(parameters_of(loaded.model()), after_epoch.at(3)) == 0);
  paratrain_test::remove_shared_dir(c, dir);
}

// ---- learning-rate schedules -------------------------------------------------------

TEST_CASE("the provided schedules follow their formulas") {
  using paratrain::lr::Clock;
  const auto at = [](std::int64_t step) { return Clock{.step = step, .total_steps = 14, .epoch = 0}; };
  const double pi = std::acos(-1.0);
  // Warm-up over 4 steps, then cosine from 1 to 0.1 over the remaining 10.
  const auto cosine = paratrain::lr::warmup_cosine(4, 0.1);
  CHECK(cosine(at(0)) == doctest::Approx(0.25));
  CHECK(cosine(at(2)) == doctest::Approx(0.75));
  CHECK(cosine(at(3)) == doctest::Approx(1.0));
  CHECK(cosine(at(4)) == doctest::Approx(1.0));
  CHECK(cosine(at(9)) == doctest::Approx(0.1 + 0.9 * 0.5 * (1 + std::cos(pi * 0.5))));
  CHECK(cosine(at(13)) == doctest::Approx(0.1 + 0.9 * 0.5 * (1 + std::cos(pi * 0.9))));
  const auto linear = paratrain::lr::warmup_linear(4);
  CHECK(linear(at(1)) == doctest::Approx(0.5));
  CHECK(linear(at(6)) == doctest::Approx(0.8));
  CHECK(linear(at(13)) == doctest::Approx(0.1));
  const auto decay = paratrain::lr::step_decay(5, 0.5);
  CHECK(decay(at(4)) == 1.0);
  CHECK(decay(at(5)) == 0.5);
  CHECK(decay(at(12)) == 0.25);
  CHECK_THROWS_WITH_AS(paratrain::lr::step_decay(0, 0.5), doctest::Contains("every_steps must be >= 1"), paratrain::error);
}

namespace {

// SGD that keeps the rate its last step applied: what the schedule tests check, not only
// the rate StepInfo reports.
struct AppliedSgd : torch::optim::SGD {
  using torch::optim::SGD::SGD;
  at::Tensor step(LossClosure closure = nullptr) override {
    last = param_groups().front().options().get_lr();
    return torch::optim::SGD::step(std::move(closure));
  }
  static inline double last = 0;
};
using AppliedDdp = paratrain::DataParallel<Net, comm::Mpi, AppliedSgd>;

// Every step's rate, on every rank, as the optimizer applied it (and StepInfo reports it).
struct LrLog {
  std::vector<double> lr;
  std::function<void(const paratrain::StepInfo&)> record() {
    return [this](const paratrain::StepInfo& i) {
      CHECK(i.lr == AppliedSgd::last);
      lr.push_back(AppliedSgd::last);
    };
  }
};

}  // namespace

TEST_CASE("fit sets warm-up + cosine per step, with the linear scaling rule, and resumes it exactly") {
  comm::Mpi c;
  const int world = c.size();
  const auto dir = paratrain_test::shared_dir(c, "schedule");
  const auto train = make_data(100, 1);
  const std::int64_t per_epoch = (100 / world + (100 % world ? 1 : 0) + 3) / 4;  // batch 4
  const std::int64_t total = 3 * per_epoch;
  auto options = paratrain::FitOptions{.epochs = 3,
                                       .batch_size = 4,
                                       .lr_scaling = {.reference_batch = 4},  // × world, from the first step
                                       .lr_schedule = paratrain::lr::warmup_cosine(5, 0.1),
                                       .progress = false};
  LrLog whole;
  options.on_step = whole.record();
  AppliedDdp s(make_net(), comm::Mpi(), torch::optim::SGDOptions(0.2).momentum(0.9));
  paratrain::fit(s, train, options);
  REQUIRE(whole.lr.size() == static_cast<std::size_t>(total));
  const double pi = std::acos(-1.0);
  for (std::int64_t k = 0; k < total; ++k) {
    CAPTURE(k);
    const double f = k < 5 ? double(k + 1) / 5 : 0.1 + 0.9 * 0.5 * (1 + std::cos(pi * double(k - 5) / double(total - 5)));
    CHECK(whole.lr[static_cast<std::size_t>(k)] == doctest::Approx(0.2 * world * f).epsilon(1e-12));
  }
  CHECK(s.optimizer().param_groups()[0].options().get_lr() == 0.2);  // as found, after fit
  // Interrupted after step 4 (mid-epoch), then resumed: the same rates from step 5 on.
  options.checkpoint = {.directory = dir, .async = false};
  LrLog first, second;
  options.on_step = [&](const paratrain::StepInfo& i) {
    first.lr.push_back(AppliedSgd::last);
    if (i.step == 4) i.stop->request("interrupted");
  };
  AppliedDdp a(make_net(), comm::Mpi(), torch::optim::SGDOptions(0.2).momentum(0.9));
  CHECK(paratrain::fit(a, train, options).stopped == "interrupted");
  options.on_step = second.record();
  AppliedDdp b(make_net(), comm::Mpi(), torch::optim::SGDOptions(0.2).momentum(0.9));
  paratrain::fit(b, train, options);
  first.lr.insert(first.lr.end(), second.lr.begin(), second.lr.end());
  CHECK(first.lr == whole.lr);
  CHECK(max_relative_difference(parameters_of(b.model()), parameters_of(s.model())) == 0);
  paratrain_test::remove_shared_dir(c, dir);
}

TEST_CASE("reduce-on-plateau cuts the rate after `patience` epochs without improvement, also across a resume") {
  comm::Mpi c;
  const auto dir = paratrain_test::shared_dir(c, "plateau");
  const auto train = make_data(32, 1);
  const std::int64_t per_epoch = (32 / c.size() + 3) / 4;
  const std::vector<double> table{1, 1, 1, 0.5, 0.5, 0.5, 0.5};
  // Patience 1, as PyTorch's ReduceLROnPlateau counts it: the second epoch in a row without
  // improvement cuts. Epochs 1 and 2 do not improve on 1: cut to 0.5 from epoch 3; 3
  // improves; 4 and 5 do not: cut to 0.25 from epoch 6.
  const std::vector<double> want{1, 1, 1, 0.5, 0.5, 0.5, 0.25};
  const auto run = [&](AppliedDdp& s, int epochs, bool stop_after_4) {
    std::vector<double> lrs;
    auto log = log_per_epoch(table, per_epoch);
    paratrain::fit(s, train,
                   {.epochs = epochs,
                    .batch_size = 4,
                    .reduce_on_plateau = {.monitor = {"score"}, .factor = 0.5, .patience = 1},
                    .progress = false,
                    .on_step =
                        [&](const paratrain::StepInfo& i) {
                          log(i);
                          if (i.step % per_epoch == 0) lrs.push_back(AppliedSgd::last);  // as applied
                        },
                    .on_epoch =
                        [&](const paratrain::EpochInfo& e) {
                          if (stop_after_4 && e.epoch == 4) e.stop->request("interrupted");
                        },
                    .checkpoint = {.directory = dir, .async = false}});
    return lrs;
  };
  AppliedDdp a(make_net(), comm::Mpi(), torch::optim::SGDOptions(0.1));
  auto lrs = run(a, 7, true);
  CHECK(lrs.size() == 5);
  AppliedDdp b(make_net(), comm::Mpi(), torch::optim::SGDOptions(0.1));
  const auto rest = run(b, 7, false);
  lrs.insert(lrs.end(), rest.begin(), rest.end());
  REQUIRE(lrs.size() == want.size());
  for (std::size_t e = 0; e < want.size(); ++e) CHECK(lrs[e] == doctest::Approx(0.1 * want[e]));
  paratrain_test::remove_shared_dir(c, dir);
}

namespace {

// A callback as a user writes one (Note [Loop callbacks]): halves the rate after a complete
// epoch whose "score" does not beat the lowest so far, keeps the epochs that do as the best,
// and, where `asks`, stops after step `stop_at`.
struct Halving {
  bool asks = false;
  std::int64_t stop_at = -1;
  double best = std::numeric_limits<double>::infinity();
  double factor = 1;
  void after_step(const paratrain::StepInfo& s, paratrain::LoopControl& loop) const {
    if (asks && s.step == stop_at) loop.stop("cut short");
  }
  void after_epoch(const paratrain::EpochInfo& e, paratrain::LoopControl& loop) {
    if (!e.complete) return;
    if (const double v = e.metrics.at("score"); v < best) best = v, loop.keep_as_best();
    else factor *= 0.5;
  }
  [[nodiscard]] double learning_rate_factor() const { return factor; }
  void save(paratrain::CallbackState& s) const { s["halving.best"] = best, s["halving.factor"] = factor; }
  void load(const paratrain::CallbackState& s) { best = s.at("halving.best"), factor = s.at("halving.factor"); }
};
static_assert(paratrain::fit_callback<Halving>);
static_assert(!paratrain::fit_callback<int>);

}  // namespace

TEST_CASE("a callback of one's own cuts the rate, keeps the best, stops every rank, and resumes with its state") {
  comm::Mpi c;
  const int world = c.size();
  const auto dir = paratrain_test::shared_dir(c, "callback");
  const auto train = make_data(32, 1);
  const std::int64_t per_epoch = ((32 + world - 1) / world + 3) / 4;  // DistributedSampler pads; batch 4
  const std::vector<double> table{3, 2, 2.5, 1, 1.5, 0.5};
  // Epochs 2 and 4 do not beat the lowest before them: the rate halves from epochs 3 and 5.
  const std::vector<double> want{1, 1, 1, 0.5, 0.5, 0.25};
  const auto run = [&](AppliedDdp& s, Halving h) {
    std::vector<double> lrs;
    auto log = log_per_epoch(table, per_epoch);
    const auto result = paratrain::fit(s, train,
                                       {.epochs = 6,
                                        .batch_size = 4,
                                        .progress = false,
                                        .on_step =
                                            [&](const paratrain::StepInfo& i) {
                                              log(i);
                                              if (i.step % per_epoch == 0) lrs.push_back(AppliedSgd::last);
                                            },
                                        .callbacks = {h},
                                        .checkpoint = {.directory = dir, .async = false}});
    return std::pair(result, lrs);
  };
  // Stopped by the last rank alone, at the first step of epoch 4: every rank stops there.
  AppliedDdp a(make_net(), comm::Mpi(), torch::optim::SGDOptions(0.1));
  auto [first, lrs] = run(a, Halving{.asks = c.rank() == world - 1, .stop_at = 4 * per_epoch});
  CHECK(first.stopped == "cut short");
  CHECK(first.steps == 4 * per_epoch + 1);
  const auto best_then = paratrain::checkpoint::latest(dir / "best");
  REQUIRE(best_then.has_value());
  CHECK(*paratrain::checkpoint::step_of(*best_then) == 4 * per_epoch);  // after epoch 3, the lowest
  // Resumed by a fresh callback: it loads its state (best 1, factor 0.5) from the checkpoint.
  AppliedDdp b(make_net(), comm::Mpi(), torch::optim::SGDOptions(0.1));
  const auto [second, rest] = run(b, Halving{});
  CHECK(second.stopped.empty());
  CHECK(second.resumed_from.has_value());
  lrs.insert(lrs.end(), rest.begin(), rest.end());
  REQUIRE(lrs.size() == want.size());
  for (std::size_t e = 0; e < want.size(); ++e) CHECK(lrs[e] == doctest::Approx(0.1 * want[e]));
  const auto best = paratrain::checkpoint::latest(dir / "best");
  REQUIRE(best.has_value());
  CHECK(*paratrain::checkpoint::step_of(*best) == 6 * per_epoch);  // after epoch 5
  paratrain_test::remove_shared_dir(c, dir);
}

TEST_CASE("a checkpoint saved before the loop's callbacks resumes their state under the callbacks' names") {
  paratrain::detail::FitPosition p{.base_lrs = {0.1}};
  auto fit = paratrain::detail::to_dict(p);
  REQUIRE(fit.erase("callbacks") == 1);
  fit.insert("early_best", 0.25);
  fit.insert("early_bad", std::int64_t{2});
  fit.insert("best_saved", 0.5);
  fit.insert("plateau_factor", 0.125);
  fit.insert("plateau_best", 0.75);
  fit.insert("plateau_bad", std::int64_t{1});
  auto extra = paratrain::checkpoint::make_dict();
  extra.insert("fit", fit);
  const auto q = paratrain::detail::position_from("old", extra);
  CHECK(q.callbacks == paratrain::CallbackState{{"early_stopping.best", 0.25}, {"early_stopping.bad", 2},
                                                {"best.value", 0.5}, {"plateau.factor", 0.125},
                                                {"plateau.best", 0.75}, {"plateau.bad", 1}});
  // And the names the callbacks save now, through a checkpoint's dictionary and back.
  p.callbacks = {{"halving.best", 1.5}, {"halving.factor", 0.5}};
  extra.insert_or_assign("fit", paratrain::detail::to_dict(p));
  CHECK(paratrain::detail::position_from("new", extra).callbacks == p.callbacks);
}

TEST_CASE("LibTorch's own schedulers step the rates from a callback while fit's are off") {
  comm::Mpi c;
  const auto train = make_data(32, 1);
  const std::int64_t per_epoch = (32 / c.size() + 3) / 4;
  AppliedDdp s(make_net(), comm::Mpi(), torch::optim::SGDOptions(0.1));
  torch::optim::StepLR step_lr(s.optimizer(), /*step_size=*/2, /*gamma=*/0.5);
  std::vector<double> lrs;
  paratrain::fit(s, train,
                 {.epochs = 5,
                  .batch_size = 4,
                  .progress = false,
                  .on_step = [&](const paratrain::StepInfo& i) { if (i.step % per_epoch == 0) lrs.push_back(AppliedSgd::last); },
                  .on_epoch = [&](const paratrain::EpochInfo&) { step_lr.step(); }});
  REQUIRE(lrs.size() == 5);
  // LibTorch's StepLR (torch/csrc/api/src/optim/schedulers/step_lr.cpp) cuts at the calls
  // whose count before the call is a positive multiple of step_size: the 3rd, 5th, ...
  // (PyTorch's, which counts a call in its constructor, at the 2nd, 4th, ...).
  const std::vector<double> want{0.1, 0.1, 0.1, 0.05, 0.05};
  for (std::size_t e = 0; e < want.size(); ++e) CHECK(lrs[e] == doctest::Approx(want[e]));
}

// ---- throughput ---------------------------------------------------------------------

TEST_CASE("throughput: tokens/s, TFLOP/s and MFU follow from samples/s by their definitions") {
  comm::Mpi c;
  const auto train = make_data(64, 1);
  Ddp s(make_net(), comm::Mpi(), torch::optim::SGDOptions(0.01));
  // 20 tokens per sample at 3e6 FLOPs each; a peak of 1 TFLOP/s per rank.
  const paratrain::Throughput t{.tokens_per_sample = 20, .flops_per_token = 3e6, .peak_flops_per_rank = 1e12};
  const auto result = paratrain::fit(s, train, {.epochs = 2, .batch_size = 8, .throughput = t, .progress = false});
  for (const auto& e : result.epochs) {
    CHECK(e.rates.samples_per_second == e.samples_per_second);
    CHECK(e.rates.tokens_per_second == doctest::Approx(20 * e.samples_per_second));
    CHECK(e.rates.tflops == doctest::Approx(20 * 3e6 * e.samples_per_second / 1e12));
    CHECK(e.rates.mfu == doctest::Approx(20 * 3e6 * e.samples_per_second / (1e12 * c.size())));
  }
  CHECK(result.rates.tokens_per_second == doctest::Approx(20 * result.samples_per_second));
  CHECK(result.rates.mfu == doctest::Approx(60e6 * result.samples_per_second / (1e12 * c.size())));
  // Without a peak, no MFU; FLOPs per sample take precedence over per token.
  const auto r = paratrain::Rates::of({.tokens_per_sample = 4, .flops_per_sample = 10, .flops_per_token = 1e9}, 100, 2);
  CHECK(r.tflops == doctest::Approx(1000 / 1e12));
  CHECK(r.mfu == 0);
}

// ---- loss scaling ---------------------------------------------------------------------

namespace {

// p · x per sample, p of two elements: the gradient of a step is the mean of its samples' x,
// the record's [1, 2] (or [1, Inf], [1, NaN] where a rank's sample carries the bad value).
struct DotImpl : torch::nn::Module {
  DotImpl() { p = register_parameter("p", torch::ones({2})); }
  torch::Tensor forward(torch::Tensor x) { return (x * p).sum(1); }
  torch::Tensor p;
};
TORCH_MODULE(Dot);

at::Tensor mean_output(const at::Tensor& out, const at::Tensor&) { return out.mean(); }

}  // namespace

TEST_CASE("loss scaling skips and backs off on Inf and NaN, and grows, as PyTorch's GradScaler (recorded)") {
  comm::Mpi c;
  const int world = c.size(), rank = c.rank();
  std::ifstream in(paratrain_test::test_data_dir() / "grad_scaler_reference.json");
  REQUIRE(in);
  const auto record = nlohmann::json::parse(in);
  for (const auto& k : record.at("cases")) {
    const paratrain::LossScaling scaling{.init_scale = k.at("init_scale"),
                                         .growth_factor = k.at("growth_factor"),
                                         .backoff_factor = k.at("backoff_factor"),
                                         .growth_interval = k.at("growth_interval")};
    CAPTURE(scaling.init_scale);
    // The scaler alone, on the record's overflows.
    paratrain::LossScaler alone(scaling);
    // DataParallel, one sample per rank, the bad value on rank t % world: every rank must
    // skip the step and set the same scale.
    paratrain::DataParallel<Dot, comm::Mpi, torch::optim::SGD> s(Dot(), comm::Mpi(), torch::optim::SGDOptions(0.125),
                                                                  {.precision = {.loss_scale = scaling}});
    CHECK(s.loss_scaler().scale() == scaling.init_scale);
    std::int64_t applied = 0;
    const auto steps = k.at("steps").get<std::vector<std::string>>();
    for (std::size_t t = 0; t < steps.size(); ++t) {
      CAPTURE(t);
      const double bad = steps[t] == "inf" ? INFINITY : steps[t] == "nan" ? NAN : 2.0;
      const bool mine = static_cast<int>(t) % world == rank;
      const auto x = torch::tensor({{1.0, mine ? bad : 2.0}});
      const auto r = s.step(Batch{x, torch::zeros({1})}, mean_output);
      alone.update(steps[t] != "ok" || k.at("skipped")[t].get<bool>());
      CHECK(r.skipped == k.at("skipped")[t].get<bool>());
      CHECK(s.loss_scaler().scale() == k.at("scale_after")[t].get<double>());
      CHECK(alone.scale() == k.at("scale_after")[t].get<double>());
      applied += r.skipped ? 0 : 1;
    }
    // The steps applied moved p by the unscaled mean gradient [1, 2] each (SGD, rate 1/8).
    const auto want = torch::tensor({1.0 - 0.125 * double(applied), 1.0 - 0.25 * double(applied)});
    CHECK(torch::equal(s.model()->p.detach(), want.to(torch::kFloat)));
  }
}

TEST_CASE("a scaled step equals the unscaled one bit for bit (DDP, ZeRO-3, a pipeline)") {
  comm::Mpi c;
  const int world = c.size(), rank = c.rank();
  const paratrain::Precision scaled{.loss_scale = paratrain::LossScaling{.init_scale = 1024, .growth_interval = 2}};
  constexpr int micro = 2, steps = 5;
  // The gradient each loss receives in backward, recorded: n x the scale of its step over the
  // step's loss unit (GradScaler's scale of the mean loss; the unit: the largest power of two
  // <= the step's first micro-batch, 3 + q samples, so 2 on replica 0 and 4 on the others:
  // units that differ by rank). The bits alone would not show scaling (scaling by a power of
  // 2 and back is exact).
  std::vector<double> seen;
  const auto recorded = [&seen](const Pair& out, const Batch& b) {
    auto l = weighted_with_aux(out, b);
    l.register_hook([&seen](const at::Tensor& g) { seen.push_back(g.item<double>()); });
    return l;
  };
  const auto train = [&](auto& s, int q) {
    const Samples data;
    seen.clear();
    for (int t = 0; t < steps; ++t) {
      std::vector<Batch> mine;
      for (int m = 0; m < micro; ++m) mine.push_back(data.of(t, q, m));
      s.step(std::span<const Batch>(mine), recorded);
    }
    return s.full_parameters();
  };
  // The scaled run's losses received 1024 / unit x the plain run's in steps 0 and 1, 2048 /
  // unit in 2 and 3, 4096 / unit in 4 (a growth after every 2 clean steps); the plain run's,
  // n (the micro-batch's samples).
  const auto scaled_by_the_scale = [&](auto& s, auto& plain, int q) {
    const auto got = train(s, q);
    const auto with_scale = seen;
    const auto want = train(plain, q);
    const auto without = seen;
    const auto unit = static_cast<double>(std::bit_floor(static_cast<unsigned>(3 + q)));
    REQUIRE(with_scale.size() == without.size());
    for (std::size_t i = 0; i < with_scale.size(); ++i)
      CHECK(with_scale[i] == without[i] * 1024.0 * std::exp2(static_cast<double>(i / micro / 2)) / unit);
    return max_relative_difference(got, want);
  };
  using Zero3 = paratrain::Sharded<torch::optim::SGD, paratrain::zero::stage3>;
  {
    paratrain::DataParallel<TwoOutputs, comm::Mpi, Zero3> plain(TwoOutputs(), comm::Mpi(), momentum_sgd());
    paratrain::DataParallel<TwoOutputs, comm::Mpi, Zero3> s(TwoOutputs(), comm::Mpi(), momentum_sgd(),
                                                            {.precision = scaled});
    CHECK(scaled_by_the_scale(s, plain, rank) == 0);
    CHECK(s.loss_scaler().scale() == 1024 * 4);  // two growths after 2 clean steps each
  }
  {
    paratrain::DataParallel<TwoOutputs, comm::Mpi, torch::optim::SGD> plain(TwoOutputs(), comm::Mpi(), momentum_sgd());
    paratrain::DataParallel<TwoOutputs, comm::Mpi, torch::optim::SGD> s(TwoOutputs(), comm::Mpi(), momentum_sgd(),
                                                                        {.precision = scaled});
    CHECK(scaled_by_the_scale(s, plain, rank) == 0);
    CHECK(s.loss_scaler().scale() == 1024 * 4);
  }
  if (world % 2 == 0) {
    using Two = paratrain::Pipeline<Hidden, Heads>;
    const auto two = [] { return Two([] { return Hidden(5); }, [] { return Heads(); }); };
    paratrain::DataParallel<Two, comm::Mpi, torch::optim::SGD> plain(two(), comm::Mpi(), momentum_sgd());
    paratrain::DataParallel<Two, comm::Mpi, torch::optim::SGD> s(two(), comm::Mpi(), momentum_sgd(),
                                                                 {.data_parallel = {.precision = scaled}});
    CHECK(scaled_by_the_scale(s, plain, s.replica()) == 0);  // the last stage's rank records its losses
    CHECK(s.loss_scaler().scale() == 1024 * 4);
  }
}

TEST_CASE("an overflow on one pipeline stage skips the step on every stage; fit keeps the scale in checkpoints") {
  comm::Mpi c;
  const int world = c.size();
  const auto dir = paratrain_test::shared_dir(c, "loss-scale");
  if (world % 2 == 0) {
    // The last stage's loss is Inf in step 2 (one replica's): every rank of every stage skips.
    using Two = paratrain::Pipeline<Hidden, Heads>;
    paratrain::DataParallel<Two, comm::Mpi, torch::optim::SGD> s(
        Two([] { return Hidden(5); }, [] { return Heads(); }), comm::Mpi(), momentum_sgd(),
        {.data_parallel = {.precision = {.loss_scale = paratrain::LossScaling{.init_scale = 256}}}});
    const Samples data;
    for (int t = 0; t < 4; ++t) {
      std::vector<Batch> mine{data.of(t, s.replica(), 0)};
      if (t == 2 && s.replica() == 0) mine[0].extra["weight"] = mine[0].extra["weight"] * INFINITY;
      const auto r = s.step(std::span<const Batch>(mine), weighted_with_aux);
      CHECK(r.skipped == (t == 2));
    }
    CHECK(s.loss_scaler().scale() == 128);
  }
  // fit: saved with the checkpoint, restored on resume (a scale that grows every step).
  const auto train = make_data(64, 1);
  const paratrain::Precision precision{.loss_scale = paratrain::LossScaling{.init_scale = 2, .growth_interval = 1}};
  paratrain::FitOptions options{.epochs = 1, .batch_size = 4, .progress = false,
                                .checkpoint = {.directory = dir, .async = false}};
  options.on_step = [](const paratrain::StepInfo& i) {
    if (i.step == 2) i.stop->request("interrupted");
  };
  Ddp a(make_net(), comm::Mpi(), torch::optim::SGDOptions(0.01), {.precision = precision});
  paratrain::fit(a, train, options);
  CHECK(a.loss_scaler().scale() == 16);  // 3 steps
  options.on_step = {};
  Ddp b(make_net(), comm::Mpi(), torch::optim::SGDOptions(0.01), {.precision = precision});
  const auto done = paratrain::fit(b, train, options);
  CHECK(b.loss_scaler().scale() == 2.0 * std::pow(2.0, double(done.steps)));
  paratrain_test::remove_shared_dir(c, dir);
}

// ---- a loop of your own: two models, two optimizers (GAN-style) ---------------------

TEST_CASE("a GAN-style loop of two strategies trains as the same loop on one device") {
  // Docs: docs/fit-reference.md, "A loop of your own". Generator 4 -> 8, discriminator 8 -> 1, each
  // a DataParallel with its own optimizer. A discriminator step on real and generated
  // samples (the generator's output detached), then a generator step through the
  // discriminator with its parameters frozen (requires_grad off: no gradient, so its
  // strategy's hooks stay quiet and its step is untouched). Rank r has 3 + r samples.
  comm::Mpi c;
  const int world = c.size(), rank = c.rank();
  const auto make = [](std::int64_t in, std::int64_t out, std::int64_t seed) {
    torch::manual_seed(seed);
    return torch::nn::Linear(in, out);
  };
  const auto bce = [](const at::Tensor& logits, const at::Tensor& target) {
    return F::binary_cross_entropy_with_logits(logits.squeeze(1), target);
  };
  torch::manual_seed(21);
  const auto real = torch::randn({256, 8}) + 1, noise = torch::randn({256, 4});
  const auto rows = [&](const at::Tensor& t, int step, int r) { return t.narrow(0, step * 32 + r * 8, 3 + r); };
  constexpr int steps = 5;
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  using Strategy = paratrain::DataParallel<torch::nn::Linear, comm::Mpi, torch::optim::SGD>;
  Strategy g(make(4, 8, 1), comm::Mpi(), sgd), d(make(8, 1, 2), comm::Mpi(), sgd);
  const auto set_trainable = [](torch::nn::Module& m, bool on) {
    for (auto& p : m.parameters()) p.requires_grad_(on);
  };
  for (int t = 0; t < steps; ++t) {
    const auto z = rows(noise, t, rank), x = rows(real, t, rank);
    // The discriminator: real samples labelled 1, generated ones 0.
    at::Tensor fake;
    {
      torch::NoGradGuard no_grad;
      fake = g.model()->forward(z);
    }
    d.step(Batch{torch::cat({x, fake}), torch::cat({torch::ones({x.size(0)}), torch::zeros({fake.size(0)})})}, bce);
    // The generator: its samples labelled 1 by the discriminator, whose parameters stay put.
    set_trainable(*d.model(), false);
    auto& critic = d.model();
    g.step(Batch{z, torch::ones({z.size(0)})},
           [&](const at::Tensor& generated, const Batch& b) { return bce(critic->forward(generated), b.target); });
    set_trainable(*d.model(), true);
  }
  // One device, the same loop on the union of the ranks' samples.
  auto G = make(4, 8, 1), D = make(8, 1, 2);
  torch::optim::SGD og(G->parameters(), sgd), od(D->parameters(), sgd);
  for (int t = 0; t < steps; ++t) {
    std::vector<at::Tensor> xs, zs;
    for (int r = 0; r < world; ++r) xs.push_back(rows(real, t, r)), zs.push_back(rows(noise, t, r));
    // The discriminator's union: each rank's real samples then its generated ones.
    std::vector<at::Tensor> inputs, labels;
    for (int r = 0; r < world; ++r) {
      torch::NoGradGuard no_grad;
      const auto f = G->forward(zs[r]);
      inputs.push_back(torch::cat({xs[r], f}));
      labels.push_back(torch::cat({torch::ones({xs[r].size(0)}), torch::zeros({f.size(0)})}));
    }
    od.zero_grad();
    bce(D->forward(torch::cat(inputs)), torch::cat(labels)).backward();
    od.step();
    og.zero_grad();
    set_trainable(*D, false);
    const auto z = torch::cat(zs);
    bce(D->forward(G->forward(z)), torch::ones({z.size(0)})).backward();
    set_trainable(*D, true);
    og.step();
  }
  const auto params = [](torch::nn::Module& m) {
    std::vector<torch::Tensor> out;
    for (auto& p : m.parameters()) out.push_back(p.detach().clone());
    return out;
  };
  CHECK(max_relative_difference(params(*g.model()), params(*G)) <= 1e-5);
  CHECK(max_relative_difference(params(*d.model()), params(*D)) <= 1e-5);
}

}  // namespace loop_test
