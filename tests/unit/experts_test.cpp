// The mixture of experts over an expert group against the single-device layer (every expert,
// each rank's tokens one call of their own: Note [Experts over a group]), and that layer
// against the papers' definition written token by token (naive below): outputs, the tokens
// dropped, the auxiliary loss, the input's and every parameter's gradient, and three steps of
// SGD with momentum, at every expert degree the world allows, with top-1 and top-2 routing,
// dropless and with a capacity that drops, each rank with its own number of tokens.
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "paratrain/checkpoint/checkpointer.hpp"
#include "paratrain/checkpoint/load.hpp"
#include "paratrain/comm/mesh.hpp"
#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/experts/mixture_of_experts.hpp"
#include "paratrain/core/backward_scale.hpp"
#include "paratrain/pipeline/pipeline.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/strategy/recompute.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "paratrain/strategy/unit.hpp"
#include "paratrain/tensor_parallel/sharding.hpp"
#include "support/doctest.hpp"
#include "support/gpt_reference.hpp"
#include "support/group_degrees.hpp"
#include "support/shared_dir.hpp"

namespace experts_test {

namespace comm = paratrain::comm;
namespace moe = paratrain::moe;
namespace tp = paratrain::tp;

constexpr std::int64_t model = 8, hidden = 16;
constexpr double aux_weight = 0.01;

// World rank w's tokens and the weights of its loss Σ y·v: 5 + 3 (w mod 4) tokens, so that the
// ranks of an expert group hold different numbers of them.
torch::Tensor tokens(int w) {
  auto gen = at::detail::createCPUGenerator(100 + w);
  return at::randn({5 + 3 * (w % 4), model}, gen);
}
torch::Tensor loss_weights(int w) {
  auto gen = at::detail::createCPUGenerator(200 + w);
  return at::randn({5 + 3 * (w % 4), model}, gen);
}

bool close(const torch::Tensor& a, const torch::Tensor& b) { return torch::allclose(a, b, 1e-5, 1e-5); }

// The layer as the papers define it, token by token, with none of its tensor tricks: each
// token's router probabilities, its k most probable experts (sorted by hand), the gates
// (renormalised for k > 1), then the assignments in GShard's order (every first choice in token
// order, then every second) each taken while its expert has room (capacity ceil(f·T·k/E)), the
// token's output the sum of its taken assignments' expert MLPs times their gates; and Switch's
// auxiliary loss E·Σ f_e·P_e. `m` holds every expert (a group of one).
struct Naive {
  torch::Tensor y;
  std::int64_t dropped = 0;
  double aux = 0;
};
Naive naive(const moe::MixtureOfExpertsImpl& m, const torch::Tensor& x) {
  torch::NoGradGuard no_grad;
  const auto& o = m.options();
  const auto T = x.size(0);
  const int E = o.experts, k = o.top_k;
  std::vector<std::vector<int>> chosen(static_cast<std::size_t>(T));
  std::vector<std::vector<double>> gate(static_cast<std::size_t>(T));
  std::vector<double> first(static_cast<std::size_t>(E)), mean_p(static_cast<std::size_t>(E));
  for (std::int64_t t = 0; t < T; ++t) {
    const auto p = torch::softmax(torch::mv(m.router->weight, x[t]), 0);
    std::vector<int> order(static_cast<std::size_t>(E));
    for (int e = 0; e < E; ++e) order[static_cast<std::size_t>(e)] = e, mean_p[static_cast<std::size_t>(e)] += p[e].item<double>() / T;
    std::sort(order.begin(), order.end(), [&](int a, int b) { return p[a].item<double>() > p[b].item<double>(); });
    double sum = 0;
    for (int j = 0; j < k; ++j) sum += p[order[static_cast<std::size_t>(j)]].item<double>();
    for (int j = 0; j < k; ++j) {
      const int e = order[static_cast<std::size_t>(j)];
      chosen[static_cast<std::size_t>(t)].push_back(e);
      gate[static_cast<std::size_t>(t)].push_back(p[e].item<double>() / (k == 1 ? 1.0 : sum));
    }
    first[static_cast<std::size_t>(order[0])] += 1.0 / T;
  }
  const auto capacity = o.capacity_factor > 0 ? static_cast<std::int64_t>(std::ceil(o.capacity_factor * T * k / E))
                                               : std::numeric_limits<std::int64_t>::max();
  std::vector<std::int64_t> load(static_cast<std::size_t>(E));
  Naive r{.y = torch::zeros({T, o.model})};
  for (int j = 0; j < k; ++j)
    for (std::int64_t t = 0; t < T; ++t) {
      const int e = chosen[static_cast<std::size_t>(t)][static_cast<std::size_t>(j)];
      if (load[static_cast<std::size_t>(e)] >= capacity) {
        ++r.dropped;
        continue;
      }
      ++load[static_cast<std::size_t>(e)];
      const auto h = torch::gelu(torch::matmul(x[t], m.w1[e]) + m.b1[e]);
      r.y[t] += gate[static_cast<std::size_t>(t)][static_cast<std::size_t>(j)] * (torch::matmul(h, m.w2[e]) + m.b2[e]);
    }
  for (int e = 0; e < E; ++e) r.aux += E * first[static_cast<std::size_t>(e)] * mean_p[static_cast<std::size_t>(e)];
  return r;
}

// One configuration at expert degree ep: the layer over this rank's expert group against the
// single-device layer on the group's tokens. Returns how many assignments were dropped here.
std::int64_t check(int ep, moe::Options o) {
  paratrain::Mesh<comm::Mpi> mesh(comm::Mpi(), {.expert = ep});
  const tp::Group g(mesh, paratrain::Dim::expert);
  // The expert dimension is innermost here: the group's ranks are consecutive world ranks.
  const int me = mesh.rank(), first = me - g.rank();
  torch::manual_seed(7);
  moe::MixtureOfExperts layer(o, g);
  torch::manual_seed(7);
  moe::MixtureOfExperts reference(o);
  const auto [first_expert, local] = layer->local_experts();
  CHECK(local == o.experts / ep);

  torch::optim::SGD opt(layer->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD ref_opt(reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  std::int64_t dropped = 0;
  for (int step = 0; step < 3; ++step) {
    CAPTURE(step);
    opt.zero_grad();
    ref_opt.zero_grad();
    const auto x = tokens(me).requires_grad_();
    const auto y = layer->forward(x);
    ((y * loss_weights(me)).sum() + aux_weight * layer->aux_loss()).backward();
    // The router is whole on every rank and saw this rank's tokens only: summed over the group.
    auto router_grad = layer->router->weight.grad();
    g.all_reduce(router_grad);

    // The reference: every rank of the group's tokens, each one call (one capacity group).
    torch::Tensor ref_loss = torch::zeros({});
    torch::Tensor ref_y, ref_x, ref_aux;
    std::int64_t ref_dropped = 0;
    for (int q = 0; q < g.size(); ++q) {
      const auto xq = tokens(first + q).requires_grad_();
      const auto yq = reference->forward(xq);
      ref_loss = ref_loss + (yq * loss_weights(first + q)).sum() + aux_weight * reference->aux_loss();
      if (first + q == me) ref_y = yq, ref_x = xq, ref_aux = reference->aux_loss(), ref_dropped = reference->dropped();
      if (step == 0) {  // the single-device layer is the papers' layer
        const auto n = naive(*reference, xq.detach());
        CHECK(close(yq, n.y));
        CHECK(reference->dropped() == n.dropped);
        CHECK(reference->aux_loss().item<double>() == doctest::Approx(n.aux).epsilon(1e-5));
      }
    }
    ref_loss.backward();

    CHECK(close(y, ref_y));
    CHECK(layer->dropped() == ref_dropped);
    CHECK(close(layer->aux_loss(), ref_aux));
    CHECK(close(x.grad(), ref_x.grad()));
    CHECK(close(router_grad, reference->router->weight.grad()));
    // An expert's gradient on its rank is already the whole group's: not reduced over it.
    CHECK(close(layer->w1.grad(), reference->w1.grad().narrow(0, first_expert, local)));
    CHECK(close(layer->b1.grad(), reference->b1.grad().narrow(0, first_expert, local)));
    CHECK(close(layer->w2.grad(), reference->w2.grad().narrow(0, first_expert, local)));
    CHECK(close(layer->b2.grad(), reference->b2.grad().narrow(0, first_expert, local)));
    dropped += layer->dropped();
    opt.step();
    ref_opt.step();
  }
  CHECK(close(layer->router->weight, reference->router->weight));
  CHECK(close(layer->w1, reference->w1.narrow(0, first_expert, local)));
  CHECK(close(layer->b2, reference->b2.narrow(0, first_expert, local)));
  return dropped;
}

// A dense layer, a mixture of experts (joining the expert group of the strategy that builds
// it, or holding every expert outside one; a unit, which ZeRO-3 gathers over the ranks that
// hold the same experts) and a dense layer.
struct ExpertNetImpl : torch::nn::Module {
  explicit ExpertNetImpl(moe::Options o, std::optional<tp::Group> g = std::nullopt) {
    o.model = model;
    o.hidden = hidden;
    o.experts = 12;
    in = register_module("in", torch::nn::Linear(model, model));
    experts = register_module("experts", g ? paratrain::Unit<moe::MixtureOfExperts>(o, *g)
                                           : paratrain::Unit<moe::MixtureOfExperts>(o));
    out = register_module("out", torch::nn::Linear(model, model));
  }
  torch::Tensor forward(torch::Tensor x) { return out(experts(torch::tanh(in(x)))); }
  torch::nn::Linear in{nullptr}, out{nullptr};
  paratrain::Unit<moe::MixtureOfExperts> experts{nullptr};  // a unit: what ZeRO-3 gathers
};
TORCH_MODULE(ExpertNet);

// Data shard q's samples in step `step`: 2 + q mod 3 of them, so that the ranks of an expert
// group route different numbers of tokens. Inputs and targets.
std::pair<torch::Tensor, torch::Tensor> samples_of(int q, int step) {
  auto gen = at::detail::createCPUGenerator(1000 * step + q);
  const std::int64_t n = 2 + q % 3;
  auto x = at::randn({n, model}, gen);
  return {x, at::randn({n, model}, gen)};
}

// Three steps of `Update` (SGD with momentum, `clip` the largest gradient norm, 0: none) over
// data x expert ranks at expert degree `ep`, against the single-device model on every data
// shard's samples, each shard's tokens one call of the layer (its capacity group, as on its
// rank), the loss the shards' sample-weighted mean of MSE plus the auxiliary loss. The worst
// relative difference of this rank's parameters (its experts) from the reference's.
// `aux_in_backward`: the strategy's layer adds its auxiliary loss in backward itself (Note
// [Auxiliary loss in backward]) and its loss function leaves it out; the reference still adds
// it to its loss. `shard_group` is DataParallelOptions'.
template <class Update>
double train_both(int ep, moe::Options o, double clip = 0, bool aux_in_backward = false, int shard_group = 0) {
  const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
  torch::manual_seed(7);
  ExpertNet ref(o);
  torch::optim::SGD ref_opt(ref->parameters(), sgd);
  torch::manual_seed(7);
  auto adding = o;
  if (aux_in_backward) adding.aux_weight = aux_weight;
  paratrain::DataParallel<ExpertNet, comm::Mpi, Update> s([&] { return ExpertNet(adding); }, comm::Mpi(), sgd,
                                                          {.max_grad_norm = clip,
                                                           .shard_group = shard_group,
                                                           .expert_parallel = ep});
  REQUIRE(s.expert_group().size() == ep);
  REQUIRE(s.model()->experts->group().size() == ep);
  const auto data = s.data_shard();
  const auto loss = [&](const torch::Tensor& y, const torch::Tensor& target) {
    return aux_in_backward ? torch::mse_loss(y, target)
                           : torch::mse_loss(y, target) + aux_weight * s.model()->experts->aux_loss();
  };
  for (int step = 0; step < 3; ++step) {
    CAPTURE(step);
    ref_opt.zero_grad();
    std::int64_t total = 0;
    for (int q = 0; q < data.count; ++q) total += samples_of(q, step).first.size(0);
    for (int q = 0; q < data.count; ++q) {
      const auto [x, y] = samples_of(q, step);
      const auto out = ref(x);  // before aux_loss(): it is this forward's
      const auto l = torch::mse_loss(out, y) + aux_weight * ref->experts->aux_loss();
      (l * (static_cast<double>(x.size(0)) / static_cast<double>(total))).backward();
    }
    if (clip > 0) torch::nn::utils::clip_grad_norm_(ref->parameters(), clip);
    ref_opt.step();
    const auto [x, y] = samples_of(data.index, step);
    const auto r = s.step(paratrain::Batch(x, y), loss);
    CHECK(r.global_samples == static_cast<double>(total));
    if (clip > 0) CHECK(r.grad_norm > clip);  // the clip did cut
  }
  // The reference's parameters, each as the part this rank holds (its experts).
  const auto want = ref->named_parameters();
  const auto mine = paratrain_test::gpt::as_held(*s.model(), [&](const std::string& n) { return want[n]; });
  return paratrain_test::gpt::max_relative_difference(s.full_parameters(), mine);
}

// Steps [first, last) at expert degree `ep` under Update, Adam, dropless and without the
// auxiliary loss (so that the tokens' grouping into ranks changes nothing), 12 samples a step
// dealt over the data shards; loading `from` (unless empty) and saving to `to` (unless empty).
// The parameters after, each whole (the experts gathered over the expert group).
template <class Update>
std::vector<torch::Tensor> leg(int ep, const std::filesystem::path& from, const std::filesystem::path& to, int first,
                               int last) {
  torch::manual_seed(11);
  paratrain::DataParallel<ExpertNet, comm::Mpi, Update> s([] { return ExpertNet(moe::Options{.top_k = 2, .capacity_factor = 0}); },
                                                          comm::Mpi(), torch::optim::AdamOptions(0.01).eps(1e-3),
                                                          {.expert_parallel = ep});
  if (!from.empty()) paratrain::checkpoint::load(s, paratrain::checkpoint::latest(from).value());
  const auto data = s.data_shard();
  const auto loss = [](const torch::Tensor& y, const torch::Tensor& target) { return torch::mse_loss(y, target); };
  for (int step = first; step < last; ++step) {
    auto gen = at::detail::createCPUGenerator(300 + step);
    const auto x = at::randn({12, model}, gen), y = at::randn({12, model}, gen);
    const auto begin = 12 * data.index / data.count, end = 12 * (data.index + 1) / data.count;
    s.step(paratrain::Batch(x.narrow(0, begin, end - begin), y.narrow(0, begin, end - begin)), loss);
  }
  if (!to.empty()) paratrain::checkpoint::save(s, to, last);
  std::vector<torch::Tensor> out;
  const auto sliced = tp::sliced_parameters_of(*s.model());
  auto params = s.full_parameters();
  std::size_t i = 0;
  for (const auto& p : s.model()->named_parameters()) {
    auto t = params[i++];
    if (sliced.count(p.key())) t = s.expert_group().all_gather(t, 0);
    out.push_back(t);
  }
  return out;
}

// A pipeline stage: a dense layer, then a mixture of experts joining the strategy's expert
// group (every expert outside one), adding its auxiliary loss in backward with weight `aux`
// (0: not at all).
struct ExpertStageImpl : torch::nn::Module {
  ExpertStageImpl(moe::Options o, double aux) {
    o.model = model;
    o.hidden = hidden;
    o.experts = 12;
    o.aux_weight = aux;
    dense = register_module("dense", torch::nn::Linear(model, model));
    experts = register_module("experts", paratrain::Unit<moe::MixtureOfExperts>(o));
  }
  torch::Tensor forward(torch::Tensor x) { return experts(torch::tanh(dense(x))); }
  torch::nn::Linear dense{nullptr};
  paratrain::Unit<moe::MixtureOfExperts> experts{nullptr};
};
TORCH_MODULE(ExpertStage);

// Two such stages as a pipeline on K pipeline ranks (K = 1: one rank runs both, interleaved),
// their experts cut over expert groups of `ep`, replicated over what the world leaves; replica
// r is given 2 micro-batches a step, of 2 + r mod 3 and 3 samples, and each stage's layer adds
// its auxiliary loss in backward. The reference: the two stages on one device, each
// micro-batch one call (its capacity group, as on its rank), the loss the micro-batches'
// sample-weighted mean of MSE plus both layers' auxiliary losses. Three steps of SGD with
// momentum; the worst relative difference of this rank's stages' parameters.
// `scaled`: with loss scaling on (a power of two, so exact): the replicas' first micro-batches
// differ (2, 3, 4 samples), and an expert's gradient gathers every replica's tokens in backward
// (Note [Loss scaling]: the unit is 1 under expert parallelism).
template <class Update>
double pipeline_both(int ep, int K, moe::Options o, bool scaled = false) {
  const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
  torch::manual_seed(7);
  ExpertStage ref0(o, 0.0);
  torch::manual_seed(8);
  ExpertStage ref1(o, 0.0);
  auto ref_params = ref0->parameters();
  for (const auto& p : ref1->parameters()) ref_params.push_back(p);
  torch::optim::SGD ref_opt(ref_params, sgd);
  using P = paratrain::Pipeline<ExpertStage, ExpertStage>;
  paratrain::DataParallel<P, comm::Mpi, Update> s(
      P([&] { torch::manual_seed(7); return ExpertStage(o, aux_weight); },
        [&] { torch::manual_seed(8); return ExpertStage(o, aux_weight); }),
      comm::Mpi(), sgd,
      {.schedule = K == 1 ? paratrain::pipeline::Kind::interleaved_1f1b : paratrain::pipeline::Kind::one_f_one_b,
       .virtual_stages = 2 / K,
       .data_parallel = {.precision = {.loss_scale = scaled ? std::optional(paratrain::LossScaling{.init_scale = 1024})
                                                           : std::nullopt},
                         .expert_parallel = ep}});
  REQUIRE(s.pipeline_size() == K);
  REQUIRE(s.expert_group().size() == ep);
  const auto sizes = [](int r) { return std::array<std::int64_t, 2>{2 + r % 3, 3}; };
  const auto loss = [](const torch::Tensor& y, const torch::Tensor& target) { return torch::mse_loss(y, target); };
  for (int step = 0; step < 3; ++step) {
    CAPTURE(step);
    std::int64_t total = 0;
    for (int r = 0; r < s.replicas(); ++r) total += sizes(r)[0] + sizes(r)[1];
    ref_opt.zero_grad();
    std::vector<paratrain::Batch> mine;
    for (int r = 0; r < s.replicas(); ++r)
      for (int j = 0; j < 2; ++j) {
        auto gen = at::detail::createCPUGenerator(1000 * step + 10 * r + j);
        const auto n = sizes(r)[static_cast<std::size_t>(j)];
        const auto x = at::randn({n, model}, gen), y = at::randn({n, model}, gen);
        if (r == s.replica()) mine.emplace_back(x, y);
        const auto hidden_out = ref0(x);  // each layer's aux_loss() is this forward's
        const auto out = ref1(hidden_out);
        const auto l = torch::mse_loss(out, y) + aux_weight * (ref0->experts->aux_loss() + ref1->experts->aux_loss());
        (l * (static_cast<double>(n) / static_cast<double>(total))).backward();
      }
    ref_opt.step();
    const auto r = s.step(std::span<const paratrain::Batch>(mine), loss);
    CHECK(r.global_samples == static_cast<double>(total));
  }
  return paratrain_test::gpt::stages_difference(s, ref0, ref1);
}

}  // namespace experts_test

TEST_CASE("moe::MixtureOfExperts over an expert group equals the single-device layer: top-1 and top-2, dropless and "
          "dropping, outputs, gradients and SGD with momentum, ranks with different token counts") {
  using namespace experts_test;
  const int world = comm::Mpi().size();
  std::int64_t dropped = 0;
  for (const int ep : paratrain_test::group_degrees(world))
    for (const int k : {1, 2})
      for (const double capacity : {0.0, 1.0}) {
        CAPTURE(ep);
        CAPTURE(k);
        CAPTURE(capacity);
        const auto here = check(ep, {.model = model, .hidden = hidden, .experts = 12, .top_k = k, .capacity_factor = capacity});
        if (capacity == 0.0) CHECK(here == 0);
        dropped += here;
      }
  // The capacity cases did drop (on some rank): the test covers dropping.
  auto any = torch::tensor({static_cast<double>(dropped)});
  comm::Mpi().all_reduce(any, paratrain::reduce_op::sum);
  CHECK(any.item<double>() > 0);
}

TEST_CASE("moe::MixtureOfExperts refuses experts its group cannot share, and a bad top_k or capacity, on every rank") {
  using namespace experts_test;
  paratrain::Mesh<comm::Mpi> mesh(comm::Mpi(), {.expert = comm::Mpi().size()});
  const tp::Group g(mesh, paratrain::Dim::expert);
  if (g.size() > 1)
    CHECK_THROWS_WITH_AS(moe::MixtureOfExperts(moe::Options{.model = 4, .hidden = 4, .experts = g.size() + 1}, g),
                         doctest::Contains("cannot be shared equally"), paratrain::error);
  CHECK_THROWS_WITH_AS(moe::MixtureOfExperts(moe::Options{.model = 4, .hidden = 4, .experts = 4, .top_k = 5}),
                       doctest::Contains("top_k is 5"), paratrain::error);
  CHECK_THROWS_WITH_AS(moe::MixtureOfExperts(moe::Options{.model = 4, .hidden = 4, .experts = 4, .capacity_factor = -1}),
                       doctest::Contains("capacity_factor must be >= 0"), paratrain::error);
  // Built under sequence parallelism over a tensor group: its router and experts are whole on
  // every tensor rank, which would route other positions.
  if (comm::Mpi().size() > 1) {
    paratrain::Mesh<comm::Mpi> tensor_mesh(comm::Mpi(), {.tensor = comm::Mpi().size()});
    const tp::Construction scope(tp::Context{.group = tp::Group(tensor_mesh, paratrain::Dim::tensor),
                                             .sequence_parallel = true});
    CHECK_THROWS_WITH_AS(moe::MixtureOfExperts(moe::Options{.model = 4, .hidden = 4, .experts = 4}),
                         doctest::Contains("built under sequence parallelism"), paratrain::error);
  }
}

TEST_CASE("moe::MixtureOfExperts' capacity is ceil(f · T · k / E), a whole product taken as whole") {
  using namespace experts_test;
  // 1.1 · 50 · 2 / 2 is 55.000000000000007 in doubles; GShard's formula means 55.
  CHECK(moe::MixtureOfExpertsImpl::capacity_of(1.1, 100, 2) == 55);
  CHECK(moe::MixtureOfExpertsImpl::capacity_of(1.25, 10, 4) == 4);  // 3.125
  CHECK(moe::MixtureOfExpertsImpl::capacity_of(1.0, 7, 2) == 4);    // 3.5
  CHECK(moe::MixtureOfExpertsImpl::capacity_of(2.0, 8, 4) == 4);
  // And the layer's forward uses it: 50 tokens, top-2, 2 experts, factor 1.1.
  moe::MixtureOfExperts layer(moe::Options{.model = 4, .hidden = 4, .experts = 2, .top_k = 2, .capacity_factor = 1.1});
  (void)layer->forward(torch::randn({50, 4}));
  CHECK(layer->capacity() == 55);
}

TEST_CASE("DataParallel over data x expert ranks equals the single-device model: DDP and ZeRO 1-3, top-1 and top-2, "
          "dropless and dropping, the auxiliary loss, clipping, ranks with different token counts") {
  using namespace experts_test;
  using SGD = torch::optim::SGD;
  const int world = comm::Mpi().size();
  for (const int ep : paratrain_test::group_degrees(world)) {
    CAPTURE(ep);
    CHECK(train_both<SGD>(ep, {.top_k = 2, .capacity_factor = 0}) <= 1e-5);
    CHECK(train_both<paratrain::Sharded<SGD, paratrain::zero::stage1>>(ep, {.top_k = 1, .capacity_factor = 1.0}) <= 1e-5);
    CHECK(train_both<paratrain::Sharded<SGD, paratrain::zero::stage2>>(ep, {.top_k = 2, .capacity_factor = 1.0},
                                                                       /*clip=*/0.05) <= 1e-5);
    CHECK(train_both<paratrain::Sharded<SGD, paratrain::zero::stage3>>(ep, {.top_k = 1, .capacity_factor = 0}) <= 1e-5);
    CHECK(train_both<SGD>(ep, {.top_k = 1, .capacity_factor = 1.0}, /*clip=*/0.05) <= 1e-5);
    // The layer adding its auxiliary loss in backward: the same training.
    CHECK(train_both<SGD>(ep, {.top_k = 2, .capacity_factor = 1.0}, 0, /*aux_in_backward=*/true) <= 1e-5);
    if (world / ep >= 2) {
      // Hybrid sharding, one rank a shard group (at 4 ranks, ep 2: replicate 2 x expert 2): the
      // experts whole on each rank, the dense parameters sharded over the expert group, every
      // shard summed across the replicate dimension (Note [Expert buckets]).
      CHECK(train_both<paratrain::Sharded<SGD, paratrain::zero::stage2>>(ep, {.top_k = 2, .capacity_factor = 1.0}, 0,
                                                                         false, /*shard_group=*/1) <= 1e-5);
      CHECK(train_both<paratrain::Sharded<SGD, paratrain::zero::stage3>>(ep, {.top_k = 1, .capacity_factor = 0}, 0,
                                                                         false, /*shard_group=*/1) <= 1e-5);
    }
  }
}

TEST_CASE("gradients are summed over a communicator no layer uses: where the batch is one expert group, one of their "
          "own, so a rank may start a sum before or after the group's all-to-all (Note [Gradient communicators])") {
  using namespace experts_test;
  const int world = comm::Mpi().size(), me = comm::Mpi().rank();
  paratrain::Mesh<comm::Mpi> mesh(comm::Mpi(), {.expert = world});
  auto& layers = mesh.group(paratrain::Dim::expert);  // what a mixture's tp::Group exchanges over
  auto& sums = mesh.gradient_group(paratrain::Dims::batch());
  CHECK(sums.size() == world);
  // A sum started before the all-to-all on even ranks and after it on odd ones, as a rank's
  // gradients are ready at its own moment, for more collectives than the fingerprint's
  // period (2 a step, 260 > 256): where they share one communicator its ranks issued
  // different collectives, and every rank throws (Note [Collective fingerprint]).
  const auto in = torch::arange(2 * world, torch::kFloat) + 100 * me;  // two elements to each rank
  for (int step = 0; step < 130; ++step) {
    CAPTURE(step);
    auto g = torch::full({3}, static_cast<float>(me + step));
    auto out = torch::empty({2 * world});
    std::optional<comm::Mpi::Request> sum;
    if (me % 2 == 0) sum.emplace(sums.iall_reduce(g, paratrain::reduce_op::sum));
    layers.all_to_all(in, out);
    if (me % 2 == 1) sum.emplace(sums.iall_reduce(g, paratrain::reduce_op::sum));
    sum->wait();
    CHECK(g.allclose(torch::full({3}, world * (world - 1) / 2.0F + static_cast<float>(world * step))));
    for (int r = 0; r < world; ++r)  // rank r's elements 2me, 2me + 1
      CHECK(out.narrow(0, 2 * r, 2).equal(torch::tensor({2.0F * me, 2.0F * me + 1}) + 100 * r));
  }
  // Where no layer's group has the batch's ranks, the batch's group itself: no communicator more.
  paratrain::Mesh<comm::Mpi> plain(comm::Mpi(), {});
  CHECK(&plain.gradient_group(paratrain::Dims::batch()) == &plain.group(paratrain::Dims::batch()));
}

TEST_CASE("under expert parallelism a bucket holds experts or dense parameters, never both, and DDP hands each "
          "gradient byte to one collective: the dense parameters' bucket sums the expert group too") {
  using namespace experts_test;
  const int world = comm::Mpi().size();
  for (const int ep : paratrain_test::group_degrees(world)) {
    CAPTURE(ep);
    torch::manual_seed(7);
    paratrain::DataParallel<ExpertNet, comm::Mpi, torch::optim::SGD> s(
        [] { return ExpertNet(moe::Options{.top_k = 2, .capacity_factor = 0}); }, comm::Mpi(),
        torch::optim::SGDOptions(0.1).momentum(0.9), {.expert_parallel = ep});
    const auto sliced = tp::sliced_parameters_of(*s.model());  // the experts, where ep > 1
    int expert_buckets = 0, dense_buckets = 0;
    for (std::size_t b = 0; b < s.bucket_count(); ++b) {
      const auto names = s.bucket_names(b);
      const auto experts = std::count_if(names.begin(), names.end(), [&](const auto& n) { return sliced.count(n) > 0; });
      CAPTURE(b);
      CHECK((experts == 0 || experts == static_cast<std::ptrdiff_t>(names.size())));
      ++(experts > 0 ? expert_buckets : dense_buckets);
    }
    CHECK(dense_buckets > 0);
    CHECK(expert_buckets == (ep > 1 ? 1 : 0));  // the layer's four expert tensors, consecutive in backward
    const auto [x, y] = samples_of(s.data_shard().index, 0);
    s.step(paratrain::Batch(x, y), [](const torch::Tensor& out, const torch::Tensor& target) { return torch::mse_loss(out, target); });
    std::int64_t bytes = 0;
    for (const auto& p : s.model()->parameters()) bytes += static_cast<std::int64_t>(p.nbytes());
    CHECK(s.gradient_bytes_sent() == bytes);
  }
}

TEST_CASE("moe::MixtureOfExperts with aux_weight adds its auxiliary loss in backward, scaled by BackwardScale: the "
          "gradients of loss + w * aux_loss() (times the scale)") {
  using namespace experts_test;
  const moe::Options o{.model = model, .hidden = hidden, .experts = 4, .top_k = 2, .capacity_factor = 1.0};
  for (const double scale : {1.0, 3.5}) {
    CAPTURE(scale);
    torch::manual_seed(5);
    moe::MixtureOfExperts plain(o);
    auto w = o;
    w.aux_weight = aux_weight;
    torch::manual_seed(5);
    moe::MixtureOfExperts adding(w);
    const auto x = tokens(1);
    const auto plain_y = plain(x);  // before aux_loss(): it is this forward's
    ((plain_y * loss_weights(1)).sum() + aux_weight * plain->aux_loss()).backward();
    {
      const paratrain::BackwardScale in_scope(scale);
      const auto y = adding(x);  // the scale is forward's
      CHECK(paratrain::BackwardScale::current() == scale);
      ((y * loss_weights(1)).sum() * scale).backward();
    }
    CHECK(paratrain::BackwardScale::current() == 1.0);
    const auto p = plain->named_parameters(), a = adding->named_parameters();
    for (const auto& item : p) {
      CAPTURE(item.key());
      CHECK(close(a[item.key()].grad(), item.value().grad() * scale));
    }
    // The router's gradient includes the auxiliary loss's: the weight matters.
    torch::manual_seed(5);
    moe::MixtureOfExperts none(o);
    (none(x) * loss_weights(1)).sum().backward();
    CHECK(!close(none->router->weight.grad(), plain->router->weight.grad()));
  }
  CHECK_THROWS_WITH_AS(moe::MixtureOfExperts(moe::Options{.model = 4, .hidden = 4, .experts = 4, .aux_weight = -1}),
                       doctest::Contains("aux_weight is"), paratrain::error);
}

TEST_CASE("a recomputed mixture adds its auxiliary loss under forward's BackwardScale, when backward runs it again") {
  using namespace experts_test;
  moe::Options o{.model = model, .hidden = hidden, .experts = 4, .top_k = 2, .capacity_factor = 1.0,
                 .aux_weight = aux_weight};
  torch::manual_seed(5);
  moe::MixtureOfExperts plain(o);
  torch::manual_seed(5);
  paratrain::Recompute<moe::MixtureOfExperts> again(o);
  const auto x = tokens(2);
  const auto train = [&](auto& layer) {
    torch::Tensor y;
    {
      const paratrain::BackwardScale in_scope(2.5);
      y = layer(x);
    }
    ((y * loss_weights(2)).sum() * 2.5).backward();  // outside the scope, as a pipeline's backward is
  };
  train(plain);
  train(again);
  const auto want = plain->named_parameters();
  for (const auto& item : again->named_parameters()) {
    CAPTURE(item.key());
    CHECK(close(item.value().grad(), want[item.key()].grad()));
  }
}

TEST_CASE("a pipeline over data x expert ranks equals the single-device model: its stages' mixtures adding their "
          "auxiliary losses in backward, top-1 and top-2, dropless and dropping, across pipeline ranks and on one, "
          "DDP and ZeRO 1-3") {
  using namespace experts_test;
  using SGD = torch::optim::SGD;
  const int world = comm::Mpi().size();
  // Every expert degree on one pipeline rank (both stages, interleaved).
  for (const int ep : paratrain_test::group_degrees(world)) {
    CAPTURE(ep);
    CHECK(pipeline_both<SGD>(ep, 1, {.top_k = 2, .capacity_factor = 1.0}) <= 1e-5);
    CHECK(pipeline_both<SGD>(ep, 1, {.top_k = 2, .capacity_factor = 1.0}, /*scaled=*/true) <= 1e-5);
  }
  if (world % 2 == 0) {
    // Two pipeline ranks: activations and the auxiliary losses' gradients cross ranks.
    CHECK(pipeline_both<SGD>(world / 2, 2, {.top_k = 1, .capacity_factor = 0}) <= 1e-5);
    CHECK(pipeline_both<paratrain::Sharded<SGD, paratrain::zero::stage1>>(world / 2, 2,
                                                                         {.top_k = 2, .capacity_factor = 1.0}) <= 1e-5);
  }
  if (world == 4) {
    // Expert groups of 2 x 2 replicas each, on one pipeline rank: ZeRO-2 and 3 shard each stage
    // over the replicas that hold the same experts.
    CHECK(pipeline_both<paratrain::Sharded<SGD, paratrain::zero::stage2>>(2, 1, {.top_k = 1, .capacity_factor = 1.0}) <=
          1e-5);
    CHECK(pipeline_both<paratrain::Sharded<SGD, paratrain::zero::stage3>>(2, 1, {.top_k = 2, .capacity_factor = 0}) <=
          1e-5);
  }
}

TEST_CASE("checkpoints move between expert degrees: ep 2 x ZeRO-1 -> ep 1 (DDP) -> ep = world x ZeRO-3 with Adam, "
          "against the uninterrupted single-device run") {
  using namespace experts_test;
  comm::Mpi world;
  if (world.size() < 2) return;
  const int first_degree = world.size() % 2 == 0 ? 2 : world.size();
  torch::manual_seed(11);
  ExpertNet ref(moe::Options{.top_k = 2, .capacity_factor = 0});
  torch::optim::Adam opt(ref->parameters(), torch::optim::AdamOptions(0.01).eps(1e-3));
  for (int step = 0; step < 6; ++step) {
    auto gen = at::detail::createCPUGenerator(300 + step);
    const auto x = at::randn({12, model}, gen), y = at::randn({12, model}, gen);
    opt.zero_grad();
    torch::mse_loss(ref(x), y).backward();
    opt.step();
  }
  const auto a = paratrain_test::shared_dir(world, "ep_ckpt_a"), b = paratrain_test::shared_dir(world, "ep_ckpt_b");
  leg<paratrain::Sharded<torch::optim::Adam, paratrain::zero::stage1>>(first_degree, {}, a, 0, 2);
  leg<torch::optim::Adam>(1, a, b, 2, 4);
  const auto got = leg<paratrain::Sharded<torch::optim::Adam, paratrain::zero::stage3>>(world.size(), b, {}, 4, 6);
  CHECK(paratrain_test::gpt::max_relative_difference(got, ref->parameters()) <= 1e-5);
  paratrain_test::remove_shared_dir(world, a);
  paratrain_test::remove_shared_dir(world, b);
}

TEST_CASE("DataParallel under expert parallelism refuses, on every rank: a degree that does not divide the ranks, "
          "deterministic mode, a rank without samples, different micro-batch counts, a layer built on another group") {
  using namespace experts_test;
  const int world = comm::Mpi().size();
  using Ddp = paratrain::DataParallel<ExpertNet, comm::Mpi, torch::optim::SGD>;
  const auto build = [] { return ExpertNet(moe::Options{}); };
  CHECK_THROWS_WITH_AS(Ddp(build, comm::Mpi(), torch::optim::SGDOptions(0.1), {.expert_parallel = world + 1}),
                       doctest::Contains("the expert degree must be at least 1 and divide them"), paratrain::error);
  if (world == 1) return;
  CHECK_THROWS_WITH_AS(Ddp(build, comm::Mpi(), torch::optim::SGDOptions(0.1),
                           {.deterministic = {.shards = 12}, .expert_parallel = world}),
                       doctest::Contains("deterministic mode does not take expert parallelism"), paratrain::error);
  // Experts cut over a group the strategy does not know: the world's, under a strategy without experts.
  paratrain::Mesh<comm::Mpi> mesh(comm::Mpi(), {.expert = world});
  const tp::Group g(mesh, paratrain::Dim::expert);
  CHECK_THROWS_WITH_AS(Ddp([&] { return ExpertNet(moe::Options{}, g); }, comm::Mpi(), torch::optim::SGDOptions(0.1)),
                       doctest::Contains(("is cut over an expert group of " + std::to_string(world) + " ranks").c_str()),
                       paratrain::error);
  Ddp s(build, comm::Mpi(), torch::optim::SGDOptions(0.1), {.expert_parallel = world});
  const auto loss = [](const torch::Tensor& y, const torch::Tensor& t) { return torch::mse_loss(y, t); };
  const auto [x, y] = samples_of(s.data_shard().index, 0);
  // Rank 1 has nothing this step.
  if (s.rank() == 1) {
    CHECK_THROWS_WITH_AS(s.join(), doctest::Contains("no samples this step"), paratrain::error);
  } else {
    CHECK_THROWS_WITH_AS(s.step(paratrain::Batch(x, y), loss), doctest::Contains("no samples this step"),
                         paratrain::error);
  }
  // Rank 1 accumulates an empty micro-batch while the others accumulate theirs: its forward
  // would route nothing while theirs wait for it.
  CHECK_THROWS_WITH_AS((void)s.accumulate(s.rank() == 1 ? paratrain::Batch(x.narrow(0, 0, 0), y.narrow(0, 0, 0))
                                                        : paratrain::Batch(x, y),
                                          loss),
                       doctest::Contains("no samples this step"), paratrain::error);
  // Rank 0 has two micro-batches, the others one.
  std::vector<paratrain::Batch> two{paratrain::Batch(x, y), paratrain::Batch(x, y)};
  CHECK_THROWS_WITH_AS(s.step(std::span<const paratrain::Batch>(two.data(), s.rank() == 0 ? 2 : 1), loss),
                       doctest::Contains("micro-batches this step"), paratrain::error);
  // And then a good step.
  CHECK(s.step(paratrain::Batch(x, y), loss).global_samples > 0);
}

TEST_CASE("ZeRO-3 under expert parallelism refuses, on every rank, a unit built sharded whose dense parameters "
          "differ across the expert group: they are never broadcast") {
  using namespace experts_test;
  const int world = comm::Mpi().size();
  if (world == 1) return;
  using Zero3 =
      paratrain::DataParallel<ExpertNet, comm::Mpi, paratrain::Sharded<torch::optim::SGD, paratrain::zero::stage3>>;
  const int rank = comm::Mpi().rank();
  // Every rank its own seed: the experts are the expert group's to differ (each rank draws its
  // slice of the whole layer's), the router is not.
  CHECK_THROWS_WITH_AS(Zero3(
                           [&] {
                             torch::manual_seed(7 + static_cast<std::uint64_t>(rank));
                             return ExpertNet(moe::Options{});
                           },
                           comm::Mpi(), torch::optim::SGDOptions(0.1), {.expert_parallel = world}),
                       doctest::Contains("the ranks built unit 'experts' with different initial values"),
                       paratrain::error);
}

TEST_CASE("a pipeline under expert parallelism refuses, on every rank: a degree the world cannot take, replicas of an "
          "expert group with different micro-batch counts, an empty micro-batch, a replica without any") {
  using namespace experts_test;
  const int world = comm::Mpi().size();
  using P = paratrain::Pipeline<ExpertStage, ExpertStage>;
  using Pipe = paratrain::DataParallel<P, comm::Mpi, torch::optim::SGD>;
  const auto stages = [] {
    return P([] { return ExpertStage(moe::Options{}, aux_weight); }, [] { return ExpertStage(moe::Options{}, aux_weight); });
  };
  const paratrain::PipelineOptions one_rank{.schedule = paratrain::pipeline::Kind::interleaved_1f1b, .virtual_stages = 2};
  auto too_many = one_rank;
  too_many.data_parallel.expert_parallel = world + 1;
  CHECK_THROWS_WITH_AS(Pipe(stages(), comm::Mpi(), torch::optim::SGDOptions(0.1), too_many),
                       doctest::Contains(("expert groups of " + std::to_string(world + 1)).c_str()), paratrain::error);
  if (world == 1) return;
  auto options = one_rank;
  options.data_parallel.expert_parallel = world;
  Pipe s(stages(), comm::Mpi(), torch::optim::SGDOptions(0.1), options);
  const auto loss = [](const torch::Tensor& y, const torch::Tensor& t) { return torch::mse_loss(y, t); };
  const auto [x, y] = samples_of(s.replica(), 0);
  const std::vector<paratrain::Batch> two{paratrain::Batch(x, y), paratrain::Batch(x, y)};
  // Replica 0 has two micro-batches, the others one.
  CHECK_THROWS_WITH_AS(s.step(std::span<const paratrain::Batch>(two.data(), s.replica() == 0 ? 2 : 1), loss),
                       doctest::Contains("was given from 1 to 2 micro-batches"), paratrain::error);
  // Replica 1's second micro-batch is empty.
  const std::vector<paratrain::Batch> empty_second{paratrain::Batch(x, y),
                                                   s.replica() == 1 ? paratrain::Batch(x.narrow(0, 0, 0), y.narrow(0, 0, 0))
                                                                    : paratrain::Batch(x, y)};
  CHECK_THROWS_WITH_AS(s.step(std::span<const paratrain::Batch>(empty_second), loss),
                       doctest::Contains("has an empty micro-batch"), paratrain::error);
  // Replica 1 joins.
  if (s.replica() == 1)
    CHECK_THROWS_WITH_AS(s.join(), doctest::Contains("was given from 0 to 2 micro-batches"), paratrain::error);
  else
    CHECK_THROWS_WITH_AS(s.step(std::span<const paratrain::Batch>(two), loss),
                         doctest::Contains("was given from 0 to 2 micro-batches"), paratrain::error);
  // And then a good step.
  CHECK(s.step(std::span<const paratrain::Batch>(two), loss).global_samples > 0);
}

TEST_CASE("expert parallelism: the parameters and ZeRO-1 state per rank are plan::per_rank's at expert degree ep, "
          "ZeRO's state 1/world of the model's: the experts sharded over their replicas, the dense over every rank") {
  using namespace experts_test;
  const int world = comm::Mpi().size();
  // The model's parameters counted by hand: the dense ones (in, the router, out) and the
  // experts (12 of d -> hidden -> d with biases).
  const double dense = (model * model + model) * 2 + model * 12,
               experts = 12 * (model * hidden + hidden + hidden * model + model);
  for (const int ep : paratrain_test::group_degrees(world)) {
    CAPTURE(ep);
    paratrain::DataParallel<ExpertNet, comm::Mpi, paratrain::Sharded<torch::optim::Adam, paratrain::zero::stage1>> s(
        [] { return ExpertNet(moe::Options{}); }, comm::Mpi(), torch::optim::AdamOptions(1e-3), {.expert_parallel = ep});
    const auto planned = paratrain::plan::per_rank(
        {.parameters = dense + experts, .optimizer_bytes = 8, .ranks = world / ep, .expert = ep, .expert_parameters = experts},
        paratrain::plan::stage::stage1);
    const auto [x, y] = samples_of(s.data_shard().index, 0);  // a step: Adam's state exists after one
    s.step(paratrain::Batch(x, y), [](const torch::Tensor& out, const torch::Tensor& t) { return torch::mse_loss(out, t); });
    const auto held = s.model_state_bytes();
    CHECK(static_cast<double>(held.parameters) == planned.parameters);
    CHECK(static_cast<double>(held.parameters) == 4 * (dense + experts / ep));
    // ZeRO-1's optimizer state (Adam: 8 bytes a parameter): the experts' over the world / ep
    // ranks that hold them, the dense parameters' over the whole world, so 1/world of the
    // model's either way, within the padding of one bucket a rank.
    CHECK(static_cast<double>(held.optimizer_state) >= planned.optimizer_state);
    CHECK(static_cast<double>(held.optimizer_state) <= planned.optimizer_state + 8.0 * world);
    CHECK(planned.optimizer_state == doctest::Approx(8 * (dense + experts) / world));
    // ZeRO-2 keeps the gradients' shards alike: 4 bytes a parameter over the same ranks (a
    // bucket's padding under one element a rank), and SGD's momentum (4 bytes) for the real
    // elements of the shards (a bucket's last shard short by its padding, under world).
    paratrain::DataParallel<ExpertNet, comm::Mpi, paratrain::Sharded<torch::optim::SGD, paratrain::zero::stage2>> s2(
        [] { return ExpertNet(moe::Options{}); }, comm::Mpi(), torch::optim::SGDOptions(0.1).momentum(0.9),
        {.expert_parallel = ep});
    s2.step(paratrain::Batch(x, y), [](const torch::Tensor& out, const torch::Tensor& t) { return torch::mse_loss(out, t); });
    const auto held2 = s2.model_state_bytes();
    const double buckets = static_cast<double>(s2.bucket_count());
    CHECK(static_cast<double>(held2.gradients) >= 4 * (dense + experts) / world);
    CHECK(static_cast<double>(held2.gradients) <= 4 * (dense + experts) / world + 4 * buckets);
    CHECK(static_cast<double>(held2.optimizer_state) <= 4 * (dense + experts) / world + 4 * buckets);
    CHECK(static_cast<double>(held2.optimizer_state) >= 4 * (dense + experts) / world - 4 * buckets * world);
  }
}
