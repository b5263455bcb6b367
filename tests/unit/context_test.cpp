// Ring and all-to-all attention over a context group against attention over the whole sequence
// on one device (cp::attention), and that against the formula written out: outputs and the
// gradients of q, k and v, at every context degree the world allows (and 2 beside it at 4
// ranks), causal and not, with and without padded keys, in both layouts, the ring with and
// without overlap; the ring's bytes against its count; the layouts against their definition.
// Then a model whose attention runs over the strategy's context group, trained by
// DataParallel over data x context under DDP and ZeRO 1-3, against the same model trained on
// one device on the whole sequences (SGD with momentum, different per-replica batches).
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "paratrain/checkpoint/checkpointer.hpp"
#include "paratrain/checkpoint/load.hpp"
#include "paratrain/comm/mesh.hpp"
#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/pipeline/pipeline.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "paratrain/strategy/unit.hpp"
#include "paratrain/tensor_parallel/column_parallel_linear.hpp"
#include "paratrain/tensor_parallel/context.hpp"
#include "paratrain/tensor_parallel/embeddings.hpp"
#include "paratrain/tensor_parallel/row_parallel_linear.hpp"
#include "paratrain/tensor_parallel/sharding.hpp"
#include "paratrain/context/layout.hpp"
#include "paratrain/context/ring_attention.hpp"
#include "paratrain/core/error.hpp"
#include "support/doctest.hpp"
#include "support/gpt_reference.hpp"
#include "support/group_degrees.hpp"
#include "support/shared_dir.hpp"

namespace context_test {

namespace comm = paratrain::comm;
namespace cp = paratrain::cp;
namespace tp = paratrain::tp;

constexpr std::int64_t batch = 2, positions = 24, heads = 12, width = 4;

torch::Tensor drawn(std::uint64_t seed, std::int64_t h = heads) {
  auto gen = at::detail::createCPUGenerator(seed);
  return at::randn({batch, positions, h, width}, gen);
}

// The positions rank r of p holds, as Note [Sequence layouts] defines them: contiguous, the
// r-th of p equal runs; zigzag, runs r and 2p-1-r of 2p.
torch::Tensor held(int r, int p, cp::Layout layout) {
  std::vector<std::int64_t> at;
  const auto run = [&](std::int64_t i, std::int64_t n) {
    for (std::int64_t j = 0; j < n; ++j) at.push_back(i * n + j);
  };
  if (layout == cp::Layout::contiguous) {
    run(r, positions / p);
  } else {
    run(r, positions / (2 * p));
    run(2 * p - 1 - r, positions / (2 * p));
  }
  return torch::tensor(at, torch::kLong);
}

// The formula, one query at a time: softmax over the keys it may see of q·k / sqrt(D), times v.
torch::Tensor by_hand(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool causal,
                      const torch::Tensor& padded) {
  torch::NoGradGuard no_grad;
  auto out = torch::zeros_like(q);
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t h = 0; h < q.size(2); ++h)
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

struct Case {
  bool causal = false;
  bool padding = false;
  std::int64_t heads = context_test::heads;
};

// Every algorithm and layout (and the ring with and without overlap) at `degree`, against the
// whole sequence's attention on one device.
void check(int degree, const Case& c) {
  paratrain::Mesh<comm::Mpi> mesh(comm::Mpi(), {.context = degree});
  const tp::Group g(mesh, paratrain::Dim::context);
  cp::AttentionOptions o{.causal = c.causal};
  if (c.padding) {  // the last 3 keys of the first sequence and the last 5 of the second are padding
    o.key_padding_mask = torch::zeros({batch, positions}, torch::kBool);
    o.key_padding_mask[0].narrow(0, positions - 3, 3).fill_(true);
    o.key_padding_mask[1].narrow(0, positions - 5, 5).fill_(true);
  }
  const auto q = drawn(1, c.heads).requires_grad_(), k = drawn(2, c.heads).requires_grad_(),
             v = drawn(3, c.heads).requires_grad_();
  const auto weights = drawn(4, c.heads);
  const auto whole = cp::attention(q, k, v, o);
  (whole * weights).sum().backward();
  CHECK(close(whole, by_hand(q, k, v, c.causal, o.key_padding_mask)));

  for (const auto algorithm : {cp::Algorithm::ring, cp::Algorithm::all_to_all})
    for (const auto layout : {cp::Layout::contiguous, cp::Layout::zigzag})
      for (const bool overlap : {true, false}) {
        if (algorithm == cp::Algorithm::all_to_all && (!overlap || c.heads % degree != 0)) continue;
        CAPTURE(static_cast<int>(algorithm));
        CAPTURE(static_cast<int>(layout));
        CAPTURE(overlap);
        o.algorithm = algorithm;
        o.layout = layout;
        o.overlap = overlap;
        // Without overlap, the ring's keys one at a time (tiles of 4 bytes a head and sequence):
        // tiles merged as blocks are, the causal mask seen tile by tile.
        o.tile_bytes = overlap ? cp::AttentionOptions{}.tile_bytes : 4 * batch * c.heads;
        const auto at = held(g.rank(), g.size(), layout);
        const auto mine = [&](const torch::Tensor& t) { return t.detach().index_select(1, at).requires_grad_(); };
        const auto lq = mine(q), lk = mine(k), lv = mine(v);
        CHECK(torch::equal(cp::shard(q, 1, g, layout), lq));
        g.reset_traffic();
        const auto out = cp::attention(lq, lk, lv, g, o);
        // This rank's positions of the loss; the others' arrive through the exchanges' backward.
        (out * weights.index_select(1, at)).sum().backward();
        CHECK(close(out, whole.detach().index_select(1, at)));
        CHECK(close(lq.grad(), q.grad().index_select(1, at)));
        CHECK(close(lk.grad(), k.grad().index_select(1, at)));
        CHECK(close(lv.grad(), v.grad().index_select(1, at)));
        CHECK(close(cp::unshard(out, 1, g, layout), whole.detach()));
        if (algorithm == cp::Algorithm::ring) {
          // Note [Ring attention]: keys and values 2(cp-1) blocks forward; 2(cp-1) + 2cp backward.
          const std::int64_t block = lk.numel() * 4, p = g.size();
          CHECK(g.traffic().shift_bytes == (p == 1 ? 0 : (2 * (p - 1) + 2 * (p - 1) + 2 * p) * block));
        }
      }
}

}  // namespace context_test

TEST_CASE("cp::ring_attention and cp::all_to_all_attention over a context group equal attention over the whole "
          "sequence, outputs and gradients, causal and padded, in both layouts") {
  using namespace context_test;
  const int world = comm::Mpi().size();
  for (const int degree : paratrain_test::group_degrees(world))
    for (const bool causal : {false, true})
      for (const bool padding : {false, true}) {
        CAPTURE(degree);
        CAPTURE(causal);
        CAPTURE(padding);
        check(degree, {.causal = causal, .padding = padding});
      }
}

TEST_CASE("cp::ring_attention takes a head count its group does not divide") {
  using namespace context_test;
  for (const int degree : paratrain_test::group_degrees(comm::Mpi().size())) {
    CAPTURE(degree);
    check(degree, {.causal = true, .padding = true, .heads = 5});
  }
}

TEST_CASE("cp::chunks cuts as Note [Sequence layouts] says, and refuses a sequence it cannot cut") {
  using namespace context_test;
  for (const int p : {1, 2, 3, 4})
    for (const auto layout : {cp::Layout::contiguous, cp::Layout::zigzag})
      for (int r = 0; r < p; ++r) CHECK(torch::equal(cp::positions(positions, r, p, layout), held(r, p, layout)));
  CHECK_THROWS_WITH_AS((void)cp::chunks(12, 0, 4, cp::Layout::zigzag), doctest::Contains("pad it to a multiple of 8"),
                       paratrain::error);
  CHECK_THROWS_WITH_AS((void)cp::chunks(10, 1, 4, cp::Layout::contiguous),
                       doctest::Contains("pad it to a multiple of 4"), paratrain::error);
}

namespace context_test {

// One attention layer and a residual: the whole sequences in, this rank's positions out.
// Built inside a strategy, its attention runs over the strategy's context group; `whole`,
// attention over the whole sequence on one device (the reference). Its linears are ZeRO-3's
// units.
constexpr std::int64_t features = 6, layer_heads = 4, head_width = 3, sequence = 24;

struct AttentionNetImpl : torch::nn::Module {
  // `cut`: whether the input is whole sequences, cut here; a pipeline's second stage takes
  // the first's positions.
  AttentionNetImpl(cp::AttentionOptions options, bool whole, bool cut = true)
      : group(tp::context_group()), o(std::move(options)), whole(whole), cut(cut) {
    qkv = register_module("qkv", paratrain::Unit<torch::nn::Linear>(features, 3 * layer_heads * head_width));
    proj = register_module("proj", paratrain::Unit<torch::nn::Linear>(layer_heads * head_width, features));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto mine = cut ? cp::shard(x, 1, group, o.layout) : x;
    const auto b = mine.size(0), s = mine.size(1);
    const auto t = qkv(mine).view({b, s, 3, layer_heads, head_width});
    const auto q = t.select(2, 0), k = t.select(2, 1), v = t.select(2, 2);
    const auto a = whole ? cp::attention(q, k, v, o) : cp::attention(q, k, v, group, o);
    return proj(a.reshape({b, s, layer_heads * head_width})) + mine;
  }
  tp::Group group;
  cp::AttentionOptions o;
  bool whole, cut;
  paratrain::Unit<torch::nn::Linear> qkv{nullptr}, proj{nullptr};
};
TORCH_MODULE(AttentionNet);

// The same with its heads cut over the tensor group too: q, k and v column-parallel (each
// rank's heads), the projection row-parallel (Megatron's attention), attention over the
// context group on this rank's heads.
struct TensorAttentionNetImpl : torch::nn::Module {
  TensorAttentionNetImpl(cp::AttentionOptions options, bool whole)
      : group(tp::context_group()), o(std::move(options)), whole(whole) {
    const auto column = [&](const char* name) {
      return register_module(name, paratrain::Unit<tp::ColumnParallelLinear>(features, layer_heads * head_width));
    };
    q = column("q"), k = column("k"), v = column("v");
    proj = register_module("proj", paratrain::Unit<tp::RowParallelLinear>(layer_heads * head_width, features));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto mine = cp::shard(x, 1, group, o.layout);
    const auto b = mine.size(0), s = mine.size(1), heads = layer_heads / q->slice_group().size();
    const auto qs = q(mine).view({b, s, heads, head_width}), ks = k(mine).view({b, s, heads, head_width}),
               vs = v(mine).view({b, s, heads, head_width});
    const auto a = whole ? cp::attention(qs, ks, vs, o) : cp::attention(qs, ks, vs, group, o);
    return proj(a.reshape({b, s, heads * head_width})) + mine;
  }
  tp::Group group;
  cp::AttentionOptions o;
  bool whole;
  paratrain::Unit<tp::ColumnParallelLinear> q{nullptr}, k{nullptr}, v{nullptr};
  paratrain::Unit<tp::RowParallelLinear> proj{nullptr};
};
TORCH_MODULE(TensorAttentionNet);

// The loss on this rank's positions: the targets cut over `group` as the model cut the inputs.
auto loss_on_positions(const tp::Group& group, cp::Layout layout) {
  return [group, layout](const torch::Tensor& out, const torch::Tensor& target) {
    return torch::mse_loss(out, cp::shard(target, 1, group, layout));
  };
}

// Trains Update's strategy at context degree `degree` and tensor degree `tensor` (the data
// ranks what the world leaves, replica d given 3 - d % 2 sequences a step) and the reference
// on all replicas' sequences; returns the worst relative difference of the parameters (this
// rank's slices of the tensor-parallel ones) after 3 steps.
template <class Update, class Net = AttentionNet>
double train_both(int degree, const cp::AttentionOptions& o, int tensor = 1) {
  const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
  torch::manual_seed(7);
  auto ref = [&] {
    const tp::Construction one_rank(tp::Context{});
    return Net(o, /*whole=*/true);
  }();
  torch::optim::SGD ref_opt(ref->parameters(), sgd);
  torch::manual_seed(7);
  paratrain::DataParallel<Net, comm::Mpi, Update> s([&] { return Net(o, false); }, comm::Mpi(), sgd,
                                                    {.tensor_parallel = tensor, .context_parallel = degree});
  REQUIRE(s.context_group().size() == degree);
  REQUIRE(s.tensor_group().size() == tensor);
  REQUIRE(s.model()->group.size() == degree);
  const auto data = s.data_shard();
  std::int64_t total = 0, first = 0;
  const auto batch_of = [](int d) { return std::int64_t{3} - d % 2; };
  for (int d = 0; d < data.count; ++d) total += batch_of(d), first += d < data.index ? batch_of(d) : 0;
  const auto loss = loss_on_positions(s.context_group(), o.layout);
  for (int step = 0; step < 3; ++step) {
    auto gen = at::detail::createCPUGenerator(100 + step);
    const auto x = at::randn({total, sequence, features}, gen), y = at::randn({total, sequence, features}, gen);
    ref_opt.zero_grad();
    torch::mse_loss(ref(x), y).backward();
    ref_opt.step();
    const auto mine = batch_of(data.index);
    const auto r = s.step(paratrain::Batch(x.narrow(0, first, mine), y.narrow(0, first, mine)), loss);
    CHECK(r.global_samples == static_cast<double>(total));
  }
  // The reference's parameters, each as the slice this rank holds of it.
  const auto want = ref->named_parameters();
  const auto slices = paratrain_test::gpt::as_held(*s.model(), [&](const std::string& n) { return want[n]; });
  return paratrain_test::gpt::max_relative_difference(s.full_parameters(), slices);
}

// Two attention layers as a pipeline of two stages on K pipeline ranks (K = 1: one rank
// runs both, interleaved), their sequences cut over context groups of `degree`, the stages
// replicated over what the world leaves (replica r given 2 micro-batches of 2 + r % 2
// sequences a step); the reference, the two layers on one device over every replica's
// sequences. Returns the worst relative difference of this rank's stages' parameters after
// 3 steps.
template <class Update>
double pipeline_both(int degree, int K, const cp::AttentionOptions& o) {
  const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
  auto [ref0, ref1] = [&] {
    const tp::Construction one_rank(tp::Context{});
    torch::manual_seed(7);
    auto first = AttentionNet(o, /*whole=*/true);
    torch::manual_seed(8);
    return std::pair(first, AttentionNet(o, /*whole=*/true, /*cut=*/false));
  }();
  auto ref_params = ref0->parameters();
  for (const auto& p : ref1->parameters()) ref_params.push_back(p);
  torch::optim::SGD ref_opt(ref_params, sgd);
  using P = paratrain::Pipeline<AttentionNet, AttentionNet>;
  paratrain::DataParallel<P, comm::Mpi, Update> s(
      P([&] { torch::manual_seed(7); return AttentionNet(o, false); },
        [&] { torch::manual_seed(8); return AttentionNet(o, false, /*cut=*/false); }),
      comm::Mpi(), sgd,
      {.schedule = K == 1 ? paratrain::pipeline::Kind::interleaved_1f1b : paratrain::pipeline::Kind::one_f_one_b,
       .virtual_stages = 2 / K,
       .data_parallel = {.context_parallel = degree}});
  REQUIRE(s.pipeline_size() == K);
  REQUIRE(s.context_group().size() == degree);
  const auto per = [](int r) { return std::int64_t{2} + r % 2; };
  std::int64_t total = 0, first = 0;
  for (int r = 0; r < s.replicas(); ++r) total += 2 * per(r), first += r < s.replica() ? 2 * per(r) : 0;
  const auto loss = loss_on_positions(s.context_group(), o.layout);
  for (int step = 0; step < 3; ++step) {
    auto gen = at::detail::createCPUGenerator(200 + step);
    const auto x = at::randn({total, sequence, features}, gen), y = at::randn({total, sequence, features}, gen);
    ref_opt.zero_grad();
    torch::mse_loss(ref1(ref0(x)), y).backward();
    ref_opt.step();
    const auto n = per(s.replica());
    const std::vector<paratrain::Batch> mine{paratrain::Batch(x.narrow(0, first, n), y.narrow(0, first, n)),
                                             paratrain::Batch(x.narrow(0, first + n, n), y.narrow(0, first + n, n))};
    const auto r = s.step(std::span<const paratrain::Batch>(mine), loss);
    CHECK(r.global_samples == static_cast<double>(total));
  }
  return paratrain_test::gpt::stages_difference(s, ref0, ref1);
}

}  // namespace context_test

TEST_CASE("a pipeline over data x context equals the single-device model: ring and all-to-all attention, on one "
          "pipeline rank and across two, DDP and ZeRO 1 and 3") {
  using namespace context_test;
  using SGD = torch::optim::SGD;
  const int world = comm::Mpi().size();
  const cp::AttentionOptions ring{.causal = true, .layout = cp::Layout::zigzag};
  const cp::AttentionOptions a2a{.causal = true, .algorithm = cp::Algorithm::all_to_all};
  // The whole world one context group, both stages on each rank.
  CHECK(pipeline_both<SGD>(world, 1, ring) <= 1e-5);
  if (layer_heads % world == 0) CHECK(pipeline_both<paratrain::Sharded<SGD, paratrain::zero::stage1>>(world, 1, a2a) <= 1e-5);
  if (world == 4) {
    // Context 2 x pipeline 2: activations cross ranks; context 2 x data 2 on one pipeline rank.
    CHECK(pipeline_both<SGD>(2, 2, ring) <= 1e-5);
    CHECK(pipeline_both<paratrain::Sharded<SGD, paratrain::zero::stage3>>(2, 2, a2a) <= 1e-5);
    CHECK(pipeline_both<paratrain::Sharded<SGD, paratrain::zero::stage1>>(2, 1, ring) <= 1e-5);
  }
}

TEST_CASE("DataParallel over data x context equals the single-device model, under DDP and ZeRO 1-3, ring and "
          "all-to-all attention") {
  using namespace context_test;
  using SGD = torch::optim::SGD;
  const int world = comm::Mpi().size();
  for (const int degree : paratrain_test::group_degrees(world)) {
    CAPTURE(degree);
    const cp::AttentionOptions ring{.causal = true, .layout = cp::Layout::zigzag};
    CHECK(train_both<SGD>(degree, ring) <= 1e-5);
    CHECK(train_both<paratrain::Sharded<SGD, paratrain::zero::stage1>>(degree, ring) <= 1e-5);
    CHECK(train_both<paratrain::Sharded<SGD, paratrain::zero::stage3>>(degree, ring) <= 1e-5);
    if (layer_heads % degree == 0) {
      const cp::AttentionOptions a2a{.causal = true, .algorithm = cp::Algorithm::all_to_all};
      CHECK(train_both<paratrain::Sharded<SGD, paratrain::zero::stage2>>(degree, a2a) <= 1e-5);
    }
  }
}

TEST_CASE("context x tensor parallelism (2 x 2) equals the single-device model, ring and all-to-all, DDP and ZeRO-3") {
  using namespace context_test;
  using SGD = torch::optim::SGD;
  if (comm::Mpi().size() != 4) return;
  const cp::AttentionOptions ring{.causal = true, .layout = cp::Layout::zigzag};
  const cp::AttentionOptions a2a{.causal = true, .algorithm = cp::Algorithm::all_to_all};
  CHECK(train_both<SGD, TensorAttentionNet>(2, ring, 2) <= 1e-5);
  CHECK(train_both<paratrain::Sharded<SGD, paratrain::zero::stage3>, TensorAttentionNet>(2, a2a, 2) <= 1e-5);
}

TEST_CASE("context-parallel attention refuses heads its group cannot share, a mask of the wrong shape and a sequence "
          "its layout cannot cut, on every rank") {
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
  CHECK_THROWS_WITH_AS((void)cp::ring_attention(y, y, y, g, {.key_padding_mask = torch::zeros({1, 3}, torch::kBool)}),
                       doctest::Contains("key_padding_mask must be"), paratrain::error);
  const auto one = torch::zeros({1, 1, 2, 4});  // g.size() positions in all: zigzag needs 2 g.size()
  CHECK_THROWS_WITH_AS((void)cp::ring_attention(one, one, one, g, {.layout = cp::Layout::zigzag}),
                       doctest::Contains("cannot be cut"), paratrain::error);
}

TEST_CASE("DataParallel and a pipeline refuse, on every rank, a context degree the world cannot take; DataParallel "
          "deterministic mode over a context group") {
  using namespace context_test;
  using Strategy = paratrain::DataParallel<AttentionNet, comm::Mpi, torch::optim::SGD>;
  const int world = comm::Mpi().size();
  const auto build = [] { return AttentionNet(cp::AttentionOptions{}, false); };
  CHECK_THROWS_WITH_AS((void)Strategy(build, comm::Mpi(), torch::optim::SGDOptions(0.1), {.context_parallel = world + 1}),
                       doctest::Contains("the context degree must be at least 1 and divide them"), paratrain::error);
  if (world > 1)
    CHECK_THROWS_WITH_AS((void)Strategy(build, comm::Mpi(), torch::optim::SGDOptions(0.1),
                                        {.deterministic = {.shards = 12}, .context_parallel = world}),
                         doctest::Contains("deterministic mode does not cut sequences over a context group"),
                         paratrain::error);
  // Both stages on each rank: the pipeline's one rank times the context degree must divide the world.
  using P = paratrain::Pipeline<AttentionNet, AttentionNet>;
  using Piped = paratrain::DataParallel<P, comm::Mpi, torch::optim::SGD>;
  const auto refusal = "their sequences over context groups of " + std::to_string(world + 1) +
                       " (data_parallel.context_parallel), runs on a multiple of " + std::to_string(world + 1) +
                       " ranks; this run has " + std::to_string(world);
  CHECK_THROWS_WITH_AS((void)Piped(P(build, build), comm::Mpi(), torch::optim::SGDOptions(0.1),
                                   {.schedule = paratrain::pipeline::Kind::interleaved_1f1b, .virtual_stages = 2,
                                    .data_parallel = {.context_parallel = world + 1}}),
                       doctest::Contains(refusal.c_str()), paratrain::error);
}

namespace context_test {

// Step `step`'s global batch of `global` sequences: inputs and targets, the whole sequences.
std::pair<torch::Tensor, torch::Tensor> batch_of_step(int step, std::int64_t global) {
  auto gen = at::detail::createCPUGenerator(200 + step);
  auto x = at::randn({global, sequence, features}, gen);
  return {x, at::randn({global, sequence, features}, gen)};
}

// Steps [first, last) at context degree `degree` under Update, Adam, loading `from` (unless
// empty) and saving to `to` (unless empty): the parameters after.
template <class Update>
std::vector<torch::Tensor> leg(int degree, const std::filesystem::path& from, const std::filesystem::path& to,
                               int first, int last) {
  const cp::AttentionOptions o{.causal = true, .layout = cp::Layout::zigzag};
  torch::manual_seed(11);
  paratrain::DataParallel<AttentionNet, comm::Mpi, Update> s([&] { return AttentionNet(o, false); }, comm::Mpi(),
                                                             torch::optim::AdamOptions(0.01).eps(1e-3),
                                                             {.context_parallel = degree});
  if (!from.empty()) paratrain::checkpoint::load(s, paratrain::checkpoint::latest(from).value());
  const auto data = s.data_shard();
  const std::int64_t global = 4;
  const auto loss = loss_on_positions(s.context_group(), o.layout);
  for (int step = first; step < last; ++step) {
    const auto [x, y] = batch_of_step(step, global);
    const auto begin = global * data.index / data.count, end = global * (data.index + 1) / data.count;
    s.step(paratrain::Batch(x.narrow(0, begin, end - begin), y.narrow(0, begin, end - begin)), loss);
  }
  if (!to.empty()) paratrain::checkpoint::save(s, to, last);
  return s.full_parameters();
}

}  // namespace context_test

TEST_CASE("checkpoints move between context degrees: cp 2 x ZeRO-3 -> DDP without context -> cp = world x ZeRO-1 with "
          "Adam, against the uninterrupted single-device run") {
  using namespace context_test;
  comm::Mpi world;
  if (world.size() < 2) return;
  const int first_degree = world.size() % 2 == 0 ? 2 : world.size();
  const cp::AttentionOptions o{.causal = true, .layout = cp::Layout::zigzag};
  torch::manual_seed(11);
  AttentionNet ref(o, /*whole=*/true);
  torch::optim::Adam opt(ref->parameters(), torch::optim::AdamOptions(0.01).eps(1e-3));
  for (int step = 0; step < 6; ++step) {
    const auto [x, y] = batch_of_step(step, 4);
    opt.zero_grad();
    torch::mse_loss(ref(x), y).backward();
    opt.step();
  }
  const auto a = paratrain_test::shared_dir(world, "cp_ckpt_a"), b = paratrain_test::shared_dir(world, "cp_ckpt_b");
  leg<paratrain::Sharded<torch::optim::Adam, paratrain::zero::stage3>>(first_degree, {}, a, 0, 2);
  leg<torch::optim::Adam>(1, a, b, 2, 4);
  const auto got = leg<paratrain::Sharded<torch::optim::Adam, paratrain::zero::stage1>>(world.size(), b, {}, 4, 6);
  CHECK(paratrain_test::gpt::max_relative_difference(got, ref->parameters()) <= 1e-5);
  paratrain_test::remove_shared_dir(world, a);
  paratrain_test::remove_shared_dir(world, b);
}

TEST_CASE("DataParallel under context parallelism refuses, on every rank and before any forward, context ranks with "
          "different batches: another sample count in step and accumulate, a rank joining while the others step") {
  using namespace context_test;
  const int world = comm::Mpi().size();
  if (world == 1) return;
  const cp::AttentionOptions o{.causal = true};
  torch::manual_seed(3);
  paratrain::DataParallel<AttentionNet, comm::Mpi, torch::optim::SGD> s([&] { return AttentionNet(o, false); },
                                                                       comm::Mpi(), torch::optim::SGDOptions(0.1),
                                                                       {.context_parallel = world});
  const auto loss = loss_on_positions(s.context_group(), o.layout);
  const auto [x, y] = batch_of_step(0, 4);
  const auto n = s.rank() == 1 ? 3 : 4;  // rank 1 holds positions of other samples than its context group's
  const paratrain::Batch uneven(x.narrow(0, 0, n), y.narrow(0, 0, n)), whole(x, y);
  const auto refusal = doctest::Contains("the ranks of a context group have");
  CHECK_THROWS_WITH_AS(s.step(uneven, loss), refusal, paratrain::error);
  CHECK_THROWS_WITH_AS((void)s.accumulate(uneven, loss), refusal, paratrain::error);
  if (s.rank() == 1)
    CHECK_THROWS_WITH_AS(s.join(), refusal, paratrain::error);
  else
    CHECK_THROWS_WITH_AS(s.step(whole, loss), refusal, paratrain::error);
  // As many micro-batches and samples, of other sizes: rank 1's [3, 1] against [2, 2].
  const std::vector<paratrain::Batch> split = s.rank() == 1
      ? std::vector{paratrain::Batch(x.narrow(0, 0, 3), y.narrow(0, 0, 3)), paratrain::Batch(x.narrow(0, 3, 1), y.narrow(0, 3, 1))}
      : std::vector{paratrain::Batch(x.narrow(0, 0, 2), y.narrow(0, 0, 2)), paratrain::Batch(x.narrow(0, 2, 2), y.narrow(0, 2, 2))};
  CHECK_THROWS_WITH_AS(s.step(std::span<const paratrain::Batch>(split), loss), doctest::Contains("as many, of different sizes"),
                       paratrain::error);
  // The same samples, rank 1's sequences half as long again (36 positions, which every
  // degree divides): cut alike, the shards would differ in attention's exchanges.
  const auto longer = [&](const torch::Tensor& t) { return torch::cat({t, t.narrow(1, 0, sequence / 2)}, 1); };
  const paratrain::Batch stretched = s.rank() == 1 ? paratrain::Batch(longer(x), longer(y)) : whole;
  CHECK_THROWS_WITH_AS(s.step(stretched, loss), doctest::Contains("as many, of different sizes or shapes"),
                       paratrain::error);
  // And then a good step, accumulated first.
  CHECK(s.accumulate(whole, loss) > 0);
  CHECK(s.step(whole, loss).global_samples > 0);
}

TEST_CASE("a pipeline under context parallelism refuses, on every rank and before any forward, a replica whose "
          "ranks were given sequences of different lengths") {
  using namespace context_test;
  const int world = comm::Mpi().size();
  if (world == 1) return;
  using P = paratrain::Pipeline<AttentionNet, AttentionNet>;
  const cp::AttentionOptions o{.causal = true};
  paratrain::DataParallel<P, comm::Mpi, torch::optim::SGD> s(
      P([&] { return AttentionNet(o, false); }, [&] { return AttentionNet(o, false, /*cut=*/false); }), comm::Mpi(),
      torch::optim::SGDOptions(0.1),
      {.schedule = paratrain::pipeline::Kind::interleaved_1f1b, .virtual_stages = 2,
       .data_parallel = {.context_parallel = world}});
  const auto loss = loss_on_positions(s.context_group(), o.layout);
  const auto [x, y] = batch_of_step(0, 4);
  // Rank 1's sequences half as long again (36 positions, which every degree divides).
  const auto longer = [&](const torch::Tensor& t) { return torch::cat({t, t.narrow(1, 0, sequence / 2)}, 1); };
  const std::vector<paratrain::Batch> mine{s.rank() == 1 ? paratrain::Batch(longer(x), longer(y))
                                                         : paratrain::Batch(x, y)};
  CHECK_THROWS_WITH_AS(s.step(std::span<const paratrain::Batch>(mine), loss),
                       doctest::Contains("were given different micro-batches (as many, of different sizes or shapes)"),
                       paratrain::error);
  const std::vector<paratrain::Batch> same{paratrain::Batch(x, y)};
  CHECK(s.step(std::span<const paratrain::Batch>(same), loss).global_samples == 4.0);
}

TEST_CASE("context-parallel attention refuses a padding mask that is not bool on every rank; tp::Embeddings refuses, "
          "on every context rank alike, sequences longer than its table") {
  using namespace context_test;
  paratrain::Mesh<comm::Mpi> mesh(comm::Mpi(), {.context = comm::Mpi().size()});
  const tp::Group g(mesh, paratrain::Dim::context);
  const auto y = torch::zeros({1, 2, 2 * g.size(), 4});
  const auto ones = torch::ones({1, 2 * g.size()}, torch::kLong);  // 0/1, as an integer
  CHECK_THROWS_WITH_AS((void)cp::all_to_all_attention(y, y, y, g, {.key_padding_mask = ones}),
                       doctest::Contains("key_padding_mask must be bool"), paratrain::error);
  CHECK_THROWS_WITH_AS((void)cp::ring_attention(y, y, y, g, {.key_padding_mask = ones}),
                       doctest::Contains("key_padding_mask must be bool"), paratrain::error);
  if (g.size() == 1) return;
  // 4 positions a rank, zigzag: rank 0 holds the first and the last chunk, so its own
  // positions reach past a table of 4 · cp - 1 while another rank's may not.
  const tp::Context context{.context = g};
  tp::Embeddings e(10, 4 * g.size() - 1, 8, 0.0, context);
  const auto positions = cp::shard(torch::arange(4 * g.size()), 0, g, cp::Layout::zigzag);
  const auto refusal = "sequences of " + std::to_string(4 * g.size()) + " positions (4 on each of";
  CHECK_THROWS_WITH_AS((void)e->at_positions(torch::zeros({1, 4}, torch::kLong), positions),
                       doctest::Contains(refusal.c_str()), paratrain::error);
}
