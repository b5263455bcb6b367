// The promise, for every schedule and layout: a pipeline of K stage ranks (times R
// replicas) gives, step by step, the parameters of single-device training on the union
// of the step's micro-batches.
//
// The reference is plain LibTorch: the same stages, built from the same seeds, chained
// on one process over the concatenated batch, with the mean loss and SGD with momentum
// (a wrong gradient scale shows). The stages take two inputs and pass one of them on
// untouched (tuples of activations, one of them needing no gradient), and micro-batches
// differ in size across micro-batches and replicas.
#include <torch/torch.h>

#include <filesystem>
#include <tuple>
#include <unistd.h>
#include <vector>

#include "paratrain/checkpoint/checkpoint.hpp"
#include "paratrain/comm/mpi.hpp"
#include "paratrain/fit.hpp"
#include "paratrain/pipeline/schedule.hpp"
#include "paratrain/strategy/pipeline.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "paratrain/strategy/unit.hpp"
#include "support/doctest.hpp"

namespace {

namespace comm = paratrain::comm;
namespace zero = paratrain::zero;
namespace pipeline = paratrain::pipeline;
using paratrain::Pipeline;
using paratrain::PipelineOptions;
using Tensor = torch::Tensor;

constexpr int features = 6, width = 8, classes = 3;

// (x, z) -> (h, z)
struct EntryImpl : torch::nn::Module {
  EntryImpl() { fc = register_module("fc", paratrain::Unit<torch::nn::Linear>(features, width)); }
  std::tuple<Tensor, Tensor> forward(Tensor x, Tensor z) { return {torch::tanh(fc(x)), z}; }
  paratrain::Unit<torch::nn::Linear> fc{nullptr};
};
TORCH_MODULE(Entry);

// (h, z) -> (h', z)
struct MidImpl : torch::nn::Module {
  MidImpl() { fc = register_module("fc", paratrain::Unit<torch::nn::Linear>(width, width)); }
  std::tuple<Tensor, Tensor> forward(Tensor h, Tensor z) { return {torch::tanh(fc(h)) + 0.1 * z, z}; }
  paratrain::Unit<torch::nn::Linear> fc{nullptr};
};
TORCH_MODULE(Mid);

// (h, z) -> logits
struct HeadImpl : torch::nn::Module {
  HeadImpl() { fc = register_module("fc", paratrain::Unit<torch::nn::Linear>(width, classes)); }
  Tensor forward(Tensor h, Tensor z) { return fc(h) + 0.5 * z.narrow(1, 0, classes); }
  paratrain::Unit<torch::nn::Linear> fc{nullptr};
};
TORCH_MODULE(Head);

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

// Stage i, the same on every rank and in the reference.
template <class Stage>
Stage make_stage(std::size_t i) {
  torch::manual_seed(100 + static_cast<int>(i));
  Stage s;
  s->to(torch::kDouble);
  return s;
}

template <class... Stage>
Pipeline<Stage...> seeded(Pipeline<Stage...>*) {
  return [&]<std::size_t... I>(std::index_sequence<I...>) {
    return Pipeline<Stage...>([] { return make_stage<Stage>(I); }...);
  }(std::index_sequence_for<Stage...>{});
}

// Replica r's micro-batch m of step t: 2 to 4 samples, so sizes differ everywhere.
paratrain::Batch micro_batch(int t, int r, int m) {
  torch::manual_seed(1000 * t + 37 * r + m);
  const int n = 2 + (t + r + m) % 3;
  auto x = torch::randn({n, features}, torch::kDouble);
  auto z = torch::randn({n, width}, torch::kDouble);
  auto y = torch::randint(classes, {n}, torch::kLong);
  return {{x, z}, y};
}

torch::optim::SGDOptions sgd_options() { return torch::optim::SGDOptions(0.1).momentum(0.9); }

// Single-device training on the union of every replica's micro-batches: the stages'
// parameters after each of `steps` steps, per stage.
template <class... Stage>
struct Reference {
template <class Optim, class Options>
static std::vector<std::vector<Tensor>> run(int replicas, int micro, int steps, Options options, double clip = 0) {
  auto stages = [&]<std::size_t... I>(std::index_sequence<I...>) {
    return std::tuple<Stage...>{make_stage<Stage>(I)...};
  }(std::index_sequence_for<Stage...>{});
  std::vector<Tensor> params;
  std::apply([&](auto&... s) { (..., [&] { for (auto& p : s->parameters()) params.push_back(p); }()); }, stages);
  Optim sgd(params, options);
  for (int t = 0; t < steps; ++t) {
    std::vector<Tensor> xs, zs, ys;
    for (int r = 0; r < replicas; ++r)
      for (int m = 0; m < micro; ++m) {
        auto b = micro_batch(t, r, m);
        xs.push_back(b.inputs[0]), zs.push_back(b.inputs[1]), ys.push_back(b.target);
      }
    sgd.zero_grad();
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
    torch::nn::functional::cross_entropy(out, torch::cat(ys)).backward();
    if (clip > 0) torch::nn::utils::clip_grad_norm_(params, clip);
    sgd.step();
  }
  std::vector<std::vector<Tensor>> out;
  std::apply([&](auto&... s) { (out.push_back(s->parameters()), ...); }, stages);
  return out;
}
};

double max_relative_difference(const std::vector<Tensor>& got, const std::vector<Tensor>& want) {
  REQUIRE(got.size() == want.size());
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, ((got[i] - want[i]).abs().max() / want[i].abs().max()).item<double>());
  return worst;
}

template <class Update, class P>
void check_pipeline(PipelineOptions options, int micro, int steps = 20) {
  const double clip = options.data_parallel.max_grad_norm;
  using Strategy = paratrain::DataParallel<P, comm::Mpi, Update>;
  Strategy s(seeded(static_cast<P*>(nullptr)), comm::Mpi(), torch::optim::SGDOptions(0.1).momentum(0.9), options);
  const int K = s.pipeline_size(), R = s.replicas();
  CAPTURE(K);
  CAPTURE(R);
  CAPTURE(micro);
  CAPTURE(s.schedule_for(micro).name);
  int peak = 0;
  double loss_sum = 0;
  for (int t = 0; t < steps; ++t) {
    std::vector<paratrain::Batch> mine;
    for (int m = 0; m < micro; ++m) mine.push_back(micro_batch(t, s.replica(), m));
    const auto r = s.step(std::span<const paratrain::Batch>(mine), paratrain::CrossEntropy{});
    CHECK(r.has_loss == s.owns(static_cast<int>(P::size) - 1));
    if (r.has_loss) loss_sum += r.loss;
    peak = std::max(peak, s.last_step_stats().peak_stashed);
  }
  const auto want = [&]<class... Stage>(Pipeline<Stage...>*) {
    return Reference<Stage...>::template run<torch::optim::SGD>(R, micro, steps, sgd_options(), clip);
  }(static_cast<P*>(nullptr));
  std::vector<Tensor> expected;
  for (int i = 0; i < static_cast<int>(P::size); ++i)
    if (s.owns(i)) expected.insert(expected.end(), want[i].begin(), want[i].end());
  CHECK(max_relative_difference(s.full_parameters(), expected) <= 1e-5);
  // 1F1B and ZB-H1 keep at most K micro-batches' activations (rank r: K - r); GPipe all M.
  const auto kind = options.schedule;
  if (kind == pipeline::Kind::one_f_one_b) CHECK(peak <= std::min(K - s.pipeline_rank(), micro));
  if (kind == pipeline::Kind::zero_bubble_h1) CHECK(peak <= std::min(K, micro));
  if (kind == pipeline::Kind::gpipe) CHECK(peak == micro);
}

template <class Update, std::size_t S>
void check_schedules(int v = 1) {
  for (const auto kind : {pipeline::Kind::gpipe, pipeline::Kind::one_f_one_b, pipeline::Kind::zero_bubble_h1,
                          pipeline::Kind::interleaved_1f1b}) {
    if ((kind == pipeline::Kind::interleaved_1f1b) != (v > 1)) continue;
    if (kind == pipeline::Kind::zero_bubble_h1 && paratrain::detail::zero_stage_of<Update> == 3) continue;
    for (int micro : {1, 2, 4, 8}) check_pipeline<Update, ChainOf<S>>({.schedule = kind, .virtual_stages = v}, micro);
  }
}

struct Plain {
  using type = torch::optim::SGD;
};
template <class Stage>
struct Zero {
  using type = paratrain::Sharded<torch::optim::SGD, Stage>;
};

}  // namespace

TEST_CASE("a pipeline trains as one device does, for every schedule, K and replica count") {
  const int world = comm::Mpi().size();
  // Every K in {2, 3, 4} that divides the world; the rest of the world are replicas.
  if (world % 2 == 0) check_schedules<Plain::type, 2>();
  if (world == 3) check_schedules<Plain::type, 3>();
  if (world == 4) check_schedules<Plain::type, 4>();
  // Interleaved: v = 2 stages per rank.
  if (world % 2 == 0) check_schedules<Plain::type, 4>(2);
  if (world == 3) check_schedules<Plain::type, 6>(2);
  if (world == 1) check_schedules<Plain::type, 2>(2);  // one rank runs both stages, messages to itself
}

TEST_CASE("Pipeline x Sharded: each stage's replicas shard it, stages 1-3") {
  const int world = comm::Mpi().size();
  if (world % 2 != 0) return;
  using T1 = Zero<zero::stage1>;
  using T2 = Zero<zero::stage2>;
  using T3 = Zero<zero::stage3>;
  for (int micro : {1, 4}) {
    check_pipeline<T1::type, ChainOf<2>>({.schedule = pipeline::Kind::one_f_one_b}, micro);
    check_pipeline<T2::type, ChainOf<2>>({.schedule = pipeline::Kind::zero_bubble_h1}, micro);
    check_pipeline<T3::type, ChainOf<2>>({.schedule = pipeline::Kind::one_f_one_b}, micro);
    check_pipeline<T3::type, ChainOf<2>>({.schedule = pipeline::Kind::gpipe}, micro);
  }
}

TEST_CASE("gradient clipping takes the norm over every stage, as clip_grad_norm_ on the whole model") {
  const int world = comm::Mpi().size();
  paratrain::DataParallelOptions clipped{.max_grad_norm = 0.05};
  if (world % 2 == 0)
    check_pipeline<Plain::type, ChainOf<2>>({.schedule = pipeline::Kind::one_f_one_b, .data_parallel = clipped}, 4);
  if (world == 3)
    check_pipeline<Plain::type, ChainOf<3>>({.schedule = pipeline::Kind::zero_bubble_h1, .data_parallel = clipped}, 4);
  if (world % 2 == 0)
    check_pipeline<Zero<zero::stage2>::type, ChainOf<2>>({.schedule = pipeline::Kind::gpipe, .data_parallel = clipped},
                                                         2);
}

TEST_CASE("a pipeline whose stages do not fit the world is an error on every rank") {
  const int world = comm::Mpi().size();
  using P = ChainOf<3>;
  if (world % 3 == 0) return;
  using Strategy = paratrain::DataParallel<P, comm::Mpi>;
  CHECK_THROWS_WITH_AS(Strategy(seeded(static_cast<P*>(nullptr)), comm::Mpi(), torch::optim::SGDOptions(0.1)),
                       doctest::Contains("launch a multiple of 3"), paratrain::error);
  CHECK_THROWS_WITH_AS(
      Strategy(seeded(static_cast<P*>(nullptr)), comm::Mpi(), torch::optim::SGDOptions(0.1), {.virtual_stages = 2}),
      doctest::Contains("divisor of the stage count"), paratrain::error);
}

namespace {

// The model the pipeline of Entry | Head is, whole: its submodules carry the stages'
// default names, so their state dicts agree (Note [Stage names]).
struct WholeImpl : torch::nn::Module {
  WholeImpl() {
    entry = register_module("0", make_stage<Entry>(7));
    head = register_module("1", make_stage<Head>(8));
  }
  Tensor forward(Tensor x, Tensor z) {
    auto [h, zz] = entry(x, z);
    return head(h, zz);
  }
  Entry entry{nullptr};
  Head head{nullptr};
};
TORCH_MODULE(Whole);

// Step t's union batch, dealt out to the data-parallel ranks of a non-pipelined run.
paratrain::Batch share_of(int t, int replicas, int micro, int rank, int world) {
  std::vector<Tensor> xs, zs, ys;
  for (int k = 0; k < replicas * micro; ++k)
    if (k % world == rank) {
      auto b = micro_batch(t, k / micro, k % micro);
      xs.push_back(b.inputs[0]), zs.push_back(b.inputs[1]), ys.push_back(b.target);
    }
  if (xs.empty()) return {{torch::zeros({0, features}, torch::kDouble), torch::zeros({0, width}, torch::kDouble)},
                          torch::zeros({0}, torch::kLong)};
  return {{torch::cat(xs), torch::cat(zs)}, torch::cat(ys)};
}

}  // namespace

TEST_CASE("a pipeline's checkpoint loads into the whole model under DDP, and back, as one device trains") {
  comm::Mpi c;
  if (c.size() % 2 != 0) return;
  namespace fs = std::filesystem;
  auto id = torch::full({1}, c.rank() == 0 ? static_cast<std::int64_t>(::getpid()) : 0, torch::kLong);
  c.all_reduce(id, paratrain::reduce_op::sum);
  const auto dir = fs::temp_directory_path() / ("paratrain-pipeline-" + std::to_string(id.item<std::int64_t>()));
  using P = ChainOf<2>;
  using Pipe = paratrain::DataParallel<P, comm::Mpi, torch::optim::Adam>;
  const auto adam = torch::optim::AdamOptions(1e-2);
  const int micro = 2, R = c.size() / 2;
  const auto train_pipeline = [&](Pipe& s, int from, int to) {
    for (int t = from; t < to; ++t) {
      std::vector<paratrain::Batch> mine;
      for (int m = 0; m < micro; ++m) mine.push_back(micro_batch(t, s.replica(), m));
      s.step(std::span<const paratrain::Batch>(mine), paratrain::CrossEntropy{});
    }
  };
  Pipe first(seeded(static_cast<P*>(nullptr)), c, adam);
  train_pipeline(first, 0, 4);
  paratrain::checkpoint::save(first, dir, 4);
  // Into the whole model, data-parallel over every rank, which trains on.
  paratrain::DataParallel<Whole, comm::Mpi, torch::optim::Adam> ddp(Whole(), c, adam);
  paratrain::checkpoint::load(ddp, paratrain::checkpoint::path_of(dir, 4));
  for (int t = 4; t < 8; ++t) ddp.step(share_of(t, R, micro, c.rank(), c.size()), paratrain::CrossEntropy{});
  paratrain::checkpoint::save(ddp, dir, 8);
  // And back into a pipeline, which finishes.
  Pipe second(seeded(static_cast<P*>(nullptr)), c, adam);  // step 0's weights: the checkpoint sets them
  paratrain::checkpoint::load(second, paratrain::checkpoint::path_of(dir, 8));
  train_pipeline(second, 8, 12);
  const auto want = Reference<Entry, Head>::run<torch::optim::Adam>(R, micro, 12, adam);
  std::vector<Tensor> expected;
  for (int i = 0; i < 2; ++i)
    if (second.owns(i)) expected.insert(expected.end(), want[i].begin(), want[i].end());
  CHECK(max_relative_difference(second.full_parameters(), expected) <= 1e-5);
  // The whole model in one file, from the pipeline's ranks, equals what they hold.
  paratrain::checkpoint::save_model(second, dir / "model.pt");
  paratrain::DataParallel<Whole, comm::Mpi, torch::optim::Adam> whole(Whole(), c, adam);
  paratrain::checkpoint::load_model(whole, dir / "model.pt");
  const auto all = whole.full_parameters();
  const auto entry_params = static_cast<std::ptrdiff_t>(want[0].size());
  const std::vector<Tensor> held = second.owns(0) ? std::vector<Tensor>(all.begin(), all.begin() + entry_params)
                                                  : std::vector<Tensor>(all.begin() + entry_params, all.end());
  CHECK(max_relative_difference(held, expected) <= 1e-5);
  c.barrier();
  if (c.rank() == 0) fs::remove_all(dir);
}

TEST_CASE("fit trains a pipeline (2-D where the world allows) as one device trains on the same sample order") {
  comm::Mpi c;
  if (c.size() % 2 != 0) return;
  using P = ChainOf<2>;
  paratrain::DataParallel<P, comm::Mpi> s(seeded(static_cast<P*>(nullptr)), c, sgd_options(),
                                          {.schedule = pipeline::Kind::zero_bubble_h1});
  // 60 samples: per replica, micro-batches of 3, 4 per step, so the last step is short.
  torch::manual_seed(5);
  const auto x = torch::randn({60, features}, torch::kDouble), z = torch::randn({60, width}, torch::kDouble);
  const auto y = torch::randint(classes, {60}, torch::kLong);
  const paratrain::data::TensorDataset train({x, z}, y), test({x.narrow(0, 0, 17), z.narrow(0, 0, 17)}, y.narrow(0, 0, 17));
  const paratrain::FitOptions options{.epochs = 2, .batch_size = 3, .accumulation = 4, .shuffle = true, .seed = 3,
                                      .eval = &test, .progress = false};
  const auto result = paratrain::fit(s, train, options);
  // The reference: each step's samples are the union of the replicas' DistributedSampler
  // windows (sampler_test checks that sampler against PyTorch's).
  Entry entry = make_stage<Entry>(0);
  Head head = make_stage<Head>(1);
  std::vector<Tensor> params = entry->parameters();
  for (auto& p : head->parameters()) params.push_back(p);
  torch::optim::SGD sgd(params, sgd_options());
  const int R = s.replicas();
  const auto forward = [&](const Tensor& idx) {
    auto [h, zz] = entry(x.index_select(0, idx), z.index_select(0, idx));
    return head(h, zz);
  };
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::vector<std::vector<std::int64_t>> order;
    for (int r = 0; r < R; ++r) {
      paratrain::data::DistributedSampler sampler(60, {.num_replicas = R, .rank = r, .shuffle = true, .seed = 3});
      sampler.set_epoch(epoch);
      order.push_back(sampler.indices());
    }
    const auto per_step = static_cast<std::size_t>(3 * 4);
    for (std::size_t begin = 0; begin < order[0].size(); begin += per_step) {
      std::vector<std::int64_t> idx;
      for (const auto& o : order)
        for (auto i = begin; i < std::min(o.size(), begin + per_step); ++i) idx.push_back(o[i]);
      sgd.zero_grad();
      torch::nn::functional::cross_entropy(forward(torch::tensor(idx)), y.index_select(0, torch::tensor(idx))).backward();
      sgd.step();
    }
  }
  const std::vector<Tensor> expected = s.owns(0) ? entry->parameters() : head->parameters();
  CHECK(max_relative_difference(s.full_parameters(), expected) <= 1e-5);
  torch::NoGradGuard no_grad;
  const auto test_idx = torch::arange(17);
  const double eval_loss = torch::nn::functional::cross_entropy(forward(test_idx), y.narrow(0, 0, 17)).item<double>();
  CHECK(result.epochs.back().eval_samples == 17);
  CHECK(result.epochs.back().eval_loss == doctest::Approx(eval_loss).epsilon(1e-9));
  CHECK(result.epochs.back().train_loss > 0);
}
