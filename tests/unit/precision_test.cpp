// Mixed precision (paratrain::Precision, Note [Mixed precision]) against single-device
// LibTorch under the same autocast policy: DDP and every ZeRO stage, with gradients
// summed in fp32 or bf16, and every pipeline schedule; that autocast really computes in
// bf16; the bytes of gradients on the wire (halved by bf16) against paratrain::plan.
//
// Tolerance. bf16 keeps 8 significant bits: ε = 2^-8 ≈ 0.0039 is the spacing of bf16
// numbers in [1, 2), and rounding to bf16 errs by at most ε/2 relative. Under one autocast
// policy the strategy and the reference compute every sample's forward alike; they differ
// where each rounds a sum over other samples: the weight gradient of each product (one
// rank's or micro-batch's partial sum rounded to bf16, against the whole batch's), and
// with Precision::reduce each partial and each pairwise sum across ranks (log2(4) = 2
// levels at 4 ranks). Each rounding is at most ε/2 of what it rounds, and a partial is at
// most the sum of the magnitudes, so a gradient element errs by a few ε/2 of the largest
// gradient: here at most 2 (partial, then sum) + 2 (reduction levels) = 4 roundings, 2ε.
// An SGD step turns that into the same relative error of the parameters' change. The
// tests take 3 steps and allow 4ε = 0.0156 of the largest change, leaving a factor 2 for
// the later steps' gradients being taken at parameters that already differ; the fp32
// equivalence tests of the other files hold to 1e-5.
#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/plan/plan.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/pipeline/pipeline.hpp"
#include "paratrain/strategy/precision.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "paratrain/strategy/unit.hpp"
#include "support/doctest.hpp"  // after LibTorch: see there
#include "support/equivalence.hpp"
#include "support/pipeline_equivalence.hpp"

namespace {

namespace comm = paratrain::comm;
namespace zero = paratrain::zero;
using paratrain::Precision;
using paratrain_test::Scenario;
using SGD = torch::optim::SGD;

constexpr double bf16_epsilon = 0.00390625;  // 2^-8
constexpr double tolerance = 4 * bf16_epsilon;

// Mlp's layers and function (support/equivalence.hpp), noting the type its first layer's
// output was computed in.
struct TapImpl : torch::nn::Module {
  TapImpl(paratrain_test::Features, int) {
    fc1 = register_module("fc1", paratrain::Unit<torch::nn::Linear>(8, 16));
    fc2 = register_module("fc2", paratrain::Unit<torch::nn::Linear>(16, 4));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = fc1(x);
    seen = h.scalar_type();
    return fc2(torch::tanh(h));
  }
  paratrain::Unit<torch::nn::Linear> fc1{nullptr}, fc2{nullptr};
  at::ScalarType seen = at::kFloat;
};
TORCH_MODULE(Tap);

// The largest difference of the parameters' changes from `start`, relative to the
// largest change the reference made.
double change_difference(const std::vector<torch::Tensor>& got, const std::vector<torch::Tensor>& want,
                         const std::vector<torch::Tensor>& start) {
  REQUIRE(got.size() == want.size());
  double worst = 0, largest = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    worst = std::max(worst, (got[i] - want[i]).abs().max().item<double>());
    largest = std::max(largest, (want[i] - start[i]).abs().max().item<double>());
  }
  return worst / largest;
}

template <class Update>
void check_update(const Precision& precision, const torch::optim::SGDOptions& opts) {
  const int world = comm::Mpi().size();
  Scenario s{.steps = 3, .batch = 4, .varied_batch = true};  // rank r: 4 + r samples a step
  s.options.precision = precision;
  const auto start = paratrain_test::make_model<Tap>({}, 0)->parameters();
  const auto want = paratrain_test::reference<SGD>(s, world, opts);  // Mlp, the same parameters
  const auto got = paratrain_test::distributed<comm::Mpi, Update, torch::optim::SGDOptions, Tap>(s, comm::Mpi(), opts);
  const double d = change_difference(got, want, start);
  CAPTURE(d);
  CHECK(d <= tolerance);
}

}  // namespace

TEST_CASE("bf16 autocast under DDP and every ZeRO stage trains as one device under the same policy") {
  // With momentum too: optimizer state, sharded at every ZeRO stage, that carries each step's
  // bf16-summed gradient into the next steps (a linear combination with positive weights, so
  // the tolerance's argument holds for the change it makes).
  for (const auto& opts : {torch::optim::SGDOptions(0.1), torch::optim::SGDOptions(0.1).momentum(0.9)})
    for (const auto reduce : {std::optional<at::ScalarType>{}, std::optional<at::ScalarType>{at::kBFloat16}}) {
      const Precision p{.autocast = at::kBFloat16, .reduce = reduce};
      CAPTURE(reduce.has_value());
      CAPTURE(opts.momentum());
      check_update<SGD>(p, opts);
      check_update<paratrain::Sharded<SGD, zero::stage1>>(p, opts);
      check_update<paratrain::Sharded<SGD, zero::stage2>>(p, opts);
      check_update<paratrain::Sharded<SGD, zero::stage3>>(p, opts);  // units gathered in bf16
      check_update<paratrain::Sharded<SGD, zero::stage3>>({.autocast = at::kBFloat16, .reduce = reduce, .gather = at::kFloat}, opts);
    }
}

namespace {

// A block that notes the type and the values of its weight as its forward sees them.
struct ProbeImpl : torch::nn::Module {
  ProbeImpl() { fc = register_module("fc", torch::nn::Linear(8, 4)); }
  torch::Tensor forward(torch::Tensor x) {
    seen = fc->weight.detach().clone();
    return fc(x);
  }
  torch::nn::Linear fc{nullptr};
  torch::Tensor seen;
};
TORCH_MODULE(Probe);

// A block whose layer norm autocast runs with its fp32 weight as it is (on an fp32 input:
// LibTorch's CPU layer norm takes no bf16 input with an fp32 weight).
struct NormedImpl : torch::nn::Module {
  NormedImpl() {
    fc = register_module("fc", torch::nn::Linear(8, 8));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
  }
  torch::Tensor forward(torch::Tensor x) {
    seen = norm->weight.scalar_type();
    return norm(x + fc(x));
  }
  torch::nn::Linear fc{nullptr};
  torch::nn::LayerNorm norm{nullptr};
  at::ScalarType seen = at::kFloat;
};
TORCH_MODULE(Normed);

struct ProbedImpl : torch::nn::Module {
  ProbedImpl() {
    first = register_module("first", paratrain::Unit<torch::nn::Linear>(8, 8));
    normed = register_module("normed", paratrain::Unit<Normed>());
    probe = register_module("probe", paratrain::Unit<Probe>());
  }
  torch::Tensor forward(torch::Tensor x) { return probe(normed(torch::tanh(first(x)).to(torch::kFloat))); }
  paratrain::Unit<torch::nn::Linear> first{nullptr};
  paratrain::Unit<Normed> normed{nullptr};
  paratrain::Unit<Probe> probe{nullptr};
};
TORCH_MODULE(Probed);

}  // namespace

TEST_CASE("ZeRO-3 under autocast computes with units gathered in bf16, autocast's rounding of the fp32 masters") {
  // Note [Gathers in the compute type]: from the second step on (the first one finds out
  // which units qualify) inside the unit's forward its weight is bf16 and equals the fp32
  // master weight rounded once, what autocast's own cast gives on one device; with
  // Precision::gather = at::kFloat it is the fp32 master itself. A unit whose layer norm
  // uses its weight as it is stays fp32. The parameters stay fp32 outside the units'
  // forward and backward.
  comm::Mpi c;
  const int world = c.size(), rank = c.rank();
  const paratrain_test::Data data;
  for (const auto gather : {std::optional<at::ScalarType>{}, std::optional<at::ScalarType>{at::kFloat}}) {
    CAPTURE(gather.has_value());
    torch::manual_seed(3);
    Probed model;
    paratrain::DataParallel<Probed, comm::Mpi, paratrain::Sharded<SGD, zero::stage3>> dp(
        model, c, torch::optim::SGDOptions(0.1).momentum(0.9),
        {.precision = {.autocast = at::kBFloat16, .gather = gather}});
    for (int step = 0; step < 3; ++step) {
      CAPTURE(step);
      const auto master = dp.full_parameters()[6];  // probe.fc.weight, fp32
      REQUIRE((master.scalar_type() == at::kFloat));
      dp.step(data.of(world, rank, step, 3 + rank, 8), paratrain_test::loss_fn);
      const auto& seen = model->probe->seen;
      const bool narrow = !gather && step > 0;
      CHECK((seen.scalar_type() == (narrow ? at::kBFloat16 : at::kFloat)));
      CHECK(torch::equal(seen, narrow ? master.to(at::kBFloat16) : master));
      CHECK((model->normed->seen == at::kFloat));
    }
    for (const auto& q : dp.full_parameters()) CHECK((q.scalar_type() == at::kFloat));
  }
}

TEST_CASE("gradients summed in bf16 arrive as bf16 sums: the wire carries bf16, not fp32") {
  // Each rank's bucket holds the sum over its samples (Note [Exact averaging]); summed in
  // bf16 across ranks and then divided by the global count N, each gradient times N is a
  // bf16 number up to fp32's rounding of the division (2^-22 relative), where fp32 sums lie
  // between bf16 numbers (~2^-9 relative, the largest of 212 elements far above 2^-12).
  comm::Mpi c;
  const int world = c.size(), rank = c.rank();
  const paratrain_test::Data data;
  const auto batch = data.of(world, rank, 0, 4 + rank, 8);
  const double n = 4.0 * world + world * (world - 1) / 2.0;  // 4 + r samples on rank r
  const auto off_bf16 = [&](std::optional<at::ScalarType> reduce) {
    auto model = paratrain_test::make_model<Tap>({}, rank);
    paratrain::DataParallel<Tap, comm::Mpi, SGD> dp(model, comm::Mpi(), torch::optim::SGDOptions(0.1),
                                                    {.precision = {.reduce = reduce}});
    dp.step(batch, paratrain_test::loss_fn);
    double worst = 0;
    for (const auto& q : model->parameters()) {
      const auto sum = q.grad().to(torch::kDouble) * n;
      const auto nonzero = sum.abs() > 0;
      const auto rounded = sum.to(torch::kFloat).to(torch::kBFloat16).to(torch::kDouble);
      worst = std::max(worst, ((sum - rounded).abs() / sum.abs()).masked_select(nonzero).max().item<double>());
    }
    return worst;
  };
  const double fp32 = off_bf16({}), bf16 = off_bf16(at::kBFloat16);
  CAPTURE(fp32);
  CAPTURE(bf16);
  CHECK(fp32 > 0x1p-12);  // the check can tell: fp32 sums are not on bf16's grid
  if (world > 1) CHECK(bf16 < 0x1p-20);
}

TEST_CASE("autocast computes in bf16, the parameters stay fp32, and bf16 gradients halve the bytes plan predicts") {
  comm::Mpi c;
  const int world = c.size(), rank = c.rank();
  const paratrain_test::Data data;
  const auto batch = data.of(world, rank, 0, 4 + rank, 8);
  const auto run = [&]<class Update>(Update*, const Precision& p) {
    auto model = paratrain_test::make_model<Tap>({}, rank);
    paratrain::DataParallel<Tap, comm::Mpi, Update> dp(model, comm::Mpi(), torch::optim::SGDOptions(0.1),
                                                       {.precision = p});
    dp.step(batch, paratrain_test::loss_fn);
    CHECK((model->seen == (p.autocast ? at::kBFloat16 : at::kFloat)));
    for (const auto& q : model->parameters()) CHECK((q.scalar_type() == at::kFloat));
    if (p.autocast) CHECK((dp.predict(batch).scalar_type() == at::kBFloat16));
    return dp.gradient_bytes_sent();
  };
  // Mlp's 8·16 + 16 + 16·4 + 4 = 212 parameters, in 1 bucket.
  namespace plan = paratrain::plan;
  const plan::Model m{.parameters = 212, .ranks = world, .buckets = 1};
  const plan::Model units{.parameters = 212, .ranks = world, .buckets = 2};  // at most a bucket per unit
  auto bf16 = m;
  bf16.reduce_bytes = 2;
  const auto ddp = run((SGD*)nullptr, {.autocast = at::kBFloat16});
  CHECK(ddp == plan::gradient_traffic(m, plan::stage::ddp));  // 848: DDP's buckets are not padded
  CHECK(run((SGD*)nullptr, {.autocast = at::kBFloat16, .reduce = at::kBFloat16}) * 2 == ddp);
  CHECK(run((SGD*)nullptr, {.reduce = at::kBFloat16}) == plan::gradient_traffic(bf16, plan::stage::ddp));
  using Z3 = paratrain::Sharded<SGD, zero::stage3>;
  const auto z3 = run((Z3*)nullptr, {});
  const auto z3_bf16 = run((Z3*)nullptr, {.autocast = at::kBFloat16, .reduce = at::kBFloat16});
  CHECK(z3_bf16 * 2 == z3);
  // ZeRO pads each bucket to a multiple of the ranks: at most plan's bound.
  CHECK(z3 >= plan::gradient_traffic({.parameters = 212, .ranks = world}, plan::stage::stage3));
  CHECK(z3 <= plan::gradient_traffic(units, plan::stage::stage3));
}

TEST_CASE("a type autocast or the reduction cannot use is an error naming the fix") {
  const auto error_of = [](const Precision& p) {
    return paratrain_test::error_of([&] {
      paratrain::DataParallel<paratrain_test::Mlp, comm::Mpi, SGD> dp(paratrain_test::make_model({}, 0), comm::Mpi(),
                                                                      torch::optim::SGDOptions(0.1), {.precision = p});
    });
  };
  CHECK(error_of({.autocast = at::kHalf}).find("on the CPU, whose autocast LibTorch runs in bf16 only") != std::string::npos);
  CHECK(error_of({.autocast = at::kFloat}).find("autocast computes in at::kBFloat16") != std::string::npos);
  CHECK(error_of({.reduce = at::kInt}).find("summed in a floating type") != std::string::npos);
  CHECK(error_of({.reduce = at::kHalf}).find("with fp32's range") != std::string::npos);
  CHECK(error_of({.gather = at::kBFloat16}).find("without autocast") != std::string::npos);
  CHECK(error_of({.autocast = at::kBFloat16, .gather = at::kHalf}).find("or in fp32") != std::string::npos);
}

TEST_CASE("bf16 autocast under every pipeline schedule trains as one device under the same policy") {
  using namespace paratrain_test::pipe;
  const int world = comm::Mpi().size();
  // The harness compares the parameters relative to themselves (a looser test than the
  // change's, above) and every step's per-replica loss, both to 4ε.
  const auto check = [&]<class P>(P*, pipeline::Kind kind, int v = 1) {
    PipelineOptions o{.schedule = kind, .virtual_stages = v};
    o.data_parallel.precision = {.autocast = at::kBFloat16, .reduce = at::kBFloat16};
    for (const int micro : {1, 4})
      paratrain_test::pipe::check_pipeline<comm::Mpi, SGD, P>(comm::Mpi(), o, micro, 3, tolerance);
  };
  if (world % 2 == 0) {
    for (const auto kind : {pipeline::Kind::gpipe, pipeline::Kind::one_f_one_b, pipeline::Kind::zero_bubble_h1})
      check((ChainOf<2>*)nullptr, kind);
    check((ChainOf<4>*)nullptr, pipeline::Kind::interleaved_1f1b, 2);
  }
  if (world == 3)
    for (const auto kind : {pipeline::Kind::gpipe, pipeline::Kind::one_f_one_b, pipeline::Kind::zero_bubble_h1})
      check((ChainOf<3>*)nullptr, kind);
  if (world == 1) check((ChainOf<2>*)nullptr, pipeline::Kind::interleaved_1f1b, 2);  // both stages on one rank
}
