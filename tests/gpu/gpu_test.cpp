// The promise on a GPU: every strategy, with its model on CUDA and batches handed over on the
// host, ends where single-device training on the same GPU ends (plain LibTorch, the same
// init, the union of the ranks' batches: tests/support/equivalence.hpp with Scenario::device).
// Ranks are processes started as torchrun starts them (tests/launch/torchrun_style.sh), which
// may share one GPU: they communicate over comm::Gloo with CUDA tensors, and over comm::Nccl
// where each has a GPU of its own (NCCL refuses two ranks of one communicator on one device),
// or alone (a world of one, which still runs every NCCL call of the strategies).
//
// Compiled on every machine with Gloo (CI: Debian's LibTorch, which has no CUDA); run by
// scripts/gpu-check.sh on a machine with a GPU. Without one the driver exits 77 (skipped),
// unless PARATRAIN_TEST_DEVICE=cpu asks for the same checks on the CPU.
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "paratrain/checkpoint/checkpoint.hpp"
#include "paratrain/comm/gloo/gloo.hpp"
#include "paratrain/data/loader.hpp"
#include "paratrain/data/tensor_dataset.hpp"
#include "paratrain/fit/fit.hpp"
#include "paratrain/pipeline/pipeline.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/strategy/local_data_parallel.hpp"
#include "paratrain/strategy/precision.hpp"
#include "paratrain/strategy/recompute.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "gpu/gpu_support.hpp"
#include "support/collectives.hpp"
#include "support/doctest.hpp"
#include "support/equivalence.hpp"
#include "support/fit_reference.hpp"
#include "support/gloo_world.hpp"
#include "support/gpt_reference.hpp"

namespace {

namespace comm = paratrain::comm;
namespace zero = paratrain::zero;
using namespace paratrain_test;
using gpu_suite::gpu;
using gpu_suite::scratch;
using gpu_suite::skipped;

// DDP and ZeRO 1-3 over `c`, SGD with momentum (Adam would hide a gradient off by a factor)
// and Adam, against the reference on the same GPU.
template <class Comm, class Update, class Optim, class Opts>
void check_on_gpu(Comm c, Scenario s, Opts opts) {
  s.device = gpu();
  const auto want = reference<Optim>(s, c.size(), opts);
  const auto got = distributed<Comm, Update>(s, std::move(c), opts);
  REQUIRE(got.size() == want.size());
  CHECK(got.front().device() == s.device);
  CHECK(max_relative_difference(got, want) <= 1e-5);
}

template <class Comm>
void check_every_strategy(const Comm& c) {
  const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
  const auto adam = torch::optim::AdamOptions(1e-2);
  for (const Scenario& s : {Scenario{}, Scenario{.varied_batch = true}, Scenario{.batch = 8, .micro_batches = 2}}) {
    CAPTURE(s.varied_batch);
    CAPTURE(s.micro_batches);
    check_on_gpu<Comm, torch::optim::SGD, torch::optim::SGD>(c, s, sgd);
    check_on_gpu<Comm, torch::optim::Adam, torch::optim::Adam>(c, s, adam);
    check_on_gpu<Comm, paratrain::Sharded<torch::optim::SGD, zero::stage1>, torch::optim::SGD>(c, s, sgd);
    check_on_gpu<Comm, paratrain::Sharded<torch::optim::SGD, zero::stage2>, torch::optim::SGD>(c, s, sgd);
    check_on_gpu<Comm, paratrain::Sharded<torch::optim::SGD, zero::stage3>, torch::optim::SGD>(c, s, sgd);
    check_on_gpu<Comm, paratrain::Sharded<torch::optim::Adam, zero::stage3>, torch::optim::Adam>(c, s, adam);
  }
}

// Two stages of the reference's MLP, each built on the GPU from a seed of its own.
struct FrontImpl : torch::nn::Module {
  FrontImpl() : fc(register_module("fc", torch::nn::Linear(8, 16))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::tanh(fc(x)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Front);
struct BackImpl : torch::nn::Module {
  BackImpl() : fc(register_module("fc", torch::nn::Linear(16, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc(x); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Back);

template <class M>
M built_on_gpu(int seed) {
  torch::manual_seed(seed);
  M m;
  m->to(gpu());
  return m;
}

// A two-stage pipeline (one stage per rank, the other ranks replicas) over `c`, against the
// two stages trained as one model on the GPU on every replica's micro-batches.
template <class Comm>
void check_pipeline(const Comm& c, paratrain::pipeline::Kind schedule) {
  REQUIRE(c.size() % 2 == 0);  // two stages, each replicated alike (callers check)
  const int replicas = c.size() / 2, steps = 6, micro = 4;
  const auto sgd = torch::optim::SGDOptions(0.1).momentum(0.9);
  const auto batch_of = [](int step, int replica) {  // the same on every rank, on the host
    torch::manual_seed(1000 * step + replica);
    return paratrain::Batch(torch::randn({8 + 4 * replica, 8}), torch::randn({8 + 4 * replica, 4}));
  };
  const auto mse = [](const torch::Tensor& out, const torch::Tensor& y) { return torch::mse_loss(out, y); };

  paratrain::DataParallel<paratrain::Pipeline<Front, Back>, Comm, torch::optim::SGD> pipe(
      paratrain::Pipeline<Front, Back>([] { return built_on_gpu<Front>(1); }, [] { return built_on_gpu<Back>(2); }), c,
      sgd, {.schedule = schedule});
  auto front = built_on_gpu<Front>(1);
  auto back = built_on_gpu<Back>(2);
  std::vector<torch::Tensor> params = front->parameters();
  for (const auto& p : back->parameters()) params.push_back(p);
  torch::optim::SGD reference(params, sgd);
  for (int t = 0; t < steps; ++t) {
    const auto mine = batch_of(t, pipe.data_shard().index);
    std::vector<paratrain::Batch> micro_batches;
    for (int m = 0; m < micro; ++m) micro_batches.push_back(mine.narrow(m * mine.size() / micro, mine.size() / micro));
    pipe.step(std::span<const paratrain::Batch>(micro_batches), mse);
    std::vector<torch::Tensor> xs, ys;
    for (int r = 0; r < replicas; ++r) {
      const auto b = batch_of(t, r);
      xs.push_back(b.input());
      ys.push_back(b.target);
    }
    reference.zero_grad();
    torch::mse_loss(back(front(torch::cat(xs).to(gpu()))), torch::cat(ys).to(gpu())).backward();
    reference.step();
  }
  const auto got = pipe.full_parameters();  // this rank's stage's: stage rank % 2
  const auto want = c.rank() % 2 == 0 ? front->parameters() : back->parameters();
  REQUIRE(got.size() == want.size());
  CHECK(max_relative_difference(got, want) <= 1e-5);
}

// A CUDA generator's stream, drawn from after a save and again after loading that save.
template <class Strategy>
void check_generator_in_checkpoint(Strategy& s, const std::filesystem::path& dir) {
  if (skipped(!gpu().is_cuda(), "no GPU generator on the CPU (its own: tests/unit/checkpoint_test.cpp)")) return;
  torch::manual_seed(3);
  paratrain::checkpoint::save(s, dir, /*step=*/1);
  const auto first = torch::rand({16}, torch::TensorOptions().device(gpu())).cpu();
  static_cast<void>(torch::rand({16}, torch::TensorOptions().device(gpu())));  // the stream moves on
  paratrain::checkpoint::load(s, dir / "step-000000001");
  const auto again = torch::rand({16}, torch::TensorOptions().device(gpu())).cpu();
  CHECK(torch::equal(first, again));
}

}  // namespace

TEST_CASE("[gpu] DDP and ZeRO 1-3 over comm::Gloo, CUDA models, equal single-device training on the GPU") {
  check_every_strategy(gloo_world());
}

TEST_CASE("[gpu] pipelines over comm::Gloo, stages on the GPU, equal the stages trained as one model") {
  if (skipped(gloo_world().size() % 2 != 0, "a two-stage pipeline needs an even number of ranks")) return;
  for (const auto schedule : {paratrain::pipeline::Kind::gpipe, paratrain::pipeline::Kind::one_f_one_b,
                              paratrain::pipeline::Kind::zero_bubble_h1})
    check_pipeline(gloo_world(), schedule);
}

TEST_CASE("[gpu] fit's loader copies batches to the GPU beside the step, and fit trains as one device does") {
  // The loader: on a GPU each batch arrives there, copied by the worker on its own stream
  // (Note [Copies beside the step]); on the CPU it stays where the dataset made it.
  const auto train = fit_reference::make_data(203, 1);  // not a multiple of any batch
  paratrain::data::Loader<paratrain::data::TensorDataset> loader(
      train, std::vector<torch::Tensor>{torch::arange(16), torch::arange(16, 40)},
      paratrain::data::for_device({.workers = 2, .depth = 2}, gpu()));
  for (int k = 0; k < 2; ++k) {
    const auto b = loader.next();
    REQUIRE(b);
    CHECK(b->input().device() == gpu());
    CHECK(b->target.device() == gpu());
    CHECK(torch::equal(b->input().cpu(), train.get(k == 0 ? torch::arange(16) : torch::arange(16, 40)).input()));
  }

  // fit over the ranks, batches of 5 per rank, 2 epochs, SGD with momentum, evaluating the
  // set after each epoch (its loader copies too), against a hand-written loop on the same GPU
  // over the union of the ranks' DistributedSampler batches.
  const paratrain::FitOptions options{.epochs = 2,
                                      .batch_size = 5,
                                      .seed = 3,
                                      .eval = &train,
                                      .eval_batch_size = 32,
                                      .loader = {.workers = 2, .depth = 3},
                                      .progress = false};
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  const int world = gloo_world().size();
  auto model = fit_reference::make_net();
  model->to(gpu());
  paratrain::DataParallel<fit_reference::Net, comm::Gloo, torch::optim::SGD> s(model, gloo_world(), sgd);
  CHECK(s.device() == gpu());
  const auto result = paratrain::fit(s, train, options);

  auto net = fit_reference::make_net();
  net->to(gpu());
  fit_reference::train(net, train, world, options.epochs, 5, 3, sgd, gpu());
  const auto got = s.model()->parameters(), want = net->parameters();
  CHECK(got.front().device() == gpu());
  CHECK(max_relative_difference(got, want) <= 1e-5);
  // The last evaluation: every sample once, over the ranks, with the trained model's loss.
  REQUIRE(result.epochs.size() == 2);
  const auto all = train.get(torch::arange(train.size())).to(gpu());
  const auto want_loss = torch::nn::functional::cross_entropy(net->forward(all.input()), all.target).item<double>();
  CHECK(result.epochs.back().eval_samples == train.size());
  CHECK(result.epochs.back().eval_loss == doctest::Approx(want_loss).epsilon(1e-5));
}

TEST_CASE("[gpu] fp16 autocast with loss scaling trains as a hand-written GradScaler loop on the GPU") {
  if (skipped(!gpu().is_cuda(), "fp16 autocast needs a GPU (LibTorch's CPU autocast is bf16 only)")) return;
  // DDP over the ranks, fp16 autocast and a scale that grows every 3 clean steps, against
  // GradScaler's steps written out on one device, as PyTorch's DDP runs them on each rank:
  // each rank's batch's mean loss times S, backward, the gradients averaged over every
  // sample (each rank's weighted by its samples), divided by S, the step skipped on Inf or
  // NaN, S halved then or doubled after 3 clean steps (torch.amp.GradScaler's update). Rank r
  // has 32 samples, or 64 where r is odd (powers of two: paratrain's loss unit is then the
  // batch itself, Note [Loss scaling], and its fp16 backward overflows exactly where
  // GradScaler's does).
  const int world = gloo_world().size(), rank = gloo_world().rank();
  const auto samples_of = [](int r) -> std::int64_t { return r % 2 == 0 ? 32 : 64; };
  std::int64_t global = 0, offset = 0;
  for (int r = 0; r < world; ++r) global += samples_of(r);
  for (int r = 0; r < rank; ++r) offset += samples_of(r);
  const auto data = fit_reference::make_data(global * 12, 5);
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  const paratrain::LossScaling scaling{.init_scale = 65536, .growth_interval = 3};
  auto model = fit_reference::make_net();
  model->to(gpu());
  paratrain::DataParallel<fit_reference::Net, comm::Gloo, torch::optim::SGD> s(
      model, gloo_world(), sgd, {.precision = {.autocast = torch::kHalf, .loss_scale = scaling}});
  auto net = fit_reference::make_net();
  net->to(gpu());
  torch::optim::SGD optim(net->parameters(), sgd);
  double scale = scaling.init_scale;
  int clean = 0, skips = 0;
  for (int t = 0; t < 12; ++t) {
    const auto all = data.get(torch::arange(t * global, (t + 1) * global)).to(gpu());
    const auto r = s.step(all.narrow(offset, samples_of(rank)), paratrain::CrossEntropy{});
    std::vector<torch::Tensor> sum;
    for (const auto& p : net->parameters()) sum.push_back(torch::zeros_like(p));
    for (std::int64_t q = 0, begin = 0; q < world; begin += samples_of(static_cast<int>(q)), ++q) {
      const auto mine = all.narrow(begin, samples_of(static_cast<int>(q)));
      optim.zero_grad();
      {
        const paratrain::detail::AutocastScope autocast(torch::kHalf, gpu());
        (torch::nn::functional::cross_entropy(net->forward(mine.input()), mine.target) * scale).backward();
      }
      const auto params = net->parameters();
      for (std::size_t i = 0; i < params.size(); ++i)
        sum[i] += params[i].grad() * static_cast<double>(mine.size());
    }
    bool finite = true;
    const auto params = net->parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      params[i].mutable_grad() = sum[i] / (static_cast<double>(global) * scale);
      finite = finite && torch::isfinite(params[i].grad()).all().item<bool>();
    }
    if (finite) optim.step();
    if (!finite) scale *= 0.5, clean = 0, ++skips;
    else if (++clean == 3) scale *= 2, clean = 0;
    CAPTURE(t);
    CHECK(r.skipped == !finite);
    CHECK(s.loss_scaler().scale() == scale);
  }
  MESSAGE("loss scaling on the GPU: " << skips << " of 12 steps skipped, the scale " << scale);
  CHECK(s.loss_scaler().scale() > scaling.init_scale);  // it grew
  CHECK(max_relative_difference(s.model()->parameters(), net->parameters()) <= 1e-3);  // fp16 forward
}

// LocalDataParallel's case: a model it can clone into replicas.
struct TinyImpl : torch::nn::Cloneable<TinyImpl> {
  TinyImpl() { reset(); }
  void reset() override { fc = register_module("fc", torch::nn::Linear(4, 2)); }
  torch::Tensor forward(const torch::Tensor& x) { return fc(x); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Tiny);

TEST_CASE("[gpu] LocalDataParallel puts its replicas on the GPUs, or on CPU threads where asked") {
  if (skipped(!gpu().is_cuda(), "replicas on GPUs need a GPU")) return;
  const auto sgd = torch::optim::SGDOptions(0.1);
  const auto loss = [](const torch::Tensor& out, const torch::Tensor& y) { return torch::mse_loss(out, y); };
  const paratrain::Batch batch(torch::randn({6, 4}), torch::randn({6, 2}));
  paratrain::LocalDataParallel<Tiny, torch::optim::SGD> on_gpus(Tiny(), sgd);
  CHECK(on_gpus.device() == torch::Device(torch::kCUDA, 0));
  CHECK(on_gpus.replicas() == static_cast<int>(torch::cuda::device_count()));
  CHECK(std::isfinite(on_gpus.step(batch, loss).loss));
  paratrain::LocalDataParallel<Tiny, torch::optim::SGD> on_cpu(Tiny(), sgd, {.replicas = 2, .cpu = true});
  CHECK(on_cpu.device() == torch::Device(torch::kCPU));
  CHECK(on_cpu.replicas() == 2);
  CHECK(on_cpu.model()->fc->weight.device() == torch::Device(torch::kCPU));
  CHECK(std::isfinite(on_cpu.step(batch, loss).loss));
}

TEST_CASE("[gpu] a checkpoint keeps the GPU's random stream") {
  auto model = make_model(Features{}, 0);
  model->to(gpu());
  paratrain::DataParallel<Mlp, comm::Gloo, torch::optim::SGD> s(model, gloo_world(), torch::optim::SGDOptions(0.1));
  const auto dir = scratch("checkpoint");
  if (s.rank() == 0) paratrain::checkpoint::detail::remove_tree(dir);  // Note [No recursive std::filesystem]
  gloo_world().barrier();
  check_generator_in_checkpoint(s, dir);
  gloo_world().barrier();
  if (s.rank() == 0) paratrain::checkpoint::detail::remove_tree(dir);  // Note [No recursive std::filesystem]
}

// Linear, dropout, tanh, Linear: dropout draws from the GPU's generator.
struct BlockImpl : torch::nn::Module {
  BlockImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    drop = register_module("drop", torch::nn::Dropout(0.5));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::tanh(drop(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::Dropout drop{nullptr};
};
TORCH_MODULE(Block);

TEST_CASE("[gpu] Recompute on the GPU redraws dropout's mask: the plain layer's gradients, exactly") {
  const auto grads = [](auto block) {
    block->to(gpu());
    torch::manual_seed(5);
    const auto x = torch::randn({10, 8}, torch::TensorOptions().device(gpu())).requires_grad_(true);
    (block(x) * 1.5).sum().backward();
    std::vector<torch::Tensor> g{x.grad()};
    for (const auto& p : block->parameters()) g.push_back(p.grad());
    return g;
  };
  torch::manual_seed(9);
  const auto plain = grads(Block());
  torch::manual_seed(9);
  const auto recomputed = grads(paratrain::Recompute<Block>());
  REQUIRE(recomputed.size() == plain.size());
  for (std::size_t i = 0; i < plain.size(); ++i) CHECK(torch::equal(recomputed[i], plain[i]));
}

// Tensor parallelism at t = the processes, which share the GPU (Gloo moves CUDA tensors; NCCL
// refuses two ranks on one GPU: nccl_gpu_test.cpp's case needs a GPU each).
TEST_CASE("[gpu] tensor parallelism over comm::Gloo, the model on the GPU, equals the single-device model") {
  const bool sequence_parallel = gloo_world().size() > 1;
  CHECK(paratrain_test::gpt::tensor_parallel_against_reference(gloo_world(), sequence_parallel, gpu()) <= 1e-5);
}

TEST_CASE("[gpu] comm::Gloo's collectives and sends on CUDA tensors equal the formulas") {
  // On the host they are paratrain_gloo_tests' own cases.
  if (skipped(!gpu().is_cuda(), "CUDA tensors need a GPU")) return;
  auto& c = gloo_world();
  collectives::check_all_reduce(c, gpu());
  collectives::check_broadcast(c, gpu());
  collectives::check_ireduce_scatter(c, {}, gpu());
  collectives::check_iall_gather(c, {}, gpu());
  collectives::check_all_gather_in_place(c, {}, gpu());
  collectives::check_requests(c, gpu());
  collectives::check_all_to_all(c, gpu());
  if (c.size() > 1) collectives::check_ring(c, gpu());
}

#if PARATRAIN_HAS_NCCL
TEST_CASE("[gpu] comm::Nccl, a world of one per process: DDP and ZeRO 1-3 equal single-device training") {
  if (skipped(!gpu().is_cuda(), "NCCL reduces on GPUs only")) return;
  comm::Rendezvous alone({.rank = 0, .world_size = 1, .local_rank = gloo_world().rank(), .master_addr = "", .file = ""});
  check_every_strategy(comm::Nccl(alone));
}

TEST_CASE("[gpu] comm::Nccl across the processes, one GPU each: every strategy and pipelines") {
  if (skipped(!gpu().is_cuda() || !gpu_suite::nccl_across(), "NCCL across processes needs a GPU for each of them"))
    return;
  auto nccl = gpu_suite::nccl_world();
  check_every_strategy(nccl);
  if (nccl.size() % 2 == 0)  // two stages; an odd number of GPUs checks the strategies only
    for (const auto schedule : {paratrain::pipeline::Kind::gpipe, paratrain::pipeline::Kind::one_f_one_b,
                                paratrain::pipeline::Kind::zero_bubble_h1})
      check_pipeline(nccl, schedule);
}

TEST_CASE("[gpu] comm::Nccl: a model on the CPU is moved to its GPU; one on another GPU is refused on every rank") {
  if (skipped(!gpu().is_cuda(), "NCCL needs a GPU")) return;
  auto nccl = gpu_suite::nccl_world();
  using Ddp = paratrain::DataParallel<Mlp, comm::Nccl, torch::optim::SGD>;
  const torch::Device mine(torch::kCUDA, static_cast<c10::DeviceIndex>(nccl.device()));
  {
    auto model = make_model(Features{}, 0);  // on the CPU: the strategy moves it (as a build function's)
    Ddp s(model, nccl, torch::optim::SGDOptions(0.1));
    CHECK(s.model()->parameters().front().device() == mine);
    CHECK(s.device() == mine);
  }
  const auto gpus = static_cast<int>(torch::cuda::device_count());
  if (gpus < 2) {  // the move above was checked: the case is not a skip
    MESSAGE("not checked here: a model on another GPU than the communicator's needs two GPUs");
    return;
  }
  const torch::Device other(torch::kCUDA, static_cast<c10::DeviceIndex>((nccl.device() + 1) % gpus));
  auto model = make_model(Features{}, 0);
  model->to(other);
  CHECK_THROWS_WITH_AS(Ddp(model, nccl, torch::optim::SGDOptions(0.1)),
                       doctest::Contains(("the model is on " + other.str() + " but this rank's communicator works on " +
                                          mine.str())
                                             .c_str()),
                       paratrain::error);
}
#endif
