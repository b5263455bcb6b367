// Checkpoints: a resumed run equals the uninterrupted one bitwise at the same world size;
// a checkpoint saved by any strategy at N ranks loads into any other at M ranks, and the
// training that follows equals single-device LibTorch (the independent reference) within
// 1e-5; every bad checkpoint is a clear error on every rank that leaves the earlier ones
// loadable. The SIGKILL and Python tests are driven from ctest (tests/checkpoint/).
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "paratrain/checkpoint/checkpoint.hpp"
#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/comm/single_device.hpp"
#include "paratrain/data/sequential_sampler.hpp"
#include "paratrain/fit/fit.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/strategy/local_data_parallel.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "support/doctest.hpp"
#include "support/shared_dir.hpp"
#include "support/equivalence.hpp"

namespace {

namespace fs = std::filesystem;
namespace comm = paratrain::comm;
namespace zero = paratrain::zero;
namespace ckpt = paratrain::checkpoint;
using paratrain::Sharded;
using namespace paratrain_test;


// Global step k trains on samples [k G, (k+1) G); rank r of `world` takes a contiguous
// part of them, so with G = 13 the ranks' batch sizes differ (13; 6, 7; 4, 4, 5; 3, 3, 3, 4).
constexpr std::int64_t G = 13;
paratrain::Batch part(const Data& d, int k, int world, int rank) {
  const auto begin = k * G + G * rank / world, end = k * G + G * (rank + 1) / world;
  return {d.x.narrow(0, begin, end - begin), d.y.narrow(0, begin, end - begin)};
}

template <class S>
void train(S& s, const Data& d, int from, int to) {
  for (int k = from; k < to; ++k) s.step(part(d, k, s.world_size(), s.rank()), loss_fn);
}

// Plain LibTorch on one device over the global batches, from `model` (by default the
// initialisation every strategy starts from: rank 0's): the independent reference.
template <class Optim, class Opts, class Model = Mlp>
std::vector<torch::Tensor> reference_steps(const Data& d, int steps, Opts opts, Model model = make_model({}, 0)) {
  Optim optim(model->parameters(), opts);
  for (int k = 0; k < steps; ++k) {
    optim.zero_grad();
    const auto b = part(d, k, 1, 0);
    loss_fn(model->forward(b.input()), b.target).backward();
    optim.step();
  }
  return model->parameters();
}

// A model unlike the one saved, so that a load has to change every parameter.
Mlp other_model(int rank) {
  auto m = make_model({}, rank);
  torch::NoGradGuard no_grad;
  for (auto& p : m->parameters()) p.add_(1.0);
  return m;
}

template <class U, class O>
struct Case {
  using update = U;
  using options = O;
};
torch::optim::SGDOptions options_of(torch::optim::SGDOptions*) { return torch::optim::SGDOptions(0.1).momentum(0.9); }
torch::optim::AdamOptions options_of(torch::optim::AdamOptions*) { return torch::optim::AdamOptions(1e-2); }
torch::optim::AdamWOptions options_of(torch::optim::AdamWOptions*) {
  return torch::optim::AdamWOptions(1e-2).weight_decay(0.1);
}
torch::optim::RMSpropOptions options_of(torch::optim::RMSpropOptions*) {
  return torch::optim::RMSpropOptions(1e-2).momentum(0.5).centered(true);
}
torch::optim::AdagradOptions options_of(torch::optim::AdagradOptions*) { return torch::optim::AdagradOptions(0.1); }

}  // namespace

TEST_CASE_TEMPLATE("A checkpoint resumes every strategy bitwise at the same world size", Cfg,
                   Case<torch::optim::SGD, torch::optim::SGDOptions>,
                   Case<torch::optim::Adagrad, torch::optim::AdagradOptions>,
                   Case<Sharded<torch::optim::SGD, zero::stage1>, torch::optim::SGDOptions>,
                   Case<Sharded<torch::optim::RMSprop, zero::stage2>, torch::optim::RMSpropOptions>,
                   Case<Sharded<torch::optim::Adam, zero::stage3>, torch::optim::AdamOptions>,
                   Case<Sharded<torch::optim::AdamW, zero::stage3>, torch::optim::AdamWOptions>) {
  using Strategy = paratrain::DataParallel<Mlp, comm::Mpi, typename Cfg::update>;
  comm::Mpi c;
  const auto dir = shared_dir(c, "roundtrip");
  const Data d;
  const auto opts = options_of(static_cast<typename Cfg::options*>(nullptr));
  std::vector<torch::Tensor> uninterrupted;
  {
    Strategy s(make_model({}, c.rank()), c, opts);
    train(s, d, 0, 5);
    ckpt::save(s, dir, 5);
    train(s, d, 5, 10);
    uninterrupted = s.full_parameters();
    // The uninterrupted run itself is single-device LibTorch's.
    CHECK(max_relative_difference(uninterrupted, reference_steps<typename Strategy::optimizer_type>(d, 10, opts)) <=
          1e-5);
  }
  Strategy s(other_model(c.rank()), c, opts);
  const auto loaded = ckpt::load(s, ckpt::path_of(dir, 5));
  CHECK(loaded.step == 5);
  CHECK(loaded.world_size == c.size());
  train(s, d, 5, 10);
  CHECK(max_relative_difference(s.full_parameters(), uninterrupted) == 0);
  if (c.rank() == 0) fs::remove_all(dir);
}

namespace {
// Mlp's layers, cloneable: LocalDataParallel copies the model into its replicas.
struct TwinImpl : torch::nn::Cloneable<TwinImpl> {
  TwinImpl() { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Twin);
}  // namespace

TEST_CASE("LocalDataParallel and single-device DataParallel load each other's checkpoints") {
  comm::Mpi world;
  if (world.size() != 1) return;  // one process: LocalDataParallel is process-local
  const auto dir = shared_dir(world, "local");
  const Data d;
  const auto opts = torch::optim::SGDOptions(0.1).momentum(0.9);
  torch::manual_seed(7);
  paratrain::LocalDataParallel<Twin, torch::optim::SGD> local(Twin(), opts, {.replicas = 2});
  torch::manual_seed(7);
  const auto want = reference_steps<torch::optim::SGD>(d, 10, opts, Twin());  // from the same initialisation
  train(local, d, 0, 4);
  ckpt::save(local, dir, 4);
  train(local, d, 4, 8);
  paratrain::DataParallel<Twin, comm::SingleDevice, torch::optim::SGD> single(Twin(), opts);
  ckpt::load(single, ckpt::path_of(dir, 4));
  train(single, d, 4, 8);
  CHECK(max_relative_difference(single.model()->parameters(), local.model()->parameters()) <= 1e-5);
  // And back: the replicas take the loaded state too.
  ckpt::save(single, dir, 8);
  paratrain::LocalDataParallel<Twin, torch::optim::SGD> again(Twin(), opts, {.replicas = 2});
  ckpt::load(again, ckpt::path_of(dir, 8));
  train(again, d, 8, 10);
  train(single, d, 8, 10);
  CHECK(max_relative_difference(again.model()->parameters(), single.model()->parameters()) <= 1e-5);
  CHECK(max_relative_difference(again.model()->parameters(), want) <= 1e-5);
  fs::remove_all(dir);
}

// A parameter that is a strided view (every other column of a larger tensor): reshape
// gives a strided view of it, not a copy, and a checkpoint must still hold its values.
struct StridedImpl : torch::nn::Module {
  StridedImpl() { w = register_parameter("w", torch::randn({2, 6}).slice(1, 0, 6, 2)); }
  torch::Tensor forward(torch::Tensor x) { return x.matmul(w.t()); }
  torch::Tensor w;
};
TORCH_MODULE(Strided);

// Note [No recursive std::filesystem]: checkpoints remove and list directories with POSIX calls.
// Against std::filesystem, which is safe here (Debian's LibTorch exports none of it); each rank
// in a directory of its own.
TEST_CASE("remove_tree removes a tree as std::filesystem::remove_all does, links not followed; entries lists") {
  namespace fs = std::filesystem;
  namespace ck = paratrain::checkpoint::detail;
  const auto root = fs::temp_directory_path() / ("paratrain-tree-" + std::to_string(::getpid()));
  fs::remove_all(root);
  const auto tree = root / "tree", outside = root / "outside";
  fs::create_directories(tree / "a" / "b");
  fs::create_directories(outside);
  std::ofstream(tree / "f") << "x";
  std::ofstream(tree / "a" / "g") << "y";
  std::ofstream(tree / "a" / "b" / "h") << "z";
  std::ofstream(outside / "kept") << "k";
  fs::create_directory_symlink(outside, tree / "a" / "link");
  std::set<std::string> names;
  for (const auto& e : ck::entries(tree)) names.insert(e.lexically_relative(tree).string());
  CHECK(names == std::set<std::string>{"a", "f"});
  // What remove_all would count: the tree and every entry under it, the link as one.
  std::uintmax_t want = 1;
  for (auto it = fs::recursive_directory_iterator(tree); it != fs::recursive_directory_iterator(); ++it) ++want;
  CHECK(want == 7);  // tree, f, a, a/g, a/b, a/b/h, a/link
  std::error_code ec;
  CHECK(ck::remove_tree(tree, ec) == want);
  CHECK(!ec);
  CHECK(!fs::exists(tree));
  CHECK(fs::exists(outside / "kept"));  // the link went, not what it pointed to
  CHECK(ck::remove_tree(tree, ec) == 0);  // nothing there: nothing to do, no error
  CHECK(!ec);
  CHECK(ck::remove_tree(outside / "kept") == 1);  // a file alone
  CHECK(!fs::exists(outside / "kept"));
  CHECK_THROWS_WITH_AS(ck::entries(root / "missing"), doctest::Contains("missing: cannot list"), std::runtime_error);
  CHECK(ck::entries(root / "missing", ec).empty());
  CHECK(ec == std::errc::no_such_file_or_directory);
  fs::remove_all(root);
}

TEST_CASE("A checkpoint holds a strided parameter's values, not the memory under it") {
  comm::Mpi world;
  if (world.size() != 1) return;
  const auto dir = shared_dir(world, "strided");
  torch::manual_seed(3);
  paratrain::DataParallel<Strided, comm::SingleDevice, torch::optim::SGD> a(Strided(), torch::optim::SGDOptions(0.1));
  REQUIRE_FALSE(a.model()->w.is_contiguous());
  const auto want = a.model()->w.detach().clone();
  ckpt::save(a, dir, 1);
  paratrain::DataParallel<Strided, comm::SingleDevice, torch::optim::SGD> b(Strided(), torch::optim::SGDOptions(0.1));
  REQUIRE_FALSE(torch::equal(b.model()->w, want));
  ckpt::load(b, ckpt::path_of(dir, 1));
  CHECK(torch::equal(b.model()->w, want));
  fs::remove_all(dir);
}

// ZeRO-3 at W -> DDP at W/2 -> single device -> ZeRO-1 at min(3, W) -> ZeRO-2 at another
// world size -> ZeRO-3 at W: at 4 ranks 4 -> 2 -> 1 -> 3 -> 2 -> 4 (at 3: 3 -> 1 -> 1 -> 3 ->
// 2 -> 3; at 2: 2 -> 1 -> 1 -> 2 -> 1 -> 2), every link followed by training, so that a
// sharded load that misplaces a shard or its optimizer state shows in what follows.
// `hybrid`: the first and last ZeRO-3 shard in groups of 2 (of 1 on an odd world) and
// replicate across them (Note [Hybrid sharding]).
template <class Optim, class Opts>
void reshard_chain(const Opts& opts, bool hybrid = false) {
  comm::Mpi world;
  const int w = world.size(), rank = world.rank();
  const auto dir = shared_dir(world, "chain");
  const Data d;
  const auto sub = [&](int m) { return world.split(rank < m ? 0 : 1, rank); };
  const paratrain::DataParallelOptions zero3{.shard_group = hybrid ? (w % 2 == 0 ? 2 : 1) : 0};
  {
    paratrain::DataParallel<Mlp, comm::Mpi, Sharded<Optim, zero::stage3>> s(make_model({}, rank), world, opts, zero3);
    train(s, d, 0, 4);
    ckpt::save(s, dir / "a", 4);
  }
  world.barrier();
  const int m = std::max(1, w / 2);
  auto half = sub(m);
  if (rank < m) {
    paratrain::DataParallel<Mlp, comm::Mpi, Optim> s(other_model(rank), half, opts);
    CHECK(ckpt::load(s, ckpt::path_of(dir / "a", 4)).world_size == w);
    train(s, d, 4, 8);
    ckpt::save(s, dir / "b", 8);
  }
  world.barrier();
  if (rank == 0) {
    paratrain::DataParallel<Mlp, comm::SingleDevice, Optim> s(other_model(0), opts);
    ckpt::load(s, ckpt::path_of(dir / "b", 8));
    train(s, d, 8, 12);
    ckpt::save(s, dir / "c", 12);
  }
  world.barrier();
  const int three = std::min(3, w);
  auto last = sub(three);
  if (rank < three) {
    paratrain::DataParallel<Mlp, comm::Mpi, Sharded<Optim, zero::stage1>> s(other_model(rank), last, opts);
    ckpt::load(s, ckpt::path_of(dir / "c", 12));
    train(s, d, 12, 16);
    CAPTURE(w);
    CHECK(max_relative_difference(s.full_parameters(), reference_steps<Optim>(d, 16, opts)) <= 1e-5);
    ckpt::save(s, dir / "d", 16);
  }
  world.barrier();
  const int two = three == 3 ? 2 : 1;  // another world size than ZeRO-1's, where there is one
  auto pair = sub(two);
  if (rank < two) {
    paratrain::DataParallel<Mlp, comm::Mpi, Sharded<Optim, zero::stage2>> s(other_model(rank), pair, opts);
    CHECK(ckpt::load(s, ckpt::path_of(dir / "d", 16)).world_size == three);
    train(s, d, 16, 20);
    ckpt::save(s, dir / "e", 20);
  }
  world.barrier();
  {
    // Built sharded (Note [Sharded construction]), from other values than the reference's,
    // and loaded straight into the shards.
    paratrain::DataParallel<Mlp, comm::Mpi, Sharded<Optim, zero::stage3>> s([] { return make_model({}, 7); }, world,
                                                                           opts, zero3);
    CHECK(ckpt::load(s, ckpt::path_of(dir / "e", 20)).world_size == two);
    train(s, d, 20, 24);
    CAPTURE(w);
    CHECK(max_relative_difference(s.full_parameters(), reference_steps<Optim>(d, 24, opts)) <= 1e-5);
  }
  world.barrier();
  if (rank == 0) fs::remove_all(dir);
}

TEST_CASE("Resharding: ZeRO-3 at N, DDP at N/2, one device, ZeRO-1 at 3, ZeRO-2 and ZeRO-3 at other sizes, "
          "each followed by training, equal LibTorch") {
  SUBCASE("SGD with momentum") { reshard_chain<torch::optim::SGD>(torch::optim::SGDOptions(0.1).momentum(0.9)); }
  SUBCASE("Adam") { reshard_chain<torch::optim::Adam>(torch::optim::AdamOptions(1e-2)); }
}

TEST_CASE("Hybrid sharding resumes from and into other strategies at other world sizes, equal to LibTorch") {
  // The chain above, its first and last ZeRO-3 sharded in groups of 2 (of 1 on an odd world).
  SUBCASE("SGD with momentum") {
    reshard_chain<torch::optim::SGD>(torch::optim::SGDOptions(0.1).momentum(0.9), /*hybrid=*/true);
  }
  SUBCASE("Adam") { reshard_chain<torch::optim::Adam>(torch::optim::AdamOptions(1e-2), /*hybrid=*/true); }
}

namespace {

struct Interrupt {};

const paratrain::data::TensorDataset& fit_data() {
  static const Data d;
  static const paratrain::data::TensorDataset set(d.x.narrow(0, 0, 240), d.y.narrow(0, 0, 240));
  return set;
}

template <class Sampler = paratrain::data::DistributedSampler, class Strategy>
paratrain::FitResult run_fit(Strategy& s, std::int64_t batch, paratrain::CheckpointOptions checkpoint,
                             std::int64_t interrupt_after = -1) {
  return paratrain::fit<Sampler>(s, fit_data(),
                        {.epochs = 3,
                         .batch_size = batch,
                         .lr_schedule = [](double epoch) { return 1.0 / (1.0 + epoch); },
                         .progress = false,
                         .on_step = [&](const paratrain::StepInfo& i) {
                           if (i.step == interrupt_after) throw Interrupt{};
                         },
                         .checkpoint = checkpoint},
                        loss_fn);
}

}  // namespace

TEST_CASE_TEMPLATE("fit stopped mid-epoch and resumed ends bitwise where the uninterrupted run does", Update,
                   torch::optim::SGD, Sharded<torch::optim::Adam, zero::stage2>, Sharded<torch::optim::Adam, zero::stage3>) {
  using Strategy = paratrain::DataParallel<Mlp, comm::Mpi, Update>;
  using Opts = std::conditional_t<std::is_same_v<Update, torch::optim::SGD>, torch::optim::SGDOptions, torch::optim::AdamOptions>;
  const auto opts = options_of(static_cast<Opts*>(nullptr));
  comm::Mpi c;
  const auto dir = shared_dir(c, "fit");
  Strategy whole(make_model({}, c.rank()), c, opts);
  const auto want = run_fit(whole, 8, {});
  for (const bool async : {true, false}) {
    CAPTURE(async);
    if (c.rank() == 0) fs::remove_all(dir / "run");
    c.barrier();
    {
      Strategy s(make_model({}, c.rank()), c, opts);
      // Steps 0-16 and saves after 4, 8, 12, 16 (the second epoch's fourth step at 1 rank);
      // step 17 never finishes.
      CHECK_THROWS_AS(run_fit(s, 8, {.directory = dir / "run", .every_steps = 4, .async = async}, 17), Interrupt);
    }
    c.barrier();
    Strategy s(other_model(c.rank()), c, opts);
    const auto got = run_fit(s, 8, {.directory = dir / "run", .every_steps = 4, .async = async});
    REQUIRE(got.resumed_from.has_value());
    // In the background the last save may not have been published before the stop.
    const auto name = got.resumed_from->filename().string();
    CHECK((name == "step-000000016" || (async && name == "step-000000012")));
    CHECK(max_relative_difference(s.full_parameters(), whole.full_parameters()) == 0);
    // The resumed epoch's loss counts its steps before the interruption too.
    CHECK(got.epochs.back().train_loss == want.epochs.back().train_loss);
  }
  if (c.rank() == 0) fs::remove_all(dir);
}

TEST_CASE("fit<SequentialSampler> resumes mid-epoch where each replica stopped, and only at as many replicas") {
  // SequentialSampler has no set_epoch(epoch, start): fit skips what each replica visited
  // (Note [Resuming mid-epoch]), which is right only at the same number of replicas.
  using Sequential = paratrain::data::SequentialSampler;
  comm::Mpi c;
  const auto dir = shared_dir(c, "fit-sequential");
  const auto opts = torch::optim::SGDOptions(0.1).momentum(0.9);
  using Strategy = paratrain::DataParallel<Mlp, comm::Mpi, torch::optim::SGD>;
  Strategy whole(make_model({}, c.rank()), c, opts);
  run_fit<Sequential>(whole, 8, {});
  {
    Strategy s(make_model({}, c.rank()), c, opts);
    // Saves after 7 and 14 steps, mid-epoch at 1-4 ranks (30, 15, 10, 8 steps an epoch).
    CHECK_THROWS_AS(run_fit<Sequential>(s, 8, {.directory = dir, .every_steps = 7, .async = false}, 17), Interrupt);
  }
  c.barrier();
  Strategy s(other_model(c.rank()), c, opts);
  const auto got = run_fit<Sequential>(s, 8, {.resume_from = dir / "step-000000014"});
  CHECK(got.resumed_from.has_value());
  CHECK(max_relative_difference(s.full_parameters(), whole.full_parameters()) == 0);
  c.barrier();
  if (c.rank() == 0 && c.size() > 1) {
    paratrain::DataParallel<Mlp, comm::SingleDevice, torch::optim::SGD> one(other_model(0), opts);
    std::string what;
    try {
      run_fit<Sequential>(one, 8, {.resume_from = dir / "step-000000014"});
    } catch (const paratrain::error& e) {
      what = e.what();
    }
    CHECK(what.find("was saved mid-epoch by " + std::to_string(c.size()) + " data-parallel replicas") !=
          std::string::npos);
  }
  c.barrier();
  if (c.rank() == 0) fs::remove_all(dir);
}

TEST_CASE("fit resumed at another world size with the same global batch equals the uninterrupted run within 1e-5") {
  comm::Mpi c;
  const int w = c.size(), rank = c.rank();
  const auto dir = shared_dir(c, "fit-reshard");
  const auto opts = torch::optim::SGDOptions(0.1).momentum(0.9);
  paratrain::DataParallel<Mlp, comm::Mpi, Sharded<torch::optim::SGD, zero::stage3>> whole(make_model({}, rank), c, opts);
  run_fit(whole, 12 / w, {});
  const auto want = whole.full_parameters();
  {
    paratrain::DataParallel<Mlp, comm::Mpi, Sharded<torch::optim::SGD, zero::stage3>> s(make_model({}, rank), c, opts);
    // 20 steps an epoch; saves after 7, 14 and 21 steps (mid-epoch), then stopped.
    CHECK_THROWS_AS(run_fit(s, 12 / w, {.directory = dir, .every_steps = 7, .async = false}, 23), Interrupt);
  }
  c.barrier();
  if (rank == 0) {  // the same global batch of 12 on one device
    paratrain::DataParallel<Mlp, comm::SingleDevice, torch::optim::SGD> s(other_model(0), opts);
    const auto got = run_fit(s, 12, {.directory = dir});
    CHECK(got.resumed_from.has_value());
    CHECK(max_relative_difference(s.model()->parameters(), want) <= 1e-5);
    fs::remove_all(dir);
  }
  c.barrier();
}

namespace {

// Note [The elastic scenario]
// One job that loses ranks and gets them back, in one mpirun: the world's first W ranks
// train and are interrupted (every rank at the same step, as a lost rank ends a job), then
// W - 1 of them resume from the newest checkpoint, then W - 2 (at least 1), then all W
// again to the end; the first start sets the global batch (12: every world size here
// divides it) and the resumes keep the checkpoint's, each rank taking 12 / world per step
// in micro-batches of at most 4. Which samples each step trained on is logged from the
// loss (its targets carry the sample's id); a step trained again after a resume counts as
// the resumed run trained it.
constexpr std::int64_t elastic_samples = 96, elastic_global = 12, elastic_epochs = 3;
constexpr std::uint64_t elastic_seed = 3;

const paratrain::data::TensorDataset& elastic_data() {
  static const Data d;
  static const paratrain::data::TensorDataset set(
      d.x.narrow(0, 0, elastic_samples),
      torch::stack({d.y.narrow(0, 0, elastic_samples), torch::arange(elastic_samples, torch::kLong)}, 1));
  return set;
}

// Cross-entropy over column 0 of the targets; column 1, the samples' ids, is noted down.
struct LoggingLoss {
  std::vector<std::int64_t>* seen;
  torch::Tensor operator()(const torch::Tensor& out, const torch::Tensor& target) const {
    const auto ids = target.select(1, 1).contiguous();
    seen->insert(seen->end(), ids.data_ptr<std::int64_t>(), ids.data_ptr<std::int64_t>() + ids.numel());
    return loss_fn(out, target.select(1, 0));
  }
};

using StepLog = std::map<std::int64_t, std::vector<std::int64_t>>;  // step -> sample ids

// One start of the job on `s`: fit until `stop_after` (-1: the end), each step's samples
// written to `log` (this rank's part) as it ends.
template <class Strategy>
void elastic_start(Strategy& s, const fs::path& dir, std::int64_t global_batch, std::int64_t stop_after,
                   const fs::path& log) {
  std::vector<std::int64_t> seen;
  std::ofstream out(log);
  const auto note = [&](const paratrain::StepInfo& i) {
    out << i.step;
    for (const auto id : seen) out << ' ' << id;
    out << '\n' << std::flush;
    seen.clear();
    if (i.step == stop_after) throw Interrupt{};
  };
  paratrain::fit(s, elastic_data(),
                 {.epochs = static_cast<int>(elastic_epochs),
                  .batch_size = 4,
                  .global_batch_size = global_batch,
                  .seed = elastic_seed,
                  .progress = false,
                  .on_step = note,
                  .checkpoint = {.directory = dir, .every_steps = 3, .async = false}},
                 LoggingLoss{&seen});
}

// One start of the job in an own loop: checkpoint::resume, then the global batches from the
// step it returns (DistributedSampler dealing what remains of the epoch), each rank taking
// its G / R of each; checkpoints after every third step, as the fit starts save them.
template <class Strategy>
void own_loop_start(Strategy& s, const fs::path& dir, std::int64_t, std::int64_t stop_after, const fs::path& log) {
  const auto from = ckpt::resume(s, dir);
  const auto per_epoch = elastic_samples / elastic_global;
  const auto shard = s.data_shard();
  const auto share = elastic_global / shard.count;
  paratrain::data::DistributedSampler sampler(elastic_samples,
                                              {.num_replicas = shard.count, .rank = shard.index, .seed = elastic_seed});
  ckpt::Checkpointer saver(s, {.directory = dir});
  std::vector<std::int64_t> seen, mine;
  std::ofstream out(log);
  LoggingLoss loss{&seen};
  std::int64_t first = 0;  // the step `mine` begins with
  for (auto step = from ? from->step : 0; step < per_epoch * elastic_epochs; ++step) {
    if (step % per_epoch == 0 || mine.empty()) {
      sampler.set_epoch(step / per_epoch, (step % per_epoch) * elastic_global);
      mine = sampler.indices();
      first = step;
    }
    const auto at = static_cast<std::ptrdiff_t>((step - first) * share);
    const std::vector<std::int64_t> ids(mine.begin() + at, mine.begin() + at + share);
    s.step(elastic_data().get(torch::tensor(ids, torch::kLong)), loss);
    out << step;
    for (const auto id : seen) out << ' ' << id;
    out << '\n' << std::flush;
    seen.clear();
    if ((step + 1) % 3 == 0) saver.save(step + 1);
    if (step == stop_after) throw Interrupt{};
  }
}

// The steps of every start's logs in `files` (each start's, in order), a later start's
// record of a step replacing an earlier one's.
StepLog merged_steps(const std::vector<std::vector<fs::path>>& starts) {
  StepLog all;
  for (const auto& files : starts) {
    StepLog now;
    for (const auto& f : files) {
      std::ifstream in(f);
      for (std::string line; std::getline(in, line);) {
        std::istringstream fields(line);
        std::int64_t step = 0, id = 0;
        fields >> step;
        auto& ids = now[step];
        while (fields >> id) ids.push_back(id);
      }
    }
    for (auto& [step, ids] : now) all[step] = std::move(ids);
  }
  return all;
}

// Plain LibTorch on one device: SGD with momentum over the logged global batches.
// From the strategies' first parameters (rank 0's, broadcast).
std::vector<torch::Tensor> reference_over(const StepLog& steps, torch::optim::SGDOptions opts) {
  auto model = other_model(0);
  torch::optim::SGD optim(model->parameters(), opts);
  const auto& d = elastic_data();
  for (const auto& [step, ids] : steps) {
    optim.zero_grad();
    const auto b = d.get(torch::tensor(ids, torch::kLong));
    loss_fn(model->forward(b.input()), b.target.select(1, 0)).backward();
    optim.step();
  }
  return model->parameters();
}

// Runs the scenario on strategies built by `make(communicator)`; returns the merged log and
// leaves the last start's parameters in `got` (on rank 0), the uninterrupted run's in `want`.
template <class Make, class Start>
StepLog elastic_scenario(comm::Mpi& world, const std::string& name, Make make, Start start_job,
                         std::vector<torch::Tensor>& got, std::vector<torch::Tensor>& want) {
  const int w = world.size(), rank = world.rank();
  const auto dir = shared_dir(world, name);
  const auto log_of = [&](const std::string& start, int r) { return dir / (start + "-" + std::to_string(r) + ".log"); };
  {
    auto whole = make(world);
    start_job(*whole, dir / "whole", elastic_global, -1, log_of("whole", rank));
    want = whole->full_parameters();
  }
  // Starts at W, W - 1, max(W - 2, 1) and W ranks, interrupted after steps 5, 11 and 17
  // (8 steps an epoch: mid-epoch each time); checkpoints after every third step.
  const int sizes[] = {w, std::max(w - 1, 1), std::max(w - 2, 1), w};
  const std::int64_t stops[] = {5, 11, 17, -1};
  std::vector<std::vector<fs::path>> starts;
  for (int k = 0; k < 4; ++k) {
    const bool in = rank < sizes[k];
    auto part = world.split(in ? 0 : 1, rank);
    const auto start = "start" + std::to_string(k);
    if (in) {
      auto s = make(part);
      try {
        start_job(*s, dir / "ckpt", k == 0 ? elastic_global : 0, stops[k], log_of(start, rank));
      } catch (const Interrupt&) {
      }
      if (k == 3) got = s->full_parameters();
    }
    starts.emplace_back();
    for (int r = 0; r < sizes[k]; ++r) starts.back().push_back(log_of(start, r));
    world.barrier();
  }
  StepLog whole;
  if (rank == 0) whole = merged_steps({[&] {
    std::vector<fs::path> files;
    for (int r = 0; r < w; ++r) files.push_back(log_of("whole", r));
    return files;
  }()});
  const auto steps = rank == 0 ? merged_steps(starts) : StepLog{};
  if (rank == 0) {
    // Every step's samples are the uninterrupted run's, and those of DistributedSampler's
    // formula: the epoch's order, randperm(n) seeded with seed + epoch, cut into global
    // batches; so each epoch trains each sample exactly once.
    const auto per_epoch = elastic_samples / elastic_global;
    REQUIRE(steps.size() == static_cast<std::size_t>(per_epoch * elastic_epochs));
    for (const auto& [step, ids] : steps) {
      CAPTURE(step);
      const auto epoch = step / per_epoch;
      auto g = at::detail::createCPUGenerator(elastic_seed + static_cast<std::uint64_t>(epoch));
      const torch::Tensor order = torch::randperm(elastic_samples, g, torch::kLong);
      const torch::Tensor want_ids = order.narrow(0, (step % per_epoch) * elastic_global, elastic_global);
      std::vector<std::int64_t> expected(want_ids.data_ptr<std::int64_t>(),
                                         want_ids.data_ptr<std::int64_t>() + elastic_global);
      auto sorted = ids;
      std::ranges::sort(sorted);
      std::ranges::sort(expected);
      CHECK(sorted == expected);
      auto uninterrupted = whole.at(step);
      std::ranges::sort(uninterrupted);
      CHECK(sorted == uninterrupted);
    }
  }
  world.barrier();
  if (rank == 0) fs::remove_all(dir);
  return steps;
}

}  // namespace

TEST_CASE("An elastic job (W, W-1, W-2, W ranks) trains each sample of each epoch once, as one device does") {
  comm::Mpi world;
  const auto opts = torch::optim::SGDOptions(0.05).momentum(0.9);
  using Strategy = paratrain::DataParallel<Mlp, comm::Mpi, Sharded<torch::optim::SGD, zero::stage2>>;
  std::vector<torch::Tensor> got, want;
  const auto steps = elastic_scenario(world, "elastic", [&](comm::Mpi& c) {
    return std::make_unique<Strategy>(other_model(c.rank()), c, opts);
  }, elastic_start<Strategy>, got, want);
  if (world.rank() == 0) {
    CHECK(max_relative_difference(got, reference_over(steps, opts)) <= 1e-5);
    CHECK(max_relative_difference(got, want) <= 1e-5);
  }
}

TEST_CASE("An own loop resumed with checkpoint::resume at W, W-1, W-2, W ranks trains each sample once, as one device") {
  comm::Mpi world;
  const auto opts = torch::optim::SGDOptions(0.05).momentum(0.9);
  using Strategy = paratrain::DataParallel<Mlp, comm::Mpi, torch::optim::SGD>;
  std::vector<torch::Tensor> got, want;
  const auto steps = elastic_scenario(world, "elastic-own-loop", [&](comm::Mpi& c) {
    return std::make_unique<Strategy>(other_model(c.rank()), c, opts);
  }, own_loop_start<Strategy>, got, want);
  if (world.rank() == 0) {
    CHECK(max_relative_difference(got, reference_over(steps, opts)) <= 1e-5);
    CHECK(max_relative_difference(got, want) <= 1e-5);
  }
}

TEST_CASE("An elastic job in deterministic mode ends with the uninterrupted run's bytes, through fit") {
  comm::Mpi world;
  const auto opts = torch::optim::SGDOptions(0.05).momentum(0.9);
  using Strategy = paratrain::DataParallel<Mlp, comm::Mpi, Sharded<torch::optim::SGD, zero::stage3>>;
  std::vector<torch::Tensor> got, want;
  const auto steps = elastic_scenario(world, "elastic-deterministic", [&](comm::Mpi& c) {
    return std::make_unique<Strategy>(other_model(c.rank()), c, opts,
                                      paratrain::DataParallelOptions{.deterministic = {.shards = 12, .seed = 7}});
  }, elastic_start<Strategy>, got, want);
  if (world.rank() == 0) {
    REQUIRE(got.size() == want.size());
    for (std::size_t i = 0; i < got.size(); ++i) CHECK(torch::equal(got[i], want[i]));
    CHECK(max_relative_difference(got, reference_over(steps, opts)) <= 1e-5);
  }
}

namespace {

void flip_byte(const fs::path& file, std::int64_t offset) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char b = 0;
  f.read(&b, 1);
  b = static_cast<char>(b ^ 0x5a);
  f.seekp(offset);
  f.write(&b, 1);
}

// Every rank gets a paratrain::error from `f` that names `needle` (a file, the problem).
template <class F>
void check_error_names(F&& f, const std::string& needle) {
  std::string what;
  try {
    f();
  } catch (const paratrain::error& e) {
    what = e.what();
  }
  CAPTURE(what);
  CAPTURE(needle);
  CHECK(what.find(needle) != std::string::npos);
}

// A 8.4M-parameter model: its checkpoints take long enough to write to be killed midway.
struct BigImpl : torch::nn::Module {
  // Units for ZeRO-3; inert under the other strategies.
  BigImpl()
      : a(register_module("a", paratrain::Unit<torch::nn::Linear>(2048, 2048))),
        b(register_module("b", paratrain::Unit<torch::nn::Linear>(2048, 2048))) {}
  torch::Tensor forward(torch::Tensor x) { return b(torch::relu(a(x))); }
  paratrain::Unit<torch::nn::Linear> a, b;
};
TORCH_MODULE(Big);

}  // namespace

TEST_CASE("Bad checkpoints are a clear error on every rank, and the earlier checkpoint stays loadable") {
  using Ddp = paratrain::DataParallel<Mlp, comm::Mpi, torch::optim::SGD>;
  comm::Mpi c;
  const int w = c.size(), rank = c.rank();
  const auto dir = shared_dir(c, "bad");
  const Data d;
  const auto opts = torch::optim::SGDOptions(0.1).momentum(0.9);
  Ddp s(make_model({}, rank), c, opts);
  train(s, d, 0, 2);
  ckpt::save(s, dir, 2);
  const auto good = s.full_parameters();
  const auto step2 = ckpt::path_of(dir, 2);
  const auto loads_good = [&] {
    Ddp t(other_model(rank), c, opts);
    ckpt::load(t, step2);
    CHECK(max_relative_difference(t.full_parameters(), good) == 0);
  };
  // Each case damages a copy of the good checkpoint, so that it stays as it was.
  const auto damaged = dir / "step-000000003";
  const auto with_copy = [&](auto&& damage) {
    if (rank == 0) {
      fs::remove_all(damaged);
      fs::copy(step2, damaged);
      damage();
    }
    c.barrier();
  };
  const auto last_data = damaged / ckpt::detail::rank_data_name(w - 1);

  SUBCASE("a truncated data file") {
    with_copy([&] { fs::resize_file(last_data, fs::file_size(last_data) / 2); });
    check_error_names([&] { ckpt::load(s, damaged); }, last_data.filename().string() + ": has");
    check_error_names([&] { ckpt::load(s, damaged); }, "truncated");
  }
  SUBCASE("a flipped byte in a data file") {
    with_copy([&] { flip_byte(last_data, 3); });
    check_error_names([&] { ckpt::load(s, damaged); }, last_data.filename().string() + ": chunk 'model/");
    check_error_names([&] { ckpt::load(s, damaged); }, "fails its checksum");
  }
  SUBCASE("a flipped byte in a chunk table") {
    with_copy([&] { flip_byte(damaged / "rank-00000.pt", 100); });
    check_error_names([&] { ckpt::load(s, damaged); }, "rank-00000.pt: fails its checksum");
  }
  SUBCASE("a missing shard") {
    with_copy([&] { fs::remove(last_data); });
    check_error_names([&] { ckpt::load(s, damaged); }, last_data.filename().string() + ": is missing");
  }
  SUBCASE("a truncated index") {
    with_copy([&] { fs::resize_file(damaged / "index.pt", 40); });
    check_error_names([&] { ckpt::load(s, damaged); }, "index.pt: is not a paratrain checkpoint file");
  }
  SUBCASE("a checkpoint still being written (no index yet) is neither loaded nor the latest") {
    with_copy([&] {
      fs::remove(damaged / "index.pt");
      fs::rename(damaged, dir / ".step-000000003.partial");
      fs::create_directories(damaged);
      fs::copy(dir / ".step-000000003.partial", damaged);
    });
    check_error_names([&] { ckpt::load(s, damaged); }, "has no index.pt: the checkpoint is incomplete");
    CHECK(ckpt::latest(dir) == step2);
  }
  SUBCASE("a different model") {
    using Wider = paratrain::DataParallel<Mlp, comm::Mpi, torch::optim::SGD>;
    Wider with_head(make_model({.unused_parameter = true}, rank), c, opts,
                    {.find_unused_parameters = true});
    check_error_names([&] { ckpt::load(with_head, step2); }, "has no 'head.weight', which this model has");
    ckpt::save(with_head, dir / "head", 1);
    check_error_names([&] { ckpt::load(s, ckpt::path_of(dir / "head", 1)); }, "has 'head.bias', which this model lacks");
  }
  SUBCASE("another optimizer") {
    paratrain::DataParallel<Mlp, comm::Mpi, torch::optim::Adam> adam(make_model({}, rank), c, torch::optim::AdamOptions(1e-3));
    check_error_names([&] { ckpt::load(adam, step2); }, "holds the state of optimizer SGD, and this strategy's is Adam");
    ckpt::load(adam, step2, {.optimizer = false});  // the model alone
    CHECK(max_relative_difference(adam.full_parameters(), good) == 0);
  }
  SUBCASE("a shard only one rank reads is corrupt: every rank fails, naming it") {
    using Zero3 = paratrain::DataParallel<Mlp, comm::Mpi, Sharded<torch::optim::SGD, zero::stage3>>;
    Zero3 z(make_model({}, rank), c, opts);
    train(z, d, 0, 2);
    ckpt::save(z, dir / "z", 2);
    const auto shard = ckpt::path_of(dir / "z", 2) / ckpt::detail::rank_data_name(w - 1);
    if (rank == 0) flip_byte(shard, 0);
    c.barrier();
    // Only rank w - 1 reads that chunk; the others say it failed.
    check_error_names([&] { ckpt::load(z, ckpt::path_of(dir / "z", 2)); },
                      (rank == w - 1 ? "" : "rank " + std::to_string(w - 1) + " failed: ") + shard.string() + ": chunk");
  }
  SUBCASE("an unwritable directory") {
    if (rank == 0) std::ofstream(dir / "a-file") << "not a directory";
    c.barrier();
    check_error_names([&] { ckpt::save(s, dir / "a-file" / "ckpt", 3); }, "cannot create the checkpoint directory");
  }
  SUBCASE("a full disk: a write that fails midway leaves nothing behind") {
    // The file-size limit makes write() fail as a full disk does (EFBIG instead of ENOSPC).
    const auto old_handler = ::signal(SIGXFSZ, SIG_IGN);
    rlimit old{};
    ::getrlimit(RLIMIT_FSIZE, &old);
    rlimit small = old;
    small.rlim_cur = 256;
    if (rank == w - 1) ::setrlimit(RLIMIT_FSIZE, &small);
    check_error_names([&] { ckpt::save(s, dir, 3); }, "write failed: File too large");
    ::setrlimit(RLIMIT_FSIZE, &old);
    ::signal(SIGXFSZ, old_handler);
    c.barrier();
    CHECK(!fs::exists(ckpt::path_of(dir, 3)));
    CHECK(!fs::exists(dir / ".step-000000003.partial"));
  }
  if (rank == 0) fs::remove_all(damaged);
  c.barrier();
  loads_good();
  CHECK(ckpt::latest(dir) == step2);
  c.barrier();
  if (rank == 0) fs::remove_all(dir);
}

TEST_CASE("keep: the newest k checkpoints stay, the older ones and a killed writer's leftovers go") {
  comm::Mpi c;
  const auto dir = shared_dir(c, "keep");
  const Data d;
  paratrain::DataParallel<Mlp, comm::Mpi, torch::optim::SGD> s(make_model({}, c.rank()), c, torch::optim::SGDOptions(0.1));
  if (c.rank() == 0) fs::create_directories(dir / ".step-000000099.partial");
  c.barrier();
  ckpt::Checkpointer saver(s, {.directory = dir, .keep = 2, .async = true});
  for (int k = 1; k <= 5; ++k) {
    train(s, d, k - 1, k);
    saver.save(k);
  }
  saver.wait();
  CHECK(ckpt::list(dir) == std::vector<fs::path>{ckpt::path_of(dir, 4), ckpt::path_of(dir, 5)});
  CHECK(!fs::exists(dir / ".step-000000099.partial"));
  c.barrier();
  if (c.rank() == 0) fs::remove_all(dir);
}

TEST_CASE("The whole model in one file: from ZeRO-3, into DDP, equal to what every rank trained") {
  comm::Mpi c;
  const auto dir = shared_dir(c, "model-file");
  const Data d;
  paratrain::DataParallel<Mlp, comm::Mpi, Sharded<torch::optim::Adam, zero::stage3>> z(make_model({}, c.rank()), c,
                                                                                        torch::optim::AdamOptions(1e-2));
  train(z, d, 0, 3);
  ckpt::save_model(z, dir / "model.pt");
  paratrain::DataParallel<Mlp, comm::Mpi, torch::optim::Adam> ddp(other_model(c.rank()), c, torch::optim::AdamOptions(1e-2));
  ckpt::load_model(ddp, dir / "model.pt");
  CHECK(max_relative_difference(ddp.full_parameters(), z.full_parameters()) == 0);
  // Plain LibTorch reads it too: exactly the model's names, holding what single-device
  // training of the same 3 steps gives.
  std::ifstream in(dir / "model.pt", std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
  const auto dict = torch::pickle_load(bytes).toGenericDict();
  const auto want = reference_steps<torch::optim::Adam>(d, 3, torch::optim::AdamOptions(1e-2));
  const auto named = make_model({}, 0)->named_parameters();
  REQUIRE(dict.size() == named.size());
  std::vector<torch::Tensor> from_file;
  for (const auto& p : named) from_file.push_back(dict.at(p.key()).toTensor());
  CHECK(max_relative_difference(from_file, want) <= 1e-5);
  c.barrier();
  if (c.rank() == 0) fs::remove_all(dir);
}

// Run by ctest (tests/checkpoint/python_load.py checks the files with PyTorch): a ZeRO-3
// model's file, and inputs with the outputs paratrain predicts for them.
TEST_CASE("Export for the Python load test" * doctest::skip()) {
  const char* out = std::getenv("PARATRAIN_CHECKPOINT_EXPORT");
  REQUIRE(out != nullptr);
  comm::Mpi c;
  const Data d;
  paratrain::DataParallel<Mlp, comm::Mpi, Sharded<torch::optim::Adam, zero::stage3>> z(
      make_model({.buffer = true}, c.rank()), c, torch::optim::AdamOptions(1e-2));
  train(z, d, 0, 3);
  ckpt::save_model(z, fs::path(out) / "model.pt");
  const auto x = d.x.narrow(0, 1000, 16);
  const auto y = z.predict(x);
  if (c.rank() == 0) {
    c10::Dict<std::string, torch::Tensor> io;
    io.insert("input", x.contiguous());
    io.insert("output", y.contiguous());
    const auto bytes = torch::pickle_save(io);
    std::ofstream(fs::path(out) / "io.pt", std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  c.barrier();
}

// Run by ctest (tests/checkpoint/kill_during_write.sh): saves a large model again and
// again until a rank is killed with SIGKILL in the middle of a write.
TEST_CASE("Checkpoint writer for the kill test" * doctest::skip()) {
  const char* out = std::getenv("PARATRAIN_CHECKPOINT_KILL_DIR");
  REQUIRE(out != nullptr);
  comm::Mpi c;
  std::ofstream(fs::path(out) / ("pid-" + std::to_string(c.rank()))) << ::getpid();
  // PARATRAIN_CHECKPOINT_KILL_ASYNC=1: saved in the background (a Checkpointer with async),
  // as fit saves; a save waits for the one in flight, which it publishes, before it begins.
  const bool async = std::getenv("PARATRAIN_CHECKPOINT_KILL_ASYNC") != nullptr;
  const auto write = [&](auto& s) {
    const auto x = torch::randn({4, 2048});
    const auto mse = [](const torch::Tensor& a, const torch::Tensor& b) { return torch::mse_loss(a, b); };
    ckpt::Checkpointer saver(s, {.directory = fs::path(out) / "ckpt", .async = async});
    for (std::int64_t k = 1;; ++k) {
      s.step({x, x}, mse);
      saver.save(k);
    }
  };
  const std::string strategy = std::getenv("PARATRAIN_CHECKPOINT_KILL_STRATEGY") ? std::getenv("PARATRAIN_CHECKPOINT_KILL_STRATEGY") : "zero2";
  const auto adam = torch::optim::AdamOptions(1e-3);
  if (strategy == "ddp") {
    paratrain::DataParallel<Big, comm::Mpi, torch::optim::Adam> s(Big(), c, adam);
    write(s);
  } else if (strategy == "zero3") {
    paratrain::DataParallel<Big, comm::Mpi, Sharded<torch::optim::Adam, zero::stage3>> s(Big(), c, adam);
    write(s);
  } else {
    REQUIRE(strategy == "zero2");
    paratrain::DataParallel<Big, comm::Mpi, Sharded<torch::optim::Adam, zero::stage2>> s(Big(), c, adam);
    write(s);
  }
}

TEST_CASE("Checkpoint after the kill test" * doctest::skip()) {
  const char* out = std::getenv("PARATRAIN_CHECKPOINT_KILL_DIR");
  const char* killed = std::getenv("PARATRAIN_CHECKPOINT_KILLED_STEP");
  REQUIRE(out != nullptr);
  REQUIRE(killed != nullptr);
  comm::Mpi c;
  const auto latest = ckpt::latest(fs::path(out) / "ckpt");
  REQUIRE(latest.has_value());
  // Step N's save was begun only once N - 1 was published (in the background too).
  CHECK(ckpt::step_of(*latest) == std::atoll(killed) - 1);
  paratrain::DataParallel<Big, comm::Mpi, Sharded<torch::optim::Adam, zero::stage1>> s(Big(), c,
                                                                                       torch::optim::AdamOptions(1e-3));
  const auto loaded = ckpt::load(s, *latest);  // every chunk's checksum holds
  CHECK(loaded.step == std::atoll(killed) - 1);
  MESSAGE("loaded " << latest->string() << " after the kill");
}
