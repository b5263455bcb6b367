// Activation checkpointing (paratrain::Recompute, Note [Recomputing activations]) against
// the plain layers it wraps: the same gradients on one device (dropout included, and the
// random stream left as it was), and under DDP, every ZeRO stage and every pipeline
// schedule the parameters of single-device training of the plain model
// (support/equivalence.hpp, support/pipeline_equivalence.hpp).
#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/pipeline/pipeline.hpp"
#include "paratrain/strategy/recompute.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "support/doctest.hpp"  // after LibTorch: see there
#include "support/equivalence.hpp"
#include "support/pipeline_equivalence.hpp"

namespace {

namespace comm = paratrain::comm;
namespace zero = paratrain::zero;

// Linear, dropout, tanh, Linear, with a count of its forward calls; `shift` may be an
// undefined tensor (as the Transformer layers' masks are), `scale` is not a tensor: both
// are bound by the recomputation.
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 8));
    drop = register_module("drop", torch::nn::Dropout(0.5));
    fc2 = register_module("fc2", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& shift, double scale) {
    ++calls;
    auto h = drop(fc1(x));
    if (shift.defined()) h = h + shift;
    return fc2(torch::tanh(h)) * scale;
  }
  int calls = 0;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Block);

struct Grads {
  std::vector<torch::Tensor> parameters;
  torch::Tensor input;
  torch::Tensor next_random;  // drawn after backward: where the random stream stood
  int calls = 0;
};

// One forward and backward of `block` (built from seed 5) on the same input, dropout drawn
// from seed 7. `split`: the input's gradient first, then the parameters', as a zero-bubble
// pipeline asks for them.
template <class B>
Grads run(bool split) {
  torch::manual_seed(5);
  B block;
  const auto x = torch::randn({10, 6}).requires_grad_(true);
  const auto w = torch::randn({10, 3});
  torch::manual_seed(7);
  const auto loss = (block(x, torch::Tensor(), 1.5) * w).sum();
  Grads g;
  if (split) {
    g.input = torch::autograd::grad({loss}, {x}, {}, /*retain_graph=*/true)[0];
    g.parameters = torch::autograd::grad({loss}, block->parameters());
  } else {
    loss.backward();
    g.input = x.grad();
    for (const auto& p : block->parameters()) g.parameters.push_back(p.grad());
  }
  g.next_random = torch::rand({4});
  g.calls = block->calls;
  return g;
}

void check_equal(const Grads& got, const Grads& want) {
  REQUIRE(got.parameters.size() == want.parameters.size());
  for (std::size_t i = 0; i < got.parameters.size(); ++i) CHECK(torch::equal(got.parameters[i], want.parameters[i]));
  CHECK(torch::equal(got.input, want.input));
  CHECK(torch::equal(got.next_random, want.next_random));
}

}  // namespace

TEST_CASE("Recompute gives the plain layer's gradients, dropout's mask included, and leaves the random stream as it was") {
  for (const bool split : {false, true}) {
    CAPTURE(split);
    const auto plain = run<Block>(split);
    const auto recomputed = run<paratrain::Recompute<Block>>(split);
    check_equal(recomputed, plain);
    CHECK(plain.calls == 1);
    // Forward, then once per backward pass that needs the layer: one, or the two halves.
    CHECK(recomputed.calls == (split ? 3 : 2));
  }
  // Without a backward to come (evaluation), forward runs once and records nothing.
  torch::NoGradGuard no_grad;
  paratrain::Recompute<Block> block;
  const auto y = block(torch::randn({2, 6}), torch::ones({8}), 1.0);
  CHECK(!y.requires_grad());
  CHECK(block->calls == 1);
}

TEST_CASE("DDP and every ZeRO stage train a recomputed model as one device trains the plain one") {
  using SGD = torch::optim::SGD;
  using paratrain_test::Scenario;
  const int world = comm::Mpi().size();
  const auto opts = torch::optim::SGDOptions(0.1).momentum(0.9);
  for (const int micro : {1, 2}) {
    // SGD: a wrong gradient scale shows. Rank r has 4 + r samples a step.
    const Scenario s{.steps = 6, .batch = 4, .varied_batch = true, .micro_batches = micro};
    CAPTURE(micro);
    const auto want = paratrain_test::reference<SGD>(s, world, opts);
    using paratrain_test::distributed;
    using paratrain_test::RecomputedMlp;
    CHECK(paratrain_test::max_relative_difference(
              distributed<comm::Mpi, SGD, torch::optim::SGDOptions, RecomputedMlp>(s, comm::Mpi(), opts), want) <=
          1e-5);
    CHECK(paratrain_test::max_relative_difference(
              distributed<comm::Mpi, paratrain::Sharded<SGD, zero::stage1>, torch::optim::SGDOptions, RecomputedMlp>(
                  s, comm::Mpi(), opts),
              want) <= 1e-5);
    CHECK(paratrain_test::max_relative_difference(
              distributed<comm::Mpi, paratrain::Sharded<SGD, zero::stage2>, torch::optim::SGDOptions, RecomputedMlp>(
                  s, comm::Mpi(), opts),
              want) <= 1e-5);
    CHECK(paratrain_test::max_relative_difference(
              distributed<comm::Mpi, paratrain::Sharded<SGD, zero::stage3>, torch::optim::SGDOptions, RecomputedMlp>(
                  s, comm::Mpi(), opts),
              want) <= 1e-5);    // Built by the strategy, each Unit<Recompute<...>> sharded as it is built.
    auto built = s;
    built.built_by_strategy = true;
    CHECK(paratrain_test::max_relative_difference(
              distributed<comm::Mpi, paratrain::Sharded<SGD, zero::stage3>, torch::optim::SGDOptions, RecomputedMlp>(
                  built, comm::Mpi(), opts),
              want) <= 1e-5);
  }
}

TEST_CASE("every pipeline schedule trains recomputed stages as one device trains the plain ones") {
  using namespace paratrain_test::pipe;
  using SGD = torch::optim::SGD;
  const int world = comm::Mpi().size();
  const auto check = [&]<class P, class Ref, class Update = SGD>(P*, Ref*, pipeline::Kind kind, int v = 1) {
    for (const int micro : {1, 4})
      check_pipeline<comm::Mpi, Update, P, Ref>(comm::Mpi(), {.schedule = kind, .virtual_stages = v}, micro, 6);
  };
  using Two = Pipeline<Entry, RecomputedHead>;
  using TwoRef = Pipeline<Entry, Head>;
  using Three = Pipeline<Entry, RecomputedMid, RecomputedHead>;
  using ThreeRef = Pipeline<Entry, Mid, Head>;
  using Four = Pipeline<Entry, RecomputedMid, RecomputedMid, RecomputedHead>;
  using FourRef = Pipeline<Entry, Mid, Mid, Head>;
  const auto all = {pipeline::Kind::gpipe, pipeline::Kind::one_f_one_b, pipeline::Kind::zero_bubble_h1};
  if (world % 2 == 0) {
    for (const auto kind : all) check((Two*)nullptr, (TwoRef*)nullptr, kind);
    // ZeRO-3 stages (ZB-H1 refuses stage 3: its W would run after the unit is freed).
    check.operator()<Two, TwoRef, paratrain::Sharded<SGD, zero::stage3>>(nullptr, nullptr, pipeline::Kind::one_f_one_b);
    check.operator()<Two, TwoRef, paratrain::Sharded<SGD, zero::stage2>>(nullptr, nullptr,
                                                                          pipeline::Kind::zero_bubble_h1);
    check((Four*)nullptr, (FourRef*)nullptr, pipeline::Kind::interleaved_1f1b, 2);
  }
  if (world == 3)
    for (const auto kind : all) check((Three*)nullptr, (ThreeRef*)nullptr, kind);
  if (world == 1) check((Two*)nullptr, (TwoRef*)nullptr, pipeline::Kind::interleaved_1f1b, 2);
}
