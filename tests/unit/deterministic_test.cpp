// Deterministic mode (Note [Deterministic training]): after 30 steps the parameters hold the
// same bytes at 1, 2, 3 and 4 ranks, under DDP, ZeRO 1-3 and hybrid sharding, with SGD with
// momentum and with Adam, on a model with dropout, with per-rank batches of different sizes
// (a global batch of 31 in 12 shards), run twice, and across a save at 4 ranks resumed at 1
// and 3 under another strategy.
//
// The reference is plain LibTorch in one process, written from the definition: each step's
// global batch (the epoch's randperm order, padded from its start) cut into 12 shards by
// numpy's array_split; each shard's gradient of n_k x its mean loss computed on its own, its
// dropout drawn from paratrain::shard_seed; the gradients added in shard order in fp32,
// divided by the batch, then the LibTorch optimizer's step. Every world size and strategy is
// compared with it byte for byte, so that equal bytes at 1-4 ranks follow.
#include <torch/torch.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "paratrain/checkpoint/checkpoint.hpp"
#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/comm/single_device.hpp"
#include "paratrain/data/deterministic_sampler.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "support/doctest.hpp"
#include "support/equivalence.hpp"
#include "support/shared_dir.hpp"

namespace deterministic_test {

namespace comm = paratrain::comm;
namespace zero = paratrain::zero;
namespace ckpt = paratrain::checkpoint;
using paratrain::Sharded;
using namespace paratrain_test;

constexpr std::int64_t kDataset = 200, kGlobal = 31, kShards = 12, kSteps = 30;
constexpr std::uint64_t kOrderSeed = 3, kDropoutSeed = 11;
const std::int64_t kStepsPerEpoch = (kDataset + kGlobal - 1) / kGlobal;  // the last one padded

// Mlp's layers (ZeRO-3 units) with dropout between them: random draws inside each shard.
struct DropoutMlpImpl : torch::nn::Module {
  DropoutMlpImpl() {
    fc1 = register_module("fc1", paratrain::Unit<torch::nn::Linear>(8, 16));
    fc2 = register_module("fc2", paratrain::Unit<torch::nn::Linear>(16, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::dropout(torch::tanh(fc1(x)), 0.25, is_training())); }
  paratrain::Unit<torch::nn::Linear> fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(DropoutMlp);

DropoutMlp make_dropout_mlp(int seed = 1234) {
  torch::manual_seed(seed);
  return DropoutMlp();
}

struct Dataset {
  torch::Tensor x, y;
  Dataset() {
    torch::manual_seed(99);
    x = torch::randn({kDataset, 8});
    y = torch::randint(0, 4, {kDataset});
  }
};

// Step t's global batch, from the definition: positions [p B, (p + 1) B) of epoch e's order
// (torch.randperm seeded with seed + e), modulo the dataset's size where it is padded.
torch::Tensor global_indices(std::int64_t t) {
  const auto e = t / kStepsPerEpoch, p = t % kStepsPerEpoch;
  const auto order = torch::randperm(kDataset, at::make_generator<at::CPUGeneratorImpl>(kOrderSeed + e), at::kLong);
  return order.index({torch::remainder(torch::arange(p * kGlobal, (p + 1) * kGlobal), kDataset)});
}

torch::Tensor shard_loss(const torch::Tensor& out, const torch::Tensor& target) {
  return torch::nn::functional::cross_entropy(out, target);
}

// Plain LibTorch, one process: steps [0, steps) as the definition says (file comment).
template <class Optim, class Opts>
std::vector<torch::Tensor> reference(const Opts& opts, std::int64_t steps, double max_norm = 0) {
  const Dataset d;
  auto model = make_dropout_mlp();
  Optim optimizer(model->parameters(), opts);
  const auto params = model->parameters();
  for (std::int64_t t = 0; t < steps; ++t) {
    const auto idx = global_indices(t);
    std::vector<torch::Tensor> sum;
    for (std::int64_t k = 0, begin = 0; k < kShards; ++k) {
      const auto n = kGlobal / kShards + (k < kGlobal % kShards ? 1 : 0);
      for (auto& p : params) p.mutable_grad() = torch::zeros_like(p);
      torch::manual_seed(paratrain::shard_seed(kDropoutSeed, t, k));
      const auto rows = idx.narrow(0, begin, n);
      (shard_loss(model->forward(d.x.index({rows})), d.y.index({rows})) * static_cast<double>(n)).backward();
      begin += n;
      for (std::size_t i = 0; i < params.size(); ++i) {
        if (k == 0) sum.push_back(params[i].grad().clone());
        else sum[i].add_(params[i].grad());
      }
    }
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> squares;
    for (std::size_t i = 0; i < params.size(); ++i) {
      params[i].mutable_grad() = sum[i].div_(static_cast<double>(kGlobal));
      squares.push_back(sum[i].to(torch::kDouble).square().sum());
    }
    if (max_norm > 0) {  // per parameter in the model's order, in double
      const double norm = std::sqrt(torch::stack(squares).sum().item<double>());
      const double coef = std::min(max_norm / (norm + 1e-6), 1.0);
      for (auto& p : params) p.mutable_grad().mul_(coef);
    }
    optimizer.step();
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone());
  return out;
}

// Steps [from, to) of strategy `s`, this rank's samples from DeterministicSampler.
template <class S>
void train(S& s, const Dataset& d, std::int64_t from, std::int64_t to) {
  paratrain::data::DeterministicSampler sampler(
      kDataset, {.global_batch = kGlobal, .shards = kShards, .num_replicas = s.world_size(), .rank = s.rank(),
                 .seed = kOrderSeed});
  for (auto t = from; t < to; ++t) {
    sampler.set_epoch(t / kStepsPerEpoch, (t % kStepsPerEpoch) * kGlobal);
    const auto all = sampler.indices();
    const auto idx = torch::tensor(std::vector<std::int64_t>(all.begin(), all.begin() + sampler.batch_size()));
    s.step(paratrain::Batch{d.x.index({idx}), d.y.index({idx})}, shard_loss);
  }
}

paratrain::DataParallelOptions deterministic(int shard_group = 0, double max_norm = 0) {
  return {.max_grad_norm = max_norm, .shard_group = shard_group,
          .deterministic = {.shards = kShards, .seed = kDropoutSeed}};
}

template <class Update, class Opts>
std::vector<torch::Tensor> distributed(const Opts& opts, paratrain::DataParallelOptions options) {
  comm::Mpi world;
  const Dataset d;
  paratrain::DataParallel<DropoutMlp, comm::Mpi, Update> s(make_dropout_mlp(), world, opts, options);
  train(s, d, 0, kSteps);
  return s.full_parameters();
}

// Byte for byte; on a difference, the largest one, for the message.
bool same_bytes(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want) {
  REQUIRE(got.size() == want.size());
  bool same = true;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const auto a = got[i].contiguous(), b = want[i].contiguous();
    REQUIRE(a.nbytes() == b.nbytes());
    if (std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) != 0) {
      MESSAGE("parameter " << i << " differs, by at most " << (a - b).abs().max().item<double>());
      same = false;
    }
  }
  return same;
}

// One restores what it changed: the suite's other cases run on with the caller's threads.
struct OneThread {
  int before = at::get_num_threads();
  OneThread() { at::set_num_threads(1); }
  ~OneThread() { at::set_num_threads(before); }
};

template <class Optim, class Opts>
void check_every_strategy(const Opts& opts) {
  const int world = comm::Mpi().size();
  CAPTURE(world);
  const auto want = reference<Optim>(opts, kSteps);
  CHECK(same_bytes(distributed<Optim>(opts, deterministic()), want));
  CHECK(same_bytes(distributed<Sharded<Optim, zero::stage1>>(opts, deterministic()), want));
  CHECK(same_bytes(distributed<Sharded<Optim, zero::stage2>>(opts, deterministic()), want));
  CHECK(same_bytes(distributed<Sharded<Optim, zero::stage3>>(opts, deterministic()), want));
  if (world == 4) CHECK(same_bytes(distributed<Sharded<Optim, zero::stage3>>(opts, deterministic(2)), want));
}

// shard_seed's answers, computed from its definition (splitmix64 over seed, step, shard) by
// an independent port in Python: the reference above draws from shard_seed too, so only
// these pin it. Two shards (and two steps) must draw different dropout masks.
TEST_CASE("shard_seed: known answers, and two shards' or steps' dropout masks differ") {
  using paratrain::shard_seed;
  CHECK(shard_seed(0, 0, 0) == 0x238275bc38fcbe91ULL);
  CHECK(shard_seed(11, 3, 5) == 0x4fb7cd81421af33dULL);
  CHECK(shard_seed(~std::uint64_t{0}, 1000000, 11) == 0xd37ec0c1d6ebb56cULL);
  const auto mask = [](std::uint64_t seed) {
    torch::manual_seed(seed);
    return torch::dropout(torch::ones({256}), 0.5, /*train=*/true);
  };
  CHECK_FALSE(torch::equal(mask(shard_seed(kDropoutSeed, 0, 0)), mask(shard_seed(kDropoutSeed, 0, 1))));
  CHECK_FALSE(torch::equal(mask(shard_seed(kDropoutSeed, 0, 0)), mask(shard_seed(kDropoutSeed, 1, 0))));
  CHECK(torch::equal(mask(shard_seed(kDropoutSeed, 2, 3)), mask(shard_seed(kDropoutSeed, 2, 3))));
}

TEST_CASE("deterministic mode: the same bytes at every world size and stage, with SGD with momentum") {
  const OneThread one;
  check_every_strategy<torch::optim::SGD>(torch::optim::SGDOptions(0.1).momentum(0.9));
}

TEST_CASE("deterministic mode: the same bytes at every world size and stage, with Adam") {
  const OneThread one;
  check_every_strategy<torch::optim::Adam>(torch::optim::AdamOptions(1e-2));
}

TEST_CASE("deterministic mode: clipping's norm, and a second run, give the same bytes") {
  const OneThread one;
  const auto opts = torch::optim::SGDOptions(0.1).momentum(0.9);
  const auto want = reference<torch::optim::SGD>(opts, kSteps, /*max_norm=*/0.05);
  CHECK(same_bytes(distributed<torch::optim::SGD>(opts, deterministic(0, 0.05)), want));
  CHECK(same_bytes(distributed<Sharded<torch::optim::SGD, zero::stage2>>(opts, deterministic(0, 0.05)), want));
  // Run twice, the same bytes: no state of one run (sums kept between steps, generators)
  // leaks into the next.
  const auto first = distributed<Sharded<torch::optim::Adam, zero::stage3>>(torch::optim::AdamOptions(1e-2), deterministic());
  const auto second = distributed<Sharded<torch::optim::Adam, zero::stage3>>(torch::optim::AdamOptions(1e-2), deterministic());
  CHECK(same_bytes(first, second));
}

// Saved at 4 ranks under ZeRO-3 after 15 steps; resumed under DDP at 1 rank and, at the same
// time, at 3 ranks (the world split in two); each ends where the uninterrupted run ends.
TEST_CASE("deterministic mode: saved at 4 ranks under ZeRO-3, resumed at 1 and at 3 under DDP") {
  comm::Mpi world;
  if (world.size() != 4) return;
  const OneThread one;
  const int rank = world.rank();
  const auto opts = torch::optim::AdamOptions(1e-2);
  const auto dir = shared_dir(world, "deterministic");
  const Dataset d;
  {
    paratrain::DataParallel<DropoutMlp, comm::Mpi, Sharded<torch::optim::Adam, zero::stage3>> s(
        make_dropout_mlp(), world, opts, deterministic());
    train(s, d, 0, kSteps / 2);
    ckpt::save(s, dir, kSteps / 2);
  }
  world.barrier();
  auto part = world.split(rank == 0 ? 0 : 1, rank);  // {0}, {1, 2, 3}
  {
    paratrain::DataParallel<DropoutMlp, comm::Mpi, torch::optim::Adam> s(make_dropout_mlp(7), part, opts,
                                                                          deterministic());
    CHECK(ckpt::load(s, ckpt::path_of(dir, kSteps / 2)).world_size == 4);
    train(s, d, kSteps / 2, kSteps);
    CAPTURE(part.size());
    CHECK(same_bytes(s.full_parameters(), reference<torch::optim::Adam>(opts, kSteps)));
  }
  remove_shared_dir(world, dir);
}

TEST_CASE("deterministic mode: what it cannot hold is an error on every rank") {
  comm::Mpi world;
  const int w = world.size(), rank = world.rank();
  const OneThread one;
  const auto opts = torch::optim::SGDOptions(0.1);
  using DDP = paratrain::DataParallel<DropoutMlp, comm::Mpi, torch::optim::SGD>;
  // Shards that are not a multiple of the world size (or not a count at all on one rank).
  const std::string not_a_multiple = w == 1 ? "at least 1" : "not a multiple of the " + std::to_string(w) + " ranks";
  CHECK_THROWS_WITH(DDP(make_dropout_mlp(), world, opts, {.deterministic = {.shards = w == 1 ? -1 : w + 1}}),
                    doctest::Contains(not_a_multiple.c_str()));
  {  // Two intra-op threads on one rank: every rank refuses.
    if (rank == 0) at::set_num_threads(2);
    CHECK_THROWS_WITH(DDP(make_dropout_mlp(), world, opts, deterministic()), doctest::Contains("one intra-op thread"));
    at::set_num_threads(1);
  }
  // A buffer, which each rank would update from its own shards.
  CHECK_THROWS_WITH((paratrain::DataParallel<Mlp, comm::Mpi, torch::optim::SGD>(make_model({.buffer = true}, rank),
                                                                               world, opts, deterministic())),
                    doctest::Contains("buffer 'scale'"));
  DDP s(make_dropout_mlp(), world, opts, deterministic());
  const Dataset d;
  paratrain::data::DeterministicSampler sampler(
      kDataset, {.global_batch = kGlobal, .shards = kShards, .num_replicas = w, .rank = rank, .seed = kOrderSeed});
  // Rank 0 given no samples, whose shards hold some at any world size: every rank names it.
  // (Fewer or more samples on some rank may make another global batch that fits the plan.)
  // On one rank, whatever it is given is the global batch: five cannot fill twelve shards.
  const auto n = w == 1 ? 5 : rank == 0 ? 0 : sampler.batch_size();
  const std::string named = w == 1 ? "5 samples cannot fill 12 virtual shards" : "rank 0 was given 0 samples";
  CHECK_THROWS_WITH(s.step(paratrain::Batch{d.x.narrow(0, 0, n), d.y.narrow(0, 0, n)}, shard_loss),
                    doctest::Contains(named.c_str()));
  // Accumulating would cut the batch another way than the shards.
  CHECK_THROWS_WITH(s.accumulate(paratrain::Batch{d.x.narrow(0, 0, 4), d.y.narrow(0, 0, 4)}, shard_loss),
                    doctest::Contains("one batch per step"));
  // After the errors, the strategy still trains (nothing was half done), and in each step each
  // of its K/W rounds hands the model's 8 x 16 + 16 + 16 x 4 + 4 = 212 fp32 gradients to the
  // all-gather (one rank gathers nothing).
  const auto m = sampler.batch_size();
  for (int step = 0; step < 2; ++step) {
    CHECK(s.step(paratrain::Batch{d.x.narrow(0, 0, m), d.y.narrow(0, 0, m)}, shard_loss).global_samples == kGlobal);
    CHECK(s.gradient_bytes_sent() == (w == 1 ? 0 : kShards / w * 212 * 4));
  }
}

TEST_CASE("DeterministicSampler: the ranks' shards make up each global batch, at any world size") {
  for (const std::int64_t w : {1, 2, 3, 4}) {
    CAPTURE(w);
    const paratrain::ShardPlan plan(kGlobal, kShards);
    std::vector<std::vector<std::int64_t>> mine;
    std::vector<std::int64_t> sizes;
    for (std::int64_t r = 0; r < w; ++r) {
      const paratrain::data::DeterministicSampler s(
          kDataset, {.global_batch = kGlobal, .shards = kShards, .num_replicas = w, .rank = r, .seed = kOrderSeed});
      CHECK(s.steps() == kStepsPerEpoch);
      mine.push_back(s.indices());
      sizes.push_back(s.batch_size());
    }
    // Step t's global batch, shard by shard, from the ranks that hold the shards.
    for (std::int64_t t = 0; t < kStepsPerEpoch; ++t) {
      const auto want = global_indices(t);
      std::vector<std::int64_t> taken(static_cast<std::size_t>(w), 0);
      for (std::int64_t k = 0; k < kShards; ++k) {
        const auto r = k % w;
        for (std::int64_t i = 0; i < plan.size(k); ++i) {
          const auto at = t * sizes[static_cast<std::size_t>(r)] + taken[static_cast<std::size_t>(r)]++;
          REQUIRE(mine[static_cast<std::size_t>(r)][static_cast<std::size_t>(at)] ==
                  want[plan.offset(k) + i].item<std::int64_t>());
        }
      }
    }
  }
  CHECK_THROWS_WITH(paratrain::data::DeterministicSampler(
                        kDataset, {.global_batch = 8, .shards = 12, .num_replicas = 2, .rank = 0}),
                    doctest::Contains("at least shards"));
  CHECK_THROWS_WITH(paratrain::data::DeterministicSampler(
                        kDataset, {.global_batch = 31, .shards = 12, .num_replicas = 5, .rank = 0}),
                    doctest::Contains("multiple of num_replicas"));
}

}  // namespace deterministic_test
