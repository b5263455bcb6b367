// All-to-all attention over a context group against attention over the whole sequence on one
// device (cp::attention), and that against the formula written out: outputs and the gradients
// of q, k and v, at every context degree the world allows (and 2 beside it at 4 ranks), causal
// and not, with and without padded keys.
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "paratrain/comm/mesh.hpp"
#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/context/all_to_all_attention.hpp"
#include "paratrain/core/error.hpp"
#include "support/doctest.hpp"
#include "support/group_degrees.hpp"

namespace context_test {

namespace comm = paratrain::comm;
namespace cp = paratrain::cp;
namespace tp = paratrain::tp;

constexpr std::int64_t batch = 2, positions = 12, heads = 12, width = 4;

torch::Tensor drawn(std::uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  return at::randn({batch, positions, heads, width}, gen);
}

// The formula, one query at a time: softmax over the keys it may see of q·k / sqrt(D), times v.
torch::Tensor by_hand(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool causal,
                      const torch::Tensor& padded) {
  torch::NoGradGuard no_grad;
  auto out = torch::zeros_like(q);
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t i = 0; i < positions; ++i) {
        std::vector<double> w(static_cast<std::size_t>(positions), 0.0);
        double top = -std::numeric_limits<double>::infinity(), sum = 0;
        for (std::int64_t j = 0; j < positions; ++j) {
          const bool seen = !(causal && j > i) && !(padded.defined() && padded[b][j].item<bool>());
          w[static_cast<std::size_t>(j)] = seen ? (q[b][i][h] * k[b][j][h]).sum().item<double>() / std::sqrt(double(width))
                                                : -std::numeric_limits<double>::infinity();
          top = std::max(top, w[static_cast<std::size_t>(j)]);
        }
        for (auto& x : w) sum += (x = std::exp(x - top));
        for (std::int64_t j = 0; j < positions; ++j) out[b][i][h] += v[b][j][h] * (w[static_cast<std::size_t>(j)] / sum);
      }
  return out;
}

bool close(const torch::Tensor& a, const torch::Tensor& b) { return torch::allclose(a, b, 1e-5, 1e-5); }

void check(int degree, bool causal, bool padding) {
  paratrain::Mesh<comm::Mpi> mesh(comm::Mpi(), {.context = degree});
  const tp::Group g(mesh, paratrain::Dim::context);
  const auto part = positions / g.size(), from = g.rank() * part;
  cp::AttentionOptions o{.causal = causal};
  if (padding) {  // the last 3 keys of the first sequence and the last 5 of the second are padding
    o.key_padding_mask = torch::zeros({batch, positions}, torch::kBool);
    o.key_padding_mask[0].narrow(0, positions - 3, 3).fill_(true);
    o.key_padding_mask[1].narrow(0, positions - 5, 5).fill_(true);
  }
  const auto q = drawn(1).requires_grad_(), k = drawn(2).requires_grad_(), v = drawn(3).requires_grad_();
  const auto weights = drawn(4);
  const auto whole = cp::attention(q, k, v, o);
  (whole * weights).sum().backward();
  CHECK(close(whole, by_hand(q, k, v, causal, o.key_padding_mask)));

  const auto mine = [&](const torch::Tensor& t) { return t.detach().narrow(1, from, part).clone().requires_grad_(); };
  const auto lq = mine(q), lk = mine(k), lv = mine(v);
  const auto out = cp::all_to_all_attention(lq, lk, lv, g, o);
  // This rank's positions of the loss; the others' arrive through the exchanges' backward.
  (out * weights.narrow(1, from, part)).sum().backward();
  CHECK(close(out, whole.detach().narrow(1, from, part)));
  CHECK(close(lq.grad(), q.grad().narrow(1, from, part)));
  CHECK(close(lk.grad(), k.grad().narrow(1, from, part)));
  CHECK(close(lv.grad(), v.grad().narrow(1, from, part)));
}

}  // namespace context_test

TEST_CASE("cp::all_to_all_attention over a context group equals attention over the whole sequence, outputs and "
          "gradients, causal and padded") {
  using namespace context_test;
  const int world = comm::Mpi().size();
  for (const int degree : paratrain_test::group_degrees(world))
    for (const bool causal : {false, true})
      for (const bool padding : {false, true}) {
        CAPTURE(degree);
        CAPTURE(causal);
        CAPTURE(padding);
        check(degree, causal, padding);
      }
}

TEST_CASE("cp::all_to_all_attention refuses heads its group cannot share and a mask of the wrong shape, on every rank") {
  using namespace context_test;
  paratrain::Mesh<comm::Mpi> mesh(comm::Mpi(), {.context = comm::Mpi().size()});
  const tp::Group g(mesh, paratrain::Dim::context);
  const auto x = torch::zeros({1, 2, g.size() + 1, 4});
  if (g.size() > 1)
    CHECK_THROWS_WITH_AS((void)cp::all_to_all_attention(x, x, x, g), doctest::Contains("cannot be shared equally"),
                         paratrain::error);
  const auto y = torch::zeros({1, 2, 2 * g.size(), 4});
  CHECK_THROWS_WITH_AS((void)cp::all_to_all_attention(y, y, y, g, {.key_padding_mask = torch::zeros({1, 3}, torch::kBool)}),
                       doctest::Contains("key_padding_mask must be"), paratrain::error);
}
