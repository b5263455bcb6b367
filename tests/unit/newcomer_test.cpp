// What a newcomer meets first (issue #37): the defaults fit and the strategies choose when
// told nothing, what they refuse, the set-up call, the model written as stages, and
// LibTorch's own datasets under fit.
#include <torch/torch.h>

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>

#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/comm/single_device.hpp"
#include "paratrain/data/sequential_sampler.hpp"
#include "paratrain/data/torch_dataset.hpp"
#include "paratrain/fit/fit.hpp"
#include "paratrain/pipeline/chain.hpp"
#include "paratrain/pipeline/pipeline.hpp"
#include "paratrain/program/main.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/strategy/local_data_parallel.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "support/doctest.hpp"
#include "support/fit_reference.hpp"

// A namespace of its own: this file shares a translation unit with others (Note [Unity groups]).
namespace newcomer_test {

namespace {

namespace comm = paratrain::comm;
using paratrain_test::fit_reference::make_data;
using paratrain_test::fit_reference::make_net;
using paratrain_test::fit_reference::Net;

// fit_reference's Net as two stages: the same layers, the same names under a Chain or a
// Pipeline ("0.fc", "1.fc").
struct FirstImpl : torch::nn::Cloneable<FirstImpl> {
  torch::nn::Linear fc{nullptr};
  FirstImpl() { reset(); }
  void reset() override { fc = register_module("fc", torch::nn::Linear(6, 12)); }
  torch::Tensor forward(torch::Tensor x) { return torch::relu(fc(x)); }
};
TORCH_MODULE(First);
struct SecondImpl : torch::nn::Cloneable<SecondImpl> {
  torch::nn::Linear fc{nullptr};
  SecondImpl() { reset(); }
  void reset() override { fc = register_module("fc", torch::nn::Linear(12, 3)); }
  torch::Tensor forward(torch::Tensor x) { return fc(x); }
};
TORCH_MODULE(Second);

/// A LibTorch dataset of the rows of `data`, read one example at a time.
class Rows : public torch::data::datasets::Dataset<Rows> {
 public:
  explicit Rows(paratrain::data::TensorDataset data) : data_(std::move(data)) {}
  torch::data::Example<> get(std::size_t i) override {
    return {data_.inputs()[static_cast<std::int64_t>(i)], data_.targets()[static_cast<std::int64_t>(i)]};
  }
  torch::optional<std::size_t> size() const override { return static_cast<std::size_t>(data_.size()); }

 private:
  paratrain::data::TensorDataset data_;
};

/// What `f` writes to the standard error stream.
template <class F>
std::string stderr_of(F&& f) {
  std::fflush(stderr);
  char path[] = "/tmp/paratrain_newcomer_XXXXXX";
  const int file = mkstemp(path);
  REQUIRE(file >= 0);
  const int saved = dup(2);
  dup2(file, 2);
  f();
  std::fflush(stderr);
  dup2(saved, 2);
  close(saved);
  close(file);
  std::ifstream in(path);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::remove(path);
  return text;
}

}  // namespace

TEST_CASE("paratrain::main seeds every rank alike, sets one intra-op thread, and returns the body's status") {
  const int threads = torch::get_num_threads();
  const int status = paratrain::main(0, nullptr, [] {
    CHECK(paratrain::seed() == 11);
    CHECK(torch::get_num_threads() == 1);
    const auto drawn = torch::rand({4});
    torch::manual_seed(11);  // LibTorch's own generator, seeded as a program would by hand
    CHECK(torch::equal(drawn, torch::rand({4})));
    return 7;
  }, {.seed = 11});
  CHECK(status == 7);
  CHECK(paratrain::main(0, nullptr, [] {}, {.seed = 0, .threads = 0}) == 0);
  CHECK(paratrain::seed() == 0);
  torch::set_num_threads(threads);
}

TEST_CASE("fit's sample order defaults to paratrain::main's seed") {
  comm::Mpi c;
  const int world = c.size();
  const auto train = make_data(61, 1);
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  paratrain::detail::set_seed(5);  // as paratrain::main({.seed = 5}) sets it
  paratrain::DataParallel<Net, comm::Mpi, torch::optim::SGD> s(make_net(), std::move(c), sgd);
  paratrain::fit(s, train, {.epochs = 2, .batch_size = 4, .progress = false});
  paratrain::detail::set_seed(0);
  auto net = make_net();  // the reference's order: DistributedSampler with seed 5
  paratrain_test::fit_reference::train(net, train, world, 2, 4, 5, sgd, torch::kCPU);
  const auto got = s.model()->parameters(), want = net->parameters();
  for (std::size_t i = 0; i < got.size(); ++i)
    CHECK(((got[i] - want[i]).abs().max() / want[i].abs().max()).item<double>() <= 1e-5);
}

TEST_CASE("fit refuses a global batch it cannot deal, and deterministic mode's misuses, on every rank") {
  comm::Mpi c;
  const int world = c.size();
  const auto train = make_data(48, 1);
  paratrain::DataParallel<Net, comm::Mpi, torch::optim::SGD> plain(make_net(), c, torch::optim::SGDOptions(0.1));
  const auto undealt = "cannot be dealt over " + std::to_string(world) + " data-parallel replicas";
  if (world > 1)  // world + 1 samples a step: no world size above 1 divides it
    CHECK_THROWS_WITH_AS(paratrain::fit(plain, train, {.batch_size = 4, .global_batch_size = world + 1, .progress = false}),
                         doctest::Contains(undealt.c_str()), paratrain::error);
  // A negative accumulation is the options' one check's (0 is automatic).
  CHECK_THROWS_WITH_AS(paratrain::fit(plain, train, {.batch_size = 4, .accumulation = -1, .progress = false}),
                       doctest::Contains("accumulation >= 0 (0: automatic)"), paratrain::error);
  paratrain::DataParallel<Net, comm::Mpi, torch::optim::SGD> s(make_net(), c, torch::optim::SGDOptions(0.1),
                                                               {.deterministic = {.shards = 12}});
  CHECK_THROWS_WITH_AS(paratrain::fit(s, train, {.batch_size = 4, .accumulation = 2, .progress = false}),
                       doctest::Contains("one batch a step: set global_batch_size instead"), paratrain::error);
  CHECK_THROWS_WITH_AS(paratrain::fit<paratrain::data::SequentialSampler>(s, train, {.batch_size = 4, .progress = false}),
                       doctest::Contains("leave fit's Sampler at its default"), paratrain::error);
}

TEST_CASE("fit refuses training data that differs across ranks, on every rank") {
  comm::Mpi c;
  const int rank = c.rank(), world = c.size();
  paratrain::DataParallel<Net, comm::Mpi, torch::optim::SGD> s(make_net(), std::move(c), torch::optim::SGDOptions(0.1));
  // The same size, drawn from another seed on the last rank: what per-rank random "data" does.
  const auto train = make_data(40, rank == world - 1 && world > 1 ? 2 : 1);
  if (world == 1) {
    CHECK_NOTHROW(paratrain::fit(s, train, {.batch_size = 4, .progress = false}));
  } else {
    CHECK_THROWS_WITH_AS(paratrain::fit(s, train, {.batch_size = 4, .progress = false}),
                         doctest::Contains("training data"), paratrain::error);
  }
  // Another size on one rank: refused as well.
  const auto sized = make_data(rank == 0 && world > 1 ? 41 : 40, 1);
  if (world > 1)
    CHECK_THROWS_WITH_AS(paratrain::fit(s, sized, {.batch_size = 4, .progress = false}),
                         doctest::Contains("differs from another rank's"), paratrain::error);
}

TEST_CASE("fit on a pipeline runs 2K micro-batches per step by default; other strategies one") {
  comm::Mpi c;
  const int world = c.size();
  const auto train = make_data(64, 1);
  if (world % 2 == 0) {
    using P = paratrain::Pipeline<First, Second>;
    paratrain::DataParallel<P, comm::Mpi, torch::optim::SGD> s(P(), std::move(c), torch::optim::SGDOptions(0.1));
    const auto r = paratrain::fit(s, train, {.batch_size = 2, .max_steps = 1, .progress = false});
    CHECK(r.steps == 1);
    CHECK(s.last_step_stats().count[0] == 4);  // forwards on this rank's stage: 2K, K = 2
  } else {
    paratrain::DataParallel<Net, comm::Mpi, torch::optim::SGD> s(make_net(), std::move(c), torch::optim::SGDOptions(0.1));
    const auto r = paratrain::fit(s, train, {.epochs = 1, .batch_size = 4, .progress = false});
    CHECK(r.steps == (64 / world + 3) / 4 + ((64 % world) != 0 && (64 / world) % 4 == 0 ? 1 : 0));
  }
}

TEST_CASE("interleaved 1F1B on a step whose micro-batches are no multiple of K says so on rank 0") {
  comm::Mpi c;
  if (c.size() != 2) return;  // K = 2 pipeline ranks, two stages each
  using P = paratrain::Pipeline<First, Second, First, Second>;
  const int rank = c.rank();
  paratrain::DataParallel<P, comm::Mpi, torch::optim::SGD> s(
      P(), std::move(c), torch::optim::SGDOptions(0.1),
      {.schedule = paratrain::pipeline::Kind::interleaved_1f1b, .virtual_stages = 2});
  std::string name;
  const auto said = stderr_of([&] { name = s.schedule_for(3).name; });
  CHECK(name == "GPipe");
  CHECK((said.find("paratrain: note: Pipeline: interleaved 1F1B needs a multiple of 2 micro-batches; a step of 3") !=
         std::string::npos) == (rank == 0));
  CHECK(s.schedule_for(4).name == "interleaved 1F1B");
}

TEST_CASE("LocalDataParallel makes a few replicas on CPUs by default, not one per hardware thread") {
  paratrain::LocalDataParallel<paratrain::Chain<First, Second>, torch::optim::SGD> dp(torch::optim::SGDOptions(0.1),
                                                                                     {.cpu = true});
  const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  CHECK(dp.replica_count() == std::min(threads, 4));
  using DP = decltype(dp);
  CHECK(DP::replicas_for(0, 0, 128) == 4);  // a big node: 4 clones, not 128
  CHECK(DP::replicas_for(0, 0, 2) == 2);
  CHECK(DP::replicas_for(6, 0, 2) == 6);    // asked for: as many
  CHECK(DP::replicas_for(0, 3, 128) == 3);  // GPUs: one each
  CHECK(DP::replicas_for(2, 3, 128) == 2);
}

TEST_CASE("Chain runs its stages in order, under the names a Pipeline gives them, and clones") {
  torch::manual_seed(3);
  paratrain::Chain<First, Second> chain;
  const auto x = torch::randn({5, 6});
  CHECK(torch::allclose(chain->forward(x), chain->stage<1>()->forward(chain->stage<0>()->forward(x))));
  const auto names = chain->named_parameters().keys();
  CHECK(names == std::vector<std::string>{"0.fc.weight", "0.fc.bias", "1.fc.weight", "1.fc.bias"});
  const auto copy = std::dynamic_pointer_cast<paratrain::ChainImpl<First, Second>>(chain->clone());
  REQUIRE(copy);
  CHECK(torch::equal(copy->forward(x), chain->forward(x)));
  CHECK(copy->parameters()[0].data_ptr() != chain->parameters()[0].data_ptr());
}

TEST_CASE("Sharded<Optim, Stage, G> is hybrid sharding: the mesh of shard_group = G") {
  comm::Mpi c;
  const int world = c.size();
  if (world % 2 != 0) return;
  using Hybrid = paratrain::DataParallel<Net, comm::Mpi, paratrain::Sharded<torch::optim::SGD, paratrain::zero::stage2, 2>>;
  Hybrid s(make_net(), c.duplicate(), torch::optim::SGDOptions(0.1));
  CHECK(s.mesh().size(paratrain::Dim::shard) == 2);
  CHECK(s.mesh().size(paratrain::Dim::replicate) == world / 2);
  CHECK_THROWS_WITH_AS(Hybrid(make_net(), c.duplicate(), torch::optim::SGDOptions(0.1), {.shard_group = 1}),
                       doctest::Contains("name the group once"), paratrain::error);
}

TEST_CASE("data::from_torch: a LibTorch dataset trains under fit as the same rows in a TensorDataset") {
  comm::Mpi c;
  const int world = c.size();
  const auto rows = make_data(53, 4);
  const auto data = paratrain::data::from_torch(Rows(rows));
  CHECK(data.size() == 53);
  const auto b = data.get(torch::tensor({7, 0, 52}, torch::kLong));
  CHECK(torch::equal(b.inputs[0], rows.inputs().index_select(0, torch::tensor({7, 0, 52}))));
  CHECK(torch::equal(b.target, rows.targets().index_select(0, torch::tensor({7, 0, 52}))));
  CHECK(data.get(torch::empty({0}, torch::kLong)).inputs[0].sizes() == torch::IntArrayRef{0, 6});
  CHECK_THROWS_WITH_AS(data.get(torch::tensor({53}, torch::kLong)), doctest::Contains("outside"), paratrain::error);

  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  paratrain::DataParallel<Net, comm::Mpi, torch::optim::SGD> s(make_net(), std::move(c), sgd);
  paratrain::fit(s, data, {.epochs = 2, .batch_size = 3, .seed = 9, .progress = false});
  auto net = make_net();
  paratrain_test::fit_reference::train(net, rows, world, 2, 3, 9, sgd, torch::kCPU);
  const auto got = s.model()->parameters(), want = net->parameters();
  for (std::size_t i = 0; i < got.size(); ++i)
    CHECK(((got[i] - want[i]).abs().max() / want[i].abs().max()).item<double>() <= 1e-5);
}

}  // namespace newcomer_test
