// The promise, for every schedule and layout: a pipeline of K stage ranks (times R
// replicas) gives, step by step, the parameters of single-device training on the union
// of the step's micro-batches (support/pipeline_equivalence.hpp: the stages, the data and
// the plain-LibTorch reference). Also: checkpoints to and from the whole model, fit,
// clipping, and the errors of a pipeline that does not fit the world.
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "paratrain/checkpoint/checkpoint.hpp"
#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/fit/fit.hpp"
#include "paratrain/pipeline/schedule.hpp"
#include "paratrain/pipeline/pipeline.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "paratrain/strategy/unit.hpp"
#include "support/doctest.hpp"
#include "support/shared_dir.hpp"
#include "support/pipeline_equivalence.hpp"

namespace {

namespace comm = paratrain::comm;
using namespace paratrain_test::pipe;
using paratrain_test::max_relative_difference;

template <class Update, class P>
void check_pipeline(PipelineOptions options, int micro, int steps = 20) {
  paratrain_test::pipe::check_pipeline<comm::Mpi, Update, P>(comm::Mpi(), options, micro, steps);
}

// Every schedule (interleaved when v > 1) at M = 1, 2, 4, 8, and M = K: interleaved 1F1B
// runs as such only when K divides M (otherwise chunk by chunk, GPipe-fashion).
template <class Update, std::size_t S>
void check_schedules(int v = 1) {
  const int K = static_cast<int>(S) / v;
  std::vector<int> micros{1, 2, 4, 8};
  if (std::find(micros.begin(), micros.end(), K) == micros.end()) micros.push_back(K);  // K = 3
  for (const auto kind : {pipeline::Kind::gpipe, pipeline::Kind::one_f_one_b, pipeline::Kind::zero_bubble_h1,
                          pipeline::Kind::interleaved_1f1b}) {
    if ((kind == pipeline::Kind::interleaved_1f1b) != (v > 1)) continue;
    for (int micro : micros) check_pipeline<Update, ChainOf<S>>({.schedule = kind, .virtual_stages = v}, micro);
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
    // Each stage sharded as it is built (its maker ends with .to(kDouble), a no-op then).
    check_pipeline<T3::type, ChainOf<2>>({.schedule = pipeline::Kind::one_f_one_b,
                                          .data_parallel = {.build = {.dtype = torch::kDouble}},
                                          .sharded_construction = true},
                                         micro);
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
  using Strategy = paratrain::DataParallel<P, comm::Mpi, torch::optim::SGD>;
  CHECK_THROWS_WITH_AS(Strategy(seeded(static_cast<P*>(nullptr)), comm::Mpi(), torch::optim::SGDOptions(0.1)),
                       doctest::Contains("launch a multiple of 3"), paratrain::error);
  CHECK_THROWS_WITH_AS(
      Strategy(seeded(static_cast<P*>(nullptr)), comm::Mpi(), torch::optim::SGDOptions(0.1), {.virtual_stages = 2}),
      doctest::Contains("divisor of the stage count"), paratrain::error);
}

TEST_CASE("a pipeline refuses deterministic mode on every rank") {
  using P = ChainOf<2>;
  using Strategy = paratrain::DataParallel<P, comm::Mpi, torch::optim::SGD>;
  CHECK_THROWS_WITH_AS(Strategy(seeded(static_cast<P*>(nullptr)), comm::Mpi(), torch::optim::SGDOptions(0.1),
                                {.data_parallel = {.deterministic = {.shards = 12}}}),
                       doctest::Contains("deterministic mode (PipelineOptions::data_parallel.deterministic)"),
                       paratrain::error);
}

// ZB-H1 computes weight gradients after ZeRO-3 has freed the unit they belong to: refused
// before any collective, on every rank, naming the schedules and stages that work.
TEST_CASE("a pipeline refuses ZB-H1 with ZeRO-3 on every rank") {
  using P = ChainOf<2>;
  using Strategy = paratrain::DataParallel<P, comm::Mpi, Zero<zero::stage3>::type>;
  comm::Mpi c;
  int refused = 0;
  try {
    Strategy s(seeded(static_cast<P*>(nullptr)), comm::Mpi(), torch::optim::SGDOptions(0.1),
               {.schedule = pipeline::Kind::zero_bubble_h1});
  } catch (const paratrain::error& e) {
    refused = 1;
    CHECK(e.operation() == "Pipeline");
    CHECK(std::string(e.what()).find("ZB-H1 computes a stage's weight gradients after ZeRO-3 has freed its gathered "
                                     "parameters; use 1F1B or GPipe with zero::stage3, or ZB-H1 with stages 0-2") !=
          std::string::npos);
  }
  auto all = torch::full({1}, refused, torch::kLong);
  c.all_reduce(all, paratrain::reduce_op::sum);
  CHECK(all.item<std::int64_t>() == c.size());
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

// Steps [from, to) of a pipeline, each on `micro` micro-batches of its replica.
template <class Pipe>
void train_pipeline(Pipe& s, int micro, int from, int to) {
  for (int t = from; t < to; ++t) {
    std::vector<paratrain::Batch> mine;
    for (int m = 0; m < micro; ++m) mine.push_back(micro_batch(t, s.replica(), m));
    s.step(std::span<const paratrain::Batch>(mine), paratrain::CrossEntropy{});
  }
}

}  // namespace

TEST_CASE("a pipeline's checkpoint loads into the whole model under DDP, and back, as one device trains") {
  comm::Mpi c;
  if (c.size() % 2 != 0) return;
  namespace fs = std::filesystem;
  const auto dir = paratrain_test::shared_dir(c, "pipeline");
  using P = ChainOf<2>;
  using Pipe = paratrain::DataParallel<P, comm::Mpi, torch::optim::Adam>;
  const auto adam = torch::optim::AdamOptions(1e-2);
  const int micro = 2, R = c.size() / 2;
  Pipe first(seeded(static_cast<P*>(nullptr)), c, adam);
  train_pipeline(first, micro, 0, 4);
  paratrain::checkpoint::save(first, dir, 4);
  // Into the whole model, data-parallel over every rank, which trains on.
  paratrain::DataParallel<Whole, comm::Mpi, torch::optim::Adam> ddp(Whole(), c, adam);
  paratrain::checkpoint::load(ddp, paratrain::checkpoint::path_of(dir, 4));
  for (int t = 4; t < 8; ++t) ddp.step(share_of(t, R, micro, c.rank(), c.size()), paratrain::CrossEntropy{});
  paratrain::checkpoint::save(ddp, dir, 8);
  // And back into a pipeline, which finishes.
  Pipe second(seeded(static_cast<P*>(nullptr)), c, adam);  // step 0's weights: the checkpoint sets them
  paratrain::checkpoint::load(second, paratrain::checkpoint::path_of(dir, 8));
  train_pipeline(second, micro, 8, 12);
  const auto want = Reference<Entry, Head>::run<torch::optim::Adam>(R, micro, 12, adam);
  std::vector<Tensor> expected;
  for (int i = 0; i < 2; ++i)
    if (second.owns(i)) expected.insert(expected.end(), want.params[i].begin(), want.params[i].end());
  CHECK(max_relative_difference(second.full_parameters(), expected) <= 1e-5);
  // The whole model in one file, from the pipeline's ranks, equals what they hold.
  paratrain::checkpoint::save_model(second, dir / "model.pt");
  paratrain::DataParallel<Whole, comm::Mpi, torch::optim::Adam> whole(Whole(), c, adam);
  paratrain::checkpoint::load_model(whole, dir / "model.pt");
  const auto all = whole.full_parameters();
  const auto entry_params = static_cast<std::ptrdiff_t>(want.params[0].size());
  const std::vector<Tensor> held = second.owns(0) ? std::vector<Tensor>(all.begin(), all.begin() + entry_params)
                                                  : std::vector<Tensor>(all.begin() + entry_params, all.end());
  CHECK(max_relative_difference(held, expected) <= 1e-5);
  c.barrier();
  if (c.rank() == 0) fs::remove_all(dir);
}

// Note [Checkpoint format]: every load reshards, a pipeline's too. A pipeline of K = 2 ranks
// per replica (R = W/2 replicas, 2 micro-batches each) saves; the same stages as an
// interleaved pipeline on one rank each (K = 1, R = W, 1 micro-batch: the same W micro-batches
// a step) load it and train on, with SGD with momentum, whose state must follow the
// parameters. Against one device trained on each step's union.
TEST_CASE("a pipeline's checkpoint loads into a pipeline of another shape (K 2 -> 1, R W/2 -> W), as one device trains") {
  comm::Mpi c;
  if (c.size() % 2 != 0) return;
  namespace fs = std::filesystem;
  const auto dir = paratrain_test::shared_dir(c, "pipeline_reshape");
  using P = ChainOf<2>;
  using Pipe = paratrain::DataParallel<P, comm::Mpi, torch::optim::SGD>;
  const int w = c.size();
  {
    Pipe first(seeded(static_cast<P*>(nullptr)), c, sgd_options());
    REQUIRE(first.pipeline_size() == 2);
    train_pipeline(first, 2, 0, 4);
    paratrain::checkpoint::save(first, dir, 4);
  }
  Pipe second(seeded(static_cast<P*>(nullptr)), c, sgd_options(),
              {.schedule = pipeline::Kind::interleaved_1f1b, .virtual_stages = 2});
  REQUIRE(second.pipeline_size() == 1);
  REQUIRE(second.replicas() == w);
  CHECK(paratrain::checkpoint::load(second, paratrain::checkpoint::path_of(dir, 4)).world_size == w);
  train_pipeline(second, 1, 4, 8);
  using Shape = Reference<Entry, Head>::Shape;
  std::vector<Shape> shape(4, Shape{w / 2, 2});
  shape.resize(8, Shape{w, 1});
  const auto want = Reference<Entry, Head>::run_shaped<torch::optim::SGD>(shape, sgd_options());
  std::vector<Tensor> expected;
  for (int i = 0; i < 2; ++i) expected.insert(expected.end(), want.params[i].begin(), want.params[i].end());
  CHECK(max_relative_difference(second.full_parameters(), expected) <= 1e-5);
  c.barrier();
  if (c.rank() == 0) fs::remove_all(dir);
}

// Every stage pass is a span of fit's trace (Note [Zero-cost timeline]): each rank runs one
// forward and one backward per micro-batch of each step of 1F1B.
TEST_CASE("fit's trace shows each stage pass of a pipeline") {
  comm::Mpi c;
  if (c.size() % 2 != 0) return;
  using P = ChainOf<2>;
  paratrain::DataParallel<P, comm::Mpi, torch::optim::SGD> s(seeded(static_cast<P*>(nullptr)), c, sgd_options());
  const auto dir = paratrain_test::shared_dir(c, "pipeline_trace");
  torch::manual_seed(5);
  const std::int64_t n = 24L * s.replicas();  // 2 steps of 4 micro-batches of 3 per replica
  const paratrain::data::TensorDataset train(
      {torch::randn({n, features}, torch::kDouble), torch::randn({n, width}, torch::kDouble)},
      torch::randint(classes, {n}, torch::kLong));
  paratrain::fit(s, train, {.epochs = 1, .batch_size = 3, .accumulation = 4, .shuffle = false, .progress = false,
                            .observe = {.trace_file = (dir / "trace.json").string()}});
  if (c.rank() == 0) {
    std::ifstream in(dir / "trace.json");
    const auto trace = nlohmann::json::parse(in);
    std::map<int, std::map<std::string, int>> count;  // per rank: spans by name
    for (const auto& e : trace["traceEvents"])
      if (e["ph"] == "X") ++count[e["pid"].get<int>()][e["name"].get<std::string>()];
    for (int r = 0; r < c.size(); ++r) {
      CAPTURE(r);
      CHECK(count[r]["forward"] == 2 * 4);
      CHECK(count[r]["backward"] == 2 * 4);
      CHECK(count[r]["optimizer"] == 2);
    }
  }
  c.barrier();
  if (c.rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("fit trains a pipeline (2-D where the world allows) as one device trains on the same sample order") {
  comm::Mpi c;
  if (c.size() % 2 != 0) return;
  using P = ChainOf<2>;
  paratrain::DataParallel<P, comm::Mpi, torch::optim::SGD> s(seeded(static_cast<P*>(nullptr)), c, sgd_options(),
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
  double last_epoch_loss = 0;  // sample-weighted mean over the last epoch's steps
  for (int epoch = 0; epoch < 2; ++epoch) {
    double loss_sum = 0, samples = 0;
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
      const auto l = torch::nn::functional::cross_entropy(forward(torch::tensor(idx)), y.index_select(0, torch::tensor(idx)));
      loss_sum += l.item<double>() * static_cast<double>(idx.size());
      samples += static_cast<double>(idx.size());
      l.backward();
      sgd.step();
    }
    last_epoch_loss = loss_sum / samples;
  }
  const std::vector<Tensor> expected = s.owns(0) ? entry->parameters() : head->parameters();
  CHECK(max_relative_difference(s.full_parameters(), expected) <= 1e-5);
  torch::NoGradGuard no_grad;
  const auto test_idx = torch::arange(17);
  const double eval_loss = torch::nn::functional::cross_entropy(forward(test_idx), y.narrow(0, 0, 17)).item<double>();
  CHECK(result.epochs.back().eval_samples == 17);
  CHECK(result.epochs.back().eval_loss == doctest::Approx(eval_loss).epsilon(1e-9));
  // Only the last stage's ranks log a loss; the mean is over samples, none counted as 0.
  CHECK(result.epochs.back().train_loss == doctest::Approx(last_epoch_loss).epsilon(1e-9));
}

namespace {
// A forward with a defaulted trailing tensor, as LibTorch's Transformer layers have.
struct MaskedImpl : torch::nn::Module {
  MaskedImpl() { fc = register_module("fc", torch::nn::Linear(features, classes)); }
  Tensor forward(Tensor x, Tensor mask = {}) { return mask.defined() ? fc(x * mask) : fc(x); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Masked);
}  // namespace

TEST_CASE("a model whose forward has defaulted tensors takes batches of fewer inputs") {
  paratrain::DataParallel<Masked, comm::SingleDevice, torch::optim::SGD> s(Masked(), torch::optim::SGDOptions(0.1));
  const auto x = torch::randn({5, features}), mask = torch::rand({5, features});
  CHECK(torch::equal(s.predict(paratrain::Batch{x, torch::zeros({5}, torch::kLong)}), s.model()->forward(x)));
  CHECK(torch::equal(s.predict(paratrain::Batch{{x, mask}, torch::zeros({5}, torch::kLong)}),
                     s.model()->forward(x, mask)));
  CHECK_THROWS_WITH_AS(s.predict(paratrain::Batch{{x, mask, mask}, torch::zeros({5}, torch::kLong)}),
                       doctest::Contains("cannot be called with the batch's 3 input(s)"), paratrain::error);
}

namespace {
// `count` micro-batches of `size` samples of the pipeline's inputs (x, z) and targets.
std::vector<paratrain::Batch> micro_batches(int count, std::int64_t size) {
  std::vector<paratrain::Batch> out;
  for (int i = 0; i < count; ++i)
    out.push_back({{torch::randn({size, features}, torch::kDouble), torch::randn({size, width}, torch::kDouble)},
                   torch::randint(classes, {size}, torch::kLong)});
  return out;
}

using paratrain_test::error_of;
}  // namespace

// Note [Same micro-batches]: the ranks of one replica must run the same micro-batches.
TEST_CASE("a pipeline's ranks given different or unusable micro-batches fail alike on every rank") {
  comm::Mpi c;
  if (c.size() % 2 != 0) return;
  using P = ChainOf<2>;
  paratrain::DataParallel<P, comm::Mpi, torch::optim::SGD> s(seeded(static_cast<P*>(nullptr)), c, sgd_options());
  torch::manual_seed(11);
  // The rank given other micro-batches: replica 0's last stage.
  const bool bad = s.replica() == 0 && s.pipeline_rank() == s.pipeline_size() - 1;
  SUBCASE("3 micro-batches on replica 0's last stage, 4 elsewhere") {
    const auto micro = micro_batches(bad ? 3 : 4, 2);
    const auto what = error_of([&] { s.step(std::span<const paratrain::Batch>(micro), paratrain::CrossEntropy{}); });
    CAPTURE(what);
    CHECK(what.find("the ranks of pipeline replica 0 were given different micro-batches (from 3 to 4 of them)") !=
          std::string::npos);
  }
  SUBCASE("a scalar input on replica 0's last stage") {
    auto micro = micro_batches(4, 3);
    if (bad) micro[0].inputs[0] = torch::zeros({});
    const auto what = error_of([&] { s.step(std::span<const paratrain::Batch>(micro), paratrain::CrossEntropy{}); });
    CAPTURE(what);
    CHECK(what.find(bad ? "micro-batch 0: the batch's input 0 is a scalar"
                        : "a rank of pipeline replica 0 was given a micro-batch it cannot use") !=
          std::string::npos);
  }
  SUBCASE("targets for fewer samples than the inputs on replica 0's last stage") {
    auto micro = micro_batches(4, 3);
    if (bad) micro[2].target = micro[2].target.narrow(0, 0, 2);
    const auto what = error_of([&] { s.step(std::span<const paratrain::Batch>(micro), paratrain::CrossEntropy{}); });
    CAPTURE(what);
    CHECK(what.find(bad ? "micro-batch 2: the batch's inputs hold 3 samples and its targets 2 samples"
                        : "a rank of pipeline replica 0 was given a micro-batch it cannot use") !=
          std::string::npos);
  }
  // Still in step: every rank's next step, alike, trains.
  const auto micro = micro_batches(4, 2);
  CHECK_NOTHROW(s.step(std::span<const paratrain::Batch>(micro), paratrain::CrossEntropy{}));
}

// Only the last stage's rank of replica 0 sees the NaN: the other stages and replicas learn
// of it from the ranks' agreement alone.
TEST_CASE("NaN in one stage's gradients skips the step on every stage and replica") {
  comm::Mpi c;
  if (c.size() % 2 != 0) return;
  using P = ChainOf<2>;
  paratrain::DataParallel<P, comm::Mpi, torch::optim::SGD> s(seeded(static_cast<P*>(nullptr)), c, sgd_options(),
                                          {.data_parallel = {.nonfinite_gradients = paratrain::NonFinite::skip}});
  torch::manual_seed(12 + c.rank());
  for (int k = 0; k < 3; ++k) {
    CAPTURE(k);
    const auto micro = micro_batches(2, 3);
    const auto before = s.full_parameters();
    auto poisoned = s.stages()->parameters().front();
    const bool poison = k == 1 && c.rank() == 1;  // world rank 1: stage 1 of replica 0
    const auto hook = poison ? poisoned.register_hook([](const Tensor& g) { return torch::full_like(g, std::nan("")); })
                             : 0;
    const auto r = s.step(std::span<const paratrain::Batch>(micro), paratrain::CrossEntropy{});
    if (poison) poisoned.remove_hook(hook);
    const auto after = s.full_parameters();
    CHECK(r.skipped == (k == 1));
    if (k == 1) CHECK(paratrain_test::max_relative_difference(after, before) == 0);
    else CHECK(paratrain_test::max_relative_difference(after, before) > 0);
    for (const auto& p : after) CHECK(torch::isfinite(p).all().item<bool>());
  }
}
