// The promise, for DataParallel: N ranks with per-rank batch b give, step by step, the
// parameters of single-device training with batch N*b over the same samples.
//
// The reference below is plain LibTorch (model, optimizer, loss.backward(), step) on
// the concatenated batch: independent of paratrain. Each rank's replica starts from a
// different initialisation (seed + rank), so the tests also check that rank 0's is
// broadcast; the reference starts from rank 0's.
#include <torch/torch.h>

#include <functional>
#include <string>
#include <vector>

#include "paratrain/comm/mpi.hpp"
#include "paratrain/comm/single_device.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/strategy/local_data_parallel.hpp"
#include "support/doctest.hpp"

namespace {

namespace comm = paratrain::comm;
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

Mlp make_model(Features f, int rank) {
  torch::manual_seed(1234 + rank);
  return Mlp(f, rank);
}

torch::Tensor loss_fn(const torch::Tensor& out, const torch::Tensor& target) { return F::cross_entropy(out, target); }

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

int batches_of(const Scenario& s, int rank) { return s.uneven ? s.steps - rank : s.steps; }

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

double max_relative_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    worst = std::max(worst, ((a[i] - b[i]).abs().max() / b[i].abs().max().clamp_min(1e-12)).item<double>());
  return worst;
}

template <class Comm>
void check_equivalence(const Scenario& s) {
  Comm c;
  const int world = c.size();
  CAPTURE(world);
  {
    const auto opts = torch::optim::SGDOptions(0.1).momentum(0.9);
    const auto want = reference<torch::optim::SGD>(s, world, opts);
    const auto got = distributed<Comm, torch::optim::SGD>(s, Comm(), opts);
    CHECK(max_relative_difference(got, want) <= 1e-5);
  }
  {
    const auto opts = torch::optim::AdamOptions(1e-2);
    const auto want = reference<torch::optim::Adam>(s, world, opts);
    const auto got = distributed<Comm, torch::optim::Adam>(s, Comm(), opts);
    CHECK(max_relative_difference(got, want) <= 1e-5);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("DataParallel equals single-device training on the union of the ranks' batches", C,
                   comm::SingleDevice, comm::Mpi) {
  SUBCASE("plain") { check_equivalence<C>({}); }
  SUBCASE("gradient accumulation over 2 and 4 micro-batches") {
    check_equivalence<C>({.batch = 4, .micro_batches = 2});
    check_equivalence<C>({.batch = 8, .micro_batches = 4});
  }
  SUBCASE("an unused parameter, with find_unused_parameters") {
    check_equivalence<C>({.features = {.unused_parameter = true}, .options = {.find_unused_parameters = true}});
  }
  SUBCASE("uneven inputs: rank r has r fewer batches, joined") { check_equivalence<C>({.uneven = true}); }
  SUBCASE("a buffer, broadcast from rank 0") { check_equivalence<C>({.features = {.buffer = true}}); }
  SUBCASE("small buckets: one parameter per bucket") {
    check_equivalence<C>({.options = {.bucket_cap_bytes = 1, .first_bucket_cap_bytes = 1}});
  }
}

TEST_CASE_TEMPLATE("DataParallel names an unused parameter on every rank instead of hanging", C, comm::SingleDevice,
                   comm::Mpi) {
  const Data data;
  C c;
  const int world = c.size(), rank = c.rank();
  paratrain::DataParallel<Mlp, C, torch::optim::SGD> dp(make_model({.unused_parameter = true}, rank), std::move(c),
                                                        torch::optim::SGDOptions(0.1));
  CHECK_THROWS_WITH_AS(dp.step(data.of(world, rank, 0, 4), loss_fn), doctest::Contains("find_unused_parameters"),
                       paratrain::error);
  // The ranks are still in step afterwards: a normal step on the used parameters works... after
  // enabling nothing, the same step throws again, on every rank, rather than deadlocking.
  CHECK_THROWS_WITH_AS(dp.step(data.of(world, rank, 1, 4), loss_fn), doctest::Contains("head"), paratrain::error);
}

TEST_CASE("DataParallel without join: different batch counts are an error on every rank") {
  const Data data;
  comm::Mpi c;
  const int world = c.size(), rank = c.rank();
  if (world == 1) return;
  paratrain::DataParallel<Mlp, comm::Mpi, torch::optim::SGD> dp(make_model({}, rank), std::move(c),
                                                                torch::optim::SGDOptions(0.1), {.join = false});
  // Rank 0 says it has no next batch, the others say they have.
  CHECK_THROWS_WITH_AS(dp.step(data.of(world, rank, 0, 4), loss_fn, rank != 0),
                       doctest::Contains("ranks have another batch"), paratrain::error);
}

TEST_CASE("DataParallel buckets follow the caps, in reverse parameter order") {
  comm::SingleDevice c;
  paratrain::DataParallel<Mlp, comm::SingleDevice, torch::optim::SGD> one(make_model({}, 0), c,
                                                                           torch::optim::SGDOptions(0.1));
  CHECK(one.bucket_count() == 1);  // 8*16+16+16*4+4 floats: well under 1 MiB
  paratrain::DataParallel<Mlp, comm::SingleDevice, torch::optim::SGD> each(
      make_model({}, 0), c, torch::optim::SGDOptions(0.1), {.bucket_cap_bytes = 1, .first_bucket_cap_bytes = 1});
  CHECK(each.bucket_count() == 4);
}

namespace {

// LocalDataParallel clones its model: the same network, as a Cloneable.
struct CloneableMlpImpl : torch::nn::Cloneable<CloneableMlpImpl> {
  CloneableMlpImpl() { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(CloneableMlp);

template <class Optim, class Opts>
void check_local(int replicas, std::int64_t batch, int micro_batches, Opts opts) {
  CAPTURE(replicas);
  CAPTURE(batch);
  CAPTURE(micro_batches);
  const Data data;
  torch::manual_seed(5);
  CloneableMlp reference_model;
  torch::manual_seed(5);
  paratrain::LocalDataParallel<CloneableMlp, Optim> dp(CloneableMlp(), opts, {.replicas = replicas});
  REQUIRE(dp.replicas() == replicas);
  Optim reference_optim(reference_model->parameters(), opts);
  for (int k = 0; k < 20; ++k) {
    const auto b = data.of(1, 0, k, batch);
    const auto micro = batch / micro_batches;
    for (int m = 0; m + 1 < micro_batches; ++m)
      dp.accumulate({b.input.narrow(0, m * micro, micro), b.target.narrow(0, m * micro, micro)}, loss_fn);
    const auto last = (micro_batches - 1) * micro;
    dp.step({b.input.narrow(0, last, batch - last), b.target.narrow(0, last, batch - last)}, loss_fn);
    reference_optim.zero_grad();
    loss_fn(reference_model->forward(b.input), b.target).backward();
    reference_optim.step();
  }
  CHECK(max_relative_difference(dp.model()->parameters(), reference_model->parameters()) <= 1e-5);
}

}  // namespace

TEST_CASE("LocalDataParallel (DP) equals single-device training on the whole batch") {
  for (int replicas : {1, 2, 3}) {
    check_local<torch::optim::SGD>(replicas, 8, 1, torch::optim::SGDOptions(0.1).momentum(0.9));  // 3: split 3/3/2
    check_local<torch::optim::Adam>(replicas, 8, 1, torch::optim::AdamOptions(1e-2));
    check_local<torch::optim::Adam>(replicas, 8, 2, torch::optim::AdamOptions(1e-2));
  }
  check_local<torch::optim::SGD>(4, 2, 1, torch::optim::SGDOptions(0.1));  // fewer samples than replicas
}
