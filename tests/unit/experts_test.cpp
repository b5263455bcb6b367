// The mixture of experts over an expert group against the single-device layer (every expert,
// each rank's tokens one call of their own: Note [Experts over a group]), and that layer
// against the papers' definition written token by token (naive below): outputs, the tokens
// dropped, the auxiliary loss, the input's and every parameter's gradient, and three steps of
// SGD with momentum, at every expert degree the world allows, with top-1 and top-2 routing,
// dropless and with a capacity that drops, each rank with its own number of tokens.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "paratrain/comm/mesh.hpp"
#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/experts/mixture_of_experts.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "support/doctest.hpp"
#include "support/group_degrees.hpp"

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

struct MoeNetImpl : torch::nn::Module {
  explicit MoeNetImpl(tp::Group g) {
    layer = register_module("layer", moe::MixtureOfExperts(moe::Options{.model = 4, .hidden = 4, .experts = 12}, g));
  }
  torch::Tensor forward(torch::Tensor x) { return layer->forward(x); }
  moe::MixtureOfExperts layer{nullptr};
};
TORCH_MODULE(MoeNet);

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
}

TEST_CASE("DataParallel refuses, on every rank, a model whose experts are cut over an expert group (not trained yet)") {
  using namespace experts_test;
  const int world = comm::Mpi().size();
  paratrain::Mesh<comm::Mpi> mesh(comm::Mpi(), {.expert = world});
  const tp::Group g(mesh, paratrain::Dim::expert);
  using Ddp = paratrain::DataParallel<MoeNet, comm::Mpi, torch::optim::SGD>;
  if (world > 1) {
    CHECK_THROWS_WITH_AS(Ddp([&] { return MoeNet(g); }, comm::Mpi(), torch::optim::SGDOptions(0.1)),
                         doctest::Contains("does not train expert parallelism yet"), paratrain::error);
  }
  // Every expert on every rank is a plain model, which it trains.
  Ddp whole([] { return MoeNet(tp::Group()); }, comm::Mpi(), torch::optim::SGDOptions(0.1));
  CHECK(whole.world_size() == world);
}
