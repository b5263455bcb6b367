// Tensor and sequence parallelism (issue #38): a GPT-style model of paratrain::tp layers at
// tensor degree t against the same model written in plain LibTorch on one device, with SGD
// and momentum and dropout on; composed with data parallelism and ZeRO; and what is refused.
#include <torch/torch.h>

#include <cctype>
#include <cstdio>
#include <string>
#include <vector>

#include "paratrain/checkpoint/checkpointer.hpp"
#include "paratrain/checkpoint/load.hpp"
#include "paratrain/checkpoint/model_file.hpp"
#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/memory/counting_allocator.hpp"
#include "paratrain/pipeline/chain.hpp"
#include "paratrain/pipeline/pipeline.hpp"
#include "paratrain/plan/plan.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "paratrain/strategy/unit.hpp"
#include "paratrain/tensor_parallel/column_parallel_linear.hpp"
#include "paratrain/tensor_parallel/cross_entropy.hpp"
#include "paratrain/tensor_parallel/dropout.hpp"
#include "paratrain/tensor_parallel/embeddings.hpp"
#include "paratrain/tensor_parallel/layer_norm.hpp"
#include "paratrain/tensor_parallel/sharding.hpp"
#include "paratrain/tensor_parallel/transformer_block.hpp"
#include "support/doctest.hpp"
#include "support/gpt_reference.hpp"
#include "support/shared_dir.hpp"

// A namespace of its own: this file shares a translation unit with others (Note [Unity groups]).
namespace tensor_parallel_test {

namespace {

namespace comm = paratrain::comm;
namespace tp = paratrain::tp;

// The shared model and reference (support/gpt_reference.hpp), by name: declarations, so that
// they hide the other tests' helpers of the same names in this unity group.
using paratrain_test::gpt::Config;
using paratrain_test::gpt::Gpt;
using paratrain_test::gpt::max_relative_difference;
using paratrain_test::gpt::RefGpt;
using paratrain_test::gpt::reference_slices;
using paratrain_test::gpt::tokens_of_step;
using paratrain_test::gpt::train_reference;

struct Run {
  int tensor = 1;
  bool sequence_parallel = false;
  std::vector<std::int64_t> replica_batches{3};  // sequences per data replica
  double max_grad_norm = 0;
  int steps = 4;
  Config config{};
};

// Trains Update's strategy over the world as `run` says and the reference on the union of
// the replicas' sequences; returns the worst relative difference of the parameters.
template <class Update>
double train_both(const Run& run) {
  const auto& c = run.config;
  const std::int64_t length = c.positions;
  torch::manual_seed(7);
  RefGpt ref(c);
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::manual_seed(7);
  using Strategy = paratrain::DataParallel<Gpt, comm::Mpi, Update>;
  Strategy s([&] { return Gpt(c); }, comm::Mpi(), torch::optim::SGDOptions(0.05).momentum(0.9),
             {.max_grad_norm = run.max_grad_norm, .tensor_parallel = run.tensor,
              .sequence_parallel = run.sequence_parallel});
  REQUIRE(s.mesh().size(paratrain::Dim::tensor) == run.tensor);
  const auto data = s.data_shard();
  REQUIRE(static_cast<std::size_t>(data.count) == run.replica_batches.size());
  const tp::CrossEntropy loss{s.tensor_group()};
  std::int64_t total = 0, first = 0;
  for (int i = 0; i < data.count; ++i) {
    if (i < data.index) first += run.replica_batches[static_cast<std::size_t>(i)];
    total += run.replica_batches[static_cast<std::size_t>(i)];
  }
  for (int step = 0; step < run.steps; ++step) {
    const auto [ids, targets] = tokens_of_step(step, total, c, length);
    ref_opt.zero_grad();
    const auto logits = ref(ids);
    torch::nn::functional::cross_entropy(logits.reshape({-1, c.vocabulary}), targets.reshape({-1})).backward();
    if (run.max_grad_norm > 0) torch::nn::utils::clip_grad_norm_(ref->parameters(), run.max_grad_norm);
    ref_opt.step();
    const auto mine = run.replica_batches[static_cast<std::size_t>(data.index)];
    const auto r = s.step(paratrain::Batch(ids.narrow(0, first, mine), targets.narrow(0, first, mine)), loss);
    CHECK(r.global_samples == static_cast<double>(total));
  }
  return max_relative_difference(s.full_parameters(), reference_slices(ref, *s.model()));
}

TEST_CASE("tensor parallelism at degree = world size equals the single-device model (SGD with momentum, dropout on)") {
  const int world = comm::Mpi().size();
  for (const bool sp : {false, true}) {
    CAPTURE(sp);
    CHECK(train_both<torch::optim::SGD>({.tensor = world, .sequence_parallel = sp}) <= 1e-5);
  }
}

TEST_CASE("tensor parallelism clips by the whole model's norm: a sharded parameter counted once, a replicated one once") {
  const int world = comm::Mpi().size();
  CHECK(train_both<torch::optim::SGD>({.tensor = world, .sequence_parallel = true, .max_grad_norm = 0.5}) <= 1e-5);
}

TEST_CASE("tensor x data parallelism (2 x 2) with different per-replica batches, under DDP and ZeRO") {
  if (comm::Mpi().size() != 4) return;
  Run run{.tensor = 2, .replica_batches = {3, 2}, .config = {.dropout = 0.0}};
  CHECK(train_both<torch::optim::SGD>(run) <= 1e-5);
  run.sequence_parallel = true;
  run.max_grad_norm = 0.5;
  CHECK(train_both<paratrain::Sharded<torch::optim::SGD, paratrain::zero::stage1>>(run) <= 1e-5);
  CHECK(train_both<paratrain::Sharded<torch::optim::SGD, paratrain::zero::stage3>>(run) <= 1e-5);
}

// ---- the same model as two pipeline stages ------------------------------------------
struct FrontImpl : torch::nn::Module {
  explicit FrontImpl(const Config& c) {
    embeddings = register_module("embeddings", tp::Embeddings(c.vocabulary, c.positions, c.hidden, c.dropout));
    block0 = register_module("block0", tp::TransformerBlock(tp::TransformerBlockOptions(c.hidden, c.heads).ffn(c.ffn)));
  }
  torch::Tensor forward(torch::Tensor ids) { return block0(embeddings(ids)); }
  tp::Embeddings embeddings{nullptr};
  tp::TransformerBlock block0{nullptr};
};
TORCH_MODULE(Front);
struct BackImpl : torch::nn::Module {
  explicit BackImpl(const Config& c) {
    block1 = register_module("block1", tp::TransformerBlock(tp::TransformerBlockOptions(c.hidden, c.heads).ffn(c.ffn)));
    ln = register_module("ln", tp::LayerNorm(c.hidden));
    head = register_module("head",
                           tp::ColumnParallelLinear(tp::ColumnParallelLinearOptions(c.hidden, c.vocabulary).bias(false)));
  }
  torch::Tensor forward(torch::Tensor x) { return head(ln(block1(x))); }
  tp::TransformerBlock block1{nullptr};
  tp::LayerNorm ln{nullptr};
  tp::ColumnParallelLinear head{nullptr};
};
TORCH_MODULE(Back);

// Tensor-parallel stages in a pipeline of 2 ranks, replicated over what the world leaves:
// against the single-device model, 2 micro-batches of 2 sequences per replica per step.
template <class Update>
double pipeline_both(int tensor, bool sequence_parallel) {
  const Config c{.dropout = 0.0};
  torch::manual_seed(21);
  RefGpt ref(c, /*back_seed=*/22);
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  using P = paratrain::Pipeline<Front, Back>;
  using Strategy = paratrain::DataParallel<P, comm::Mpi, Update>;
  Strategy s(P([c] { torch::manual_seed(21); return Front(c); }, [c] { torch::manual_seed(22); return Back(c); }),
             comm::Mpi(), torch::optim::SGDOptions(0.05).momentum(0.9),
             {.data_parallel = {.tensor_parallel = tensor, .sequence_parallel = sequence_parallel}});
  REQUIRE(s.mesh().size(paratrain::Dim::tensor) == tensor);
  const tp::CrossEntropy loss{s.tensor_group()};
  const std::int64_t micro = 2, per_micro = 2, replicas = s.replicas();
  for (int step = 0; step < 3; ++step) {
    const auto [ids, targets] = tokens_of_step(step, replicas * micro * per_micro, c, c.positions);
    train_reference(ref, ref_opt, c, replicas * micro * per_micro, step, step + 1);
    std::vector<paratrain::Batch> mine;
    for (std::int64_t m = 0; m < micro; ++m) {
      const auto row = (s.replica() * micro + m) * per_micro;
      mine.emplace_back(ids.narrow(0, row, per_micro), targets.narrow(0, row, per_micro));
    }
    s.step(std::span<const paratrain::Batch>(mine), loss);
  }
  return max_relative_difference(s.full_parameters(), reference_slices(ref, *s.stages()));
}

TEST_CASE("tensor x pipeline (2 x 2) equals the single-device model, with and without sequence parallelism") {
  if (comm::Mpi().size() != 4) return;
  CHECK(pipeline_both<torch::optim::SGD>(2, false) <= 1e-5);
  CHECK(pipeline_both<torch::optim::SGD>(2, true) <= 1e-5);
}

TEST_CASE("data x pipeline x tensor (2 x 2 x 2) at 8 ranks equals the single-device model") {
  if (comm::Mpi().size() != 8) return;
  CHECK(pipeline_both<torch::optim::SGD>(2, true) <= 1e-5);
  CHECK(pipeline_both<paratrain::Sharded<torch::optim::SGD, paratrain::zero::stage1>>(2, false) <= 1e-5);
}

// One leg in the 3-D mesh (pipeline 2 x data 2 x tensor 2 at 8 ranks) of the test below:
// loads `from` (if any), trains steps [first, last) of 8 sequences each (the replicas take 2
// micro-batches of 2), saves to `to` (if any); returns the worst relative difference from `ref`.
double three_d_leg(const Config& c, RefGpt& ref, const std::filesystem::path& from, const std::filesystem::path& to,
                   int first, int last) {
  using P = paratrain::Pipeline<Front, Back>;
  paratrain::DataParallel<P, comm::Mpi, torch::optim::Adam> s(
      P([c] { torch::manual_seed(21); return Front(c); }, [c] { torch::manual_seed(22); return Back(c); }), comm::Mpi(),
      torch::optim::AdamOptions(0.01).eps(1e-3), {.data_parallel = {.tensor_parallel = 2}});
  REQUIRE(s.mesh().size(paratrain::Dim::pipeline) == 2);
  REQUIRE(s.replicas() == 2);
  if (!from.empty()) paratrain::checkpoint::load(s, paratrain::checkpoint::latest(from).value());
  const tp::CrossEntropy loss{s.tensor_group()};
  const std::int64_t micro = 2, per_micro = 2;
  for (int step = first; step < last; ++step) {
    const auto [ids, targets] = tokens_of_step(step, 8, c, c.positions);
    std::vector<paratrain::Batch> mine;
    for (std::int64_t m = 0; m < micro; ++m) {
      const auto row = (s.replica() * micro + m) * per_micro;
      mine.emplace_back(ids.narrow(0, row, per_micro), targets.narrow(0, row, per_micro));
    }
    s.step(std::span<const paratrain::Batch>(mine), loss);
  }
  if (!to.empty()) paratrain::checkpoint::save(s, to, last);
  return max_relative_difference(s.full_parameters(), reference_slices(ref, *s.stages()));
}

// A checkpoint of the 3-D mesh loads into plain DDP over the 8 ranks (the same stages as one
// Chain, whole tensors, a sequence per rank), whose checkpoint loads into the 3-D mesh again:
// Adam (eps 1e-3: see leg() below) against the uninterrupted single-device run on every
// step's 8 sequences.
TEST_CASE("data x pipeline x tensor checkpoints (2 x 2 x 2) reshard: 3-D -> DDP -> 3-D with Adam, against the "
          "uninterrupted single-device run") {
  comm::Mpi world;
  if (world.size() != 8) return;
  const Config c{.dropout = 0.0};
  torch::manual_seed(21);
  RefGpt ref(c, /*back_seed=*/22);
  torch::optim::Adam ref_opt(ref->parameters(), torch::optim::AdamOptions(0.01).eps(1e-3));
  train_reference(ref, ref_opt, c, 8, 0, 6);
  const auto a = paratrain_test::shared_dir(world, "tp_ckpt_3d_a"), b = paratrain_test::shared_dir(world, "tp_ckpt_3d_b");
  three_d_leg(c, ref, {}, a, 0, 2);
  {
    using Whole = paratrain::Chain<Front, Back>;
    paratrain::DataParallel<Whole, comm::Mpi, torch::optim::Adam> ddp(
        [c] { return Whole(Front(c), Back(c)); }, comm::Mpi(), torch::optim::AdamOptions(0.01).eps(1e-3));
    paratrain::checkpoint::load(ddp, paratrain::checkpoint::latest(a).value());
    const tp::CrossEntropy loss{ddp.tensor_group()};
    for (int step = 2; step < 4; ++step) {
      const auto [ids, targets] = tokens_of_step(step, 8, c, c.positions);
      ddp.step(paratrain::Batch(ids.narrow(0, world.rank(), 1), targets.narrow(0, world.rank(), 1)), loss);
    }
    paratrain::checkpoint::save(ddp, b, 4);
  }
  CHECK(three_d_leg(c, ref, b, {}, 4, 6) <= 1e-5);
  paratrain_test::remove_shared_dir(world, a);
  paratrain_test::remove_shared_dir(world, b);
}

// One leg of a run that is saved and resumed (Adam with eps 1e-3: attention's key bias has
// a zero gradient in exact arithmetic, which Adam's default eps would blow up from rounding
// noise into whole steps, on every side differently): trains `Update`'s strategy at tensor degree
// `tensor` (the data dimensions take the rest) from the checkpoint in `from` (if any) over
// steps [first, last) of the global batches (4 sequences each, dealt to the replicas as
// evenly as they go), then saves to `to`. Adam: a wrong resharding of its moments shows.
template <class Update>
std::vector<torch::Tensor> leg(int tensor, const std::filesystem::path& from, const std::filesystem::path& to,
                               int first, int last) {
  const Config c{.dropout = 0.0};
  torch::manual_seed(11);
  using Strategy = paratrain::DataParallel<Gpt, comm::Mpi, Update>;
  Strategy s([&] { return Gpt(c); }, comm::Mpi(), torch::optim::AdamOptions(0.01).eps(1e-3), {.tensor_parallel = tensor});
  if (!from.empty()) paratrain::checkpoint::load(s, paratrain::checkpoint::latest(from).value());
  const tp::CrossEntropy loss{s.tensor_group()};
  const auto data = s.data_shard();
  const std::int64_t global = 4;
  for (int step = first; step < last; ++step) {
    const auto [ids, targets] = tokens_of_step(step, global, c, c.positions);
    const auto begin = global * data.index / data.count, end = global * (data.index + 1) / data.count;
    s.step(paratrain::Batch(ids.narrow(0, begin, end - begin), targets.narrow(0, begin, end - begin)), loss);
  }
  if (!to.empty()) paratrain::checkpoint::save(s, to, last);
  return s.full_parameters();
}

TEST_CASE("tensor-parallel checkpoints reshard: t = 2 -> 1 -> world with Adam, and tensor x ZeRO-3 -> DDP -> tensor x "
          "ZeRO-1, against the uninterrupted single-device run") {
  comm::Mpi world;
  if (world.size() < 2) return;
  const int first_degree = world.size() % 2 == 0 ? 2 : world.size();
  // The reference: plain LibTorch, Adam, every global batch, no interruption.
  const Config c{.dropout = 0.0};
  torch::manual_seed(11);
  RefGpt ref(c);
  torch::optim::Adam opt(ref->parameters(), torch::optim::AdamOptions(0.01).eps(1e-3));
  train_reference(ref, opt, c, 4, 0, 6);
  const auto compare = [&](int tensor, const std::vector<torch::Tensor>& got) {
    // A strategy at this degree only to know which slice of each parameter this rank holds.
    using Strategy = paratrain::DataParallel<Gpt, comm::Mpi, torch::optim::SGD>;
    Strategy probe([&] { return Gpt(c); }, comm::Mpi(), torch::optim::SGDOptions(0.1), {.tensor_parallel = tensor});
    return max_relative_difference(got, reference_slices(ref, *probe.model()));
  };
  SUBCASE("DDP shapes") {
    const auto a = paratrain_test::shared_dir(world, "tp_ckpt_a"), b = paratrain_test::shared_dir(world, "tp_ckpt_b");
    leg<torch::optim::Adam>(first_degree, {}, a, 0, 2);
    leg<torch::optim::Adam>(1, a, b, 2, 4);
    CHECK(compare(world.size(), leg<torch::optim::Adam>(world.size(), b, {}, 4, 6)) <= 1e-5);
    paratrain_test::remove_shared_dir(world, a);
    paratrain_test::remove_shared_dir(world, b);
  }
  SUBCASE("ZeRO shapes") {
    if (world.size() != 4) return;
    const auto a = paratrain_test::shared_dir(world, "tp_ckpt_c"), b = paratrain_test::shared_dir(world, "tp_ckpt_d");
    leg<paratrain::Sharded<torch::optim::Adam, paratrain::zero::stage3>>(2, {}, a, 0, 2);
    leg<torch::optim::Adam>(1, a, b, 2, 4);
    CHECK(compare(2, leg<paratrain::Sharded<torch::optim::Adam, paratrain::zero::stage1>>(2, b, {}, 4, 6)) <= 1e-5);
    paratrain_test::remove_shared_dir(world, a);
    paratrain_test::remove_shared_dir(world, b);
  }
}

TEST_CASE("a tensor-parallel model's file holds whole tensors: the single-device model loads it") {
  comm::Mpi world;
  const Config c{.dropout = 0.0};
  torch::manual_seed(5);
  using Strategy = paratrain::DataParallel<Gpt, comm::Mpi, torch::optim::SGD>;
  Strategy s([&] { return Gpt(c); }, comm::Mpi(), torch::optim::SGDOptions(0.1), {.tensor_parallel = world.size()});
  const auto dir = paratrain_test::shared_dir(world, "tp_model_file");
  paratrain::checkpoint::save_model(s, dir / "model.pt");
  // Back into a model at degree 1 on every rank: the same values as a whole model from the seed.
  torch::manual_seed(5);
  paratrain::DataParallel<Gpt, comm::SingleDevice, torch::optim::SGD> one([&] { return Gpt(c); }, comm::SingleDevice(),
                                                                          torch::optim::SGDOptions(0.1));
  for (auto& p : one.model()->parameters()) p.detach().zero_();
  paratrain::checkpoint::load_model(one, dir / "model.pt");
  torch::manual_seed(5);
  RefGpt ref(c);
  CHECK(max_relative_difference(one.full_parameters(), reference_slices(ref, *one.model())) == 0);
  paratrain_test::remove_shared_dir(world, dir);
}

TEST_CASE("tensor parallelism: the parameters per rank are plan::per_rank's at tensor degree t, falling as 1/t") {
  const int world = comm::Mpi().size();
  const Config c;
  torch::manual_seed(3);
  RefGpt whole(c);
  double psi = 0, replicated = 0;  // replicated: what no tp layer cuts (the reference's names)
  for (const auto& p : whole->named_parameters()) {
    psi += static_cast<double>(p.value().numel());
    const auto& n = p.key();
    if (n == "position" || n.find("ln") != std::string::npos || n.ends_with("out.bias") || n.ends_with("fc2.bias"))
      replicated += static_cast<double>(p.value().numel());
  }
  torch::manual_seed(3);
  paratrain::DataParallel<Gpt, comm::Mpi, torch::optim::SGD> s([&] { return Gpt(c); }, comm::Mpi(),
                                                               torch::optim::SGDOptions(0.05).momentum(0.9),
                                                               {.tensor_parallel = world});
  const auto planned =
      paratrain::plan::per_rank({.parameters = psi, .tensor = world, .tensor_replicated = replicated},
                                paratrain::plan::stage::ddp);
  CHECK(static_cast<double>(s.model_state_bytes().parameters) == planned.parameters);
  // The same, written out: the cut parameters fall as 1/t, the replicated ones stay.
  CHECK(static_cast<double>(s.model_state_bytes().parameters) == 4 * ((psi - replicated) / world + replicated));
}

TEST_CASE("tp::Group gathers and reduce-scatters along any dimension, blocking and started (async), as the formulas say") {
  paratrain::Mesh<comm::Mpi> mesh(comm::Mpi(), {.tensor = comm::Mpi().size()});
  const tp::Group g(mesh);
  const int t = g.size(), r = g.rank();
  // Rank q's tensor, known to every rank without communicating.
  const auto of = [](int q, at::IntArrayRef sizes) {
    return torch::arange(static_cast<double>(c10::multiply_integers(sizes)), torch::kFloat).reshape(sizes) * 0.5f + q;
  };
  for (std::int64_t dim = 0; dim < 3; ++dim) {
    CAPTURE(dim);
    std::vector<std::int64_t> sizes{2, 3, 4};
    std::vector<torch::Tensor> all;
    for (int q = 0; q < t; ++q) all.push_back(of(q, sizes));
    const auto gathered = torch::cat(all, dim);
    CHECK(torch::equal(g.all_gather(of(r, sizes), dim), gathered));
    auto started = g.all_gather_async(of(r, sizes), dim);
    CHECK(torch::equal(started.wait(), gathered));
    // Reduce-scatter: the sum of every rank's tensor, this rank's t-th part along dim.
    sizes[static_cast<std::size_t>(dim)] *= t;
    torch::Tensor sum = torch::zeros(sizes);
    for (int q = 0; q < t; ++q) sum += of(q, sizes);
    const auto mine = sum.chunk(t, dim)[static_cast<std::size_t>(r)];
    CHECK(torch::allclose(g.reduce_scatter(of(r, sizes), dim), mine));
    auto scatter = g.reduce_scatter_async(of(r, sizes), dim);
    CHECK(torch::allclose(scatter.wait(), mine));
  }
}

TEST_CASE("a Group's all_to_all exchanges parts along any two dimensions, and rows by per-rank counts, as the "
          "formulas say, counting the bytes it sends") {
  paratrain::Mesh<comm::Mpi> mesh(comm::Mpi(), {.tensor = comm::Mpi().size()});
  const tp::Group g(mesh);
  const int t = g.size(), r = g.rank();
  const auto of = [](int q, at::IntArrayRef sizes) {
    return torch::arange(static_cast<double>(c10::multiply_integers(sizes)), torch::kFloat).reshape(sizes) * 0.5f + q;
  };
  for (std::int64_t scatter = 0; scatter < 3; ++scatter)
    for (std::int64_t gather = 0; gather < 3; ++gather) {
      CAPTURE(scatter);
      CAPTURE(gather);
      std::vector<std::int64_t> sizes{2, 3, 4};
      sizes[static_cast<std::size_t>(scatter)] *= t;
      // What rank q sends rank r: its r-th part along `scatter`; rank r puts them side by side along `gather`.
      std::vector<torch::Tensor> parts;
      for (int q = 0; q < t; ++q) parts.push_back(of(q, sizes).chunk(t, scatter)[static_cast<std::size_t>(r)]);
      g.reset_traffic();
      CHECK(torch::equal(g.all_to_all(of(r, sizes), scatter, gather), torch::cat(parts, gather)));
      CHECK(g.traffic().all_to_all_bytes == (t > 1 ? of(r, sizes).numel() * 4 : 0));  // a group of one sends nothing
    }
  // Rows: rank q sends rank j (q + j) % 3 rows of 5 values, q * 100 + j * 10 + the row.
  const auto rows_of = [](int q, int j) {
    const auto n = (q + j) % 3;
    return (torch::arange(n, torch::kFloat) + q * 100 + j * 10).unsqueeze(1).expand({n, 5}).contiguous();
  };
  std::vector<std::int64_t> in_rows, out_rows;
  std::vector<torch::Tensor> mine, theirs;
  for (int j = 0; j < t; ++j) in_rows.push_back((r + j) % 3), mine.push_back(rows_of(r, j));
  for (int q = 0; q < t; ++q) out_rows.push_back((q + r) % 3), theirs.push_back(rows_of(q, r));
  CHECK(torch::equal(g.all_to_all(torch::cat(mine), in_rows, out_rows), torch::cat(theirs)));
}

TEST_CASE("keyed dropout: a part's mask is the whole's slice, the CPU's loop and the tensor operations agree bit for "
          "bit, and a fraction p drops") {
  const std::vector<std::int64_t> whole{3, 8, 5, 6};
  const double p = 0.3;
  const std::uint64_t key = 0x123456789abcdefULL, call = 7;
  const auto full = tp::keyed_keep_mask(whole, {}, key, call, p, at::kCPU);
  CHECK(torch::equal(full, tp::keyed_keep_mask_by_tensors(whole, {}, key, call, p, at::kCPU)));
  for (std::int64_t dim = 0; dim < 4; ++dim) {
    CAPTURE(dim);
    const auto n = whole[static_cast<std::size_t>(dim)];
    for (std::int64_t offset = 0; offset < n; offset += 2) {
      CAPTURE(offset);
      auto sizes = whole;
      sizes[static_cast<std::size_t>(dim)] = std::min<std::int64_t>(2, n - offset);
      const tp::Placement where{.dim = dim, .offset = offset, .whole = n};
      const auto part = tp::keyed_keep_mask(sizes, where, key, call, p, at::kCPU);
      CHECK(torch::equal(part, full.narrow(dim, offset, sizes[static_cast<std::size_t>(dim)])));
      CHECK(torch::equal(part, tp::keyed_keep_mask_by_tensors(sizes, where, key, call, p, at::kCPU)));
    }
  }
  // Another call or key draws another mask; over 10^6 elements the drop rate is p to within
  // 5 standard deviations (sqrt(p(1-p)/n) = 4.6e-4).
  CHECK_FALSE(torch::equal(full, tp::keyed_keep_mask(whole, {}, key, call + 1, p, at::kCPU)));
  CHECK_FALSE(torch::equal(full, tp::keyed_keep_mask(whole, {}, key + 1, call, p, at::kCPU)));
  const auto many = tp::keyed_keep_mask({1000, 1000}, {}, key, call, p, at::kCPU);
  CHECK(std::abs(1.0 - many.to(at::kDouble).mean().item<double>() - p) < 5 * 4.6e-4);
  // The module: kept elements scaled by 1/(1-p), in float and double alike, as the mask says.
  tp::Dropout drop(p);
  for (const auto type : {at::kFloat, at::kDouble}) {
    const auto x = torch::randn({4, 6, 5}, at::TensorOptions().dtype(type));
    const auto calls = drop->calls();
    const auto y = drop(x, tp::Placement{.dim = 1, .offset = 6, .whole = 12});
    const auto keep = tp::keyed_keep_mask({4, 6, 5}, {.dim = 1, .offset = 6, .whole = 12}, drop->key(), calls, p,
                                          at::kCPU);
    CHECK(torch::equal(y, torch::where(keep, x * (1.0 / (1.0 - p)), torch::zeros_like(x))));
  }
}

TEST_CASE("tensor parallelism: a step's peak is plan::peak with Korthikanti et al.'s activations, at t = 1 and world, "
          "with and without sequence parallelism") {
  const int world = comm::Mpi().size();
  // Activations dominate: four layers whose MLP is 4h wide (the formula's), 48 tokens.
  const Config c{.vocabulary = 96, .positions = 48, .hidden = 48, .heads = 12, .ffn = 192, .layers = 4, .dropout = 0.1};
  const std::int64_t batch = 8;
  std::vector<double> peaks;  // at t = world: without, then with sequence parallelism
  std::vector<int> degrees{1};
  if (world > 1) degrees.push_back(world);
  int measured = 0;
  for (const int t : degrees) {
    for (const bool sp : {false, true}) {
      if (sp && t == 1) continue;
      CAPTURE(t);
      CAPTURE(sp);
      const paratrain::memory::CountingCpuAllocator::Scope counting;
      torch::manual_seed(3);
      paratrain::DataParallel<Gpt, comm::Mpi, torch::optim::SGD> s(
          [&] { return Gpt(c); }, comm::Mpi(), torch::optim::SGDOptions(0.05).momentum(0.9),
          {.tensor_parallel = t, .sequence_parallel = sp});
      const tp::CrossEntropy loss{s.tensor_group()};
      const auto per_replica = batch;  // sequences per data replica, at every degree
      for (int step = 0; step < 3; ++step) {
        const auto [ids, targets] = tokens_of_step(step, per_replica, c, c.positions);
        s.step({ids, targets}, loss);
        if (step == 0) counting.reset_peak();
      }
      auto planned = s.planned_peak();
      planned.states.activations = paratrain::plan::transformer_activations(
          {.sequence = double(c.positions), .batch = double(per_replica), .hidden = double(c.hidden),
           .heads = double(c.heads), .layers = double(c.layers), .tensor = t, .sequence_parallel = sp,
           .value_bytes = 4, .mask_bytes = 4});
      const double peak = static_cast<double>(counting.peak());
      CAPTURE(peak);
      CAPTURE(planned.total());
      CAPTURE(planned.states.activations);
      // Within 10% of the plan (measured: 3.7% above at t = 1, 4.8-7.8% at t = 2-4): what is
      // above is a step's transients the formula does not hold, such as attention's scores
      // before the softmax and the logits' gradient.
      CHECK(peak <= 1.10 * planned.total());
      CHECK(peak >= 0.90 * planned.total());
      if (t > 1) peaks.push_back(peak);
      ++measured;
    }
  }
  CHECK(measured == (world > 1 ? 3 : 1));
  // Sequence parallelism cuts what the layers keep t ways: its peak is the lower one.
  if (world > 1) CHECK(peaks[1] < peaks[0]);
}

// Every rank throws `what`: its message contains `expected`.
template <class F>
void refused_everywhere(F&& what, const std::string& expected) {
  try {
    what();
    FAIL("not refused: " << expected);
  } catch (const paratrain::error& e) {
    const bool named = std::string(e.what()).find(expected) != std::string::npos;
    if (!named) std::fprintf(stderr, "refused, but not as expected (\"%s\"): %s\n", expected.c_str(), e.what());
    CHECK(named);
  }
}

TEST_CASE("tensor parallelism refuses, on every rank, what it cannot do, naming the layer and the sizes") {
  const int world = comm::Mpi().size();
  using Strategy = paratrain::DataParallel<Gpt, comm::Mpi, torch::optim::SGD>;
  // A layer built outside a strategy, without a context of its own.
  refused_everywhere([] { tp::ColumnParallelLinear(8, 16); }, "no tensor group exists");
  if (world >= 2) {
    // Heads the degree does not divide: 3 heads over 2 ranks, 4 over 3, 6 over 4.
    Config c;
    c.heads = world == 2 ? 3 : world == 3 ? 4 : 6;
    c.hidden = 48;
    const auto degree = world;
    if (c.heads % degree != 0)
      refused_everywhere(
          [&] { Strategy s([&] { return Gpt(c); }, comm::Mpi(), torch::optim::SGDOptions(0.1), {.tensor_parallel = degree}); },
          "tp::SelfAttention(48, " + std::to_string(c.heads) + ") on rank " + std::to_string(comm::Mpi().rank()) +
              ": its attention heads (" + std::to_string(c.heads) +
              ") is not a multiple of the tensor degree (" + std::to_string(degree) + ")");
    // A vocabulary the degree does not divide.
    Config v;
    v.vocabulary = 97;
    refused_everywhere(
        [&] { Strategy s([&] { return Gpt(v); }, comm::Mpi(), torch::optim::SGDOptions(0.1), {.tensor_parallel = world}); },
        "vocabulary (97) is not a multiple of the tensor degree (" + std::to_string(world) + ")");
    // Deterministic mode.
    refused_everywhere(
        [&] {
          Strategy s([] { return Gpt(); }, comm::Mpi(), torch::optim::SGDOptions(0.1),
                     {.deterministic = {.shards = 12}, .tensor_parallel = world});
        },
        "deterministic mode does not take tensor parallelism");
  }
  if (world == 3 || world == 4) {
    // A degree that does not divide the world.
    const int degree = world == 3 ? 2 : 3;
    refused_everywhere(
        [&] { Strategy s([] { return Gpt(); }, comm::Mpi(), torch::optim::SGDOptions(0.1), {.tensor_parallel = degree}); },
        "DataParallelOptions::tensor_parallel is " + std::to_string(degree) + " but the world has " +
            std::to_string(world) + " ranks");
  }
}

TEST_CASE("tensor groups count Megatron's bytes: per block two all-reduces forward and two backward, or as many "
          "all-gathers and reduce-scatters of the same volume and the inputs gathered again") {
  const int world = comm::Mpi().size();
  if (world < 2) return;
  for (const bool sp : {false, true}) {
    CAPTURE(sp);
    Config c{.layers = 1, .dropout = 0.0};
    torch::manual_seed(3);
    paratrain::Mesh<comm::Mpi> mesh(comm::Mpi(), {.tensor = world});
    const tp::Context context{.group = tp::Group(mesh), .sequence_parallel = sp};
    tp::TransformerBlock block(tp::TransformerBlockOptions(c.hidden, c.heads).ffn(c.ffn).context(context));
    const std::int64_t b = 2, s = c.positions;
    auto x = torch::randn({b, sp ? s / world : s, c.hidden}, torch::requires_grad());
    context.group.reset_traffic();
    block(x).sum().backward();
    const auto t = context.group.traffic();
    const std::int64_t activation = b * s * c.hidden * 4;  // bytes of one whole [b, s, h] activation
    const double ring = double(world - 1) / world;
    if (sp) {
      // 2 forward; 2 backward (of the reduce-scatters); 2 again backward, the inputs kept as
      // shards (Note [Sequence-parallel inputs kept as shards]), as Megatron-LM does.
      CHECK(t.all_gather_bytes == 6 * activation);
      CHECK(t.reduce_scatter_bytes == 4 * activation);
      // Each rank's tokens give part of the layer norms' and the row-parallel biases'
      // gradients: 6 vectors of h, all-reduced.
      CHECK(t.all_reduce_bytes == 6 * c.hidden * 4);
      CHECK(t.bus_bytes() == doctest::Approx(ring * (10 * activation + 2 * 6 * c.hidden * 4)));
    } else {
      CHECK(t.all_reduce_bytes == 4 * activation);
      CHECK(t.all_gather_bytes + t.reduce_scatter_bytes == 0);
      CHECK(t.bus_bytes() == doctest::Approx(ring * 8 * activation));
    }
  }
}

}  // namespace

}  // namespace tensor_parallel_test
