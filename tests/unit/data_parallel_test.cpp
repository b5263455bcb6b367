// The promise, for DataParallel: N ranks with per-rank batch b give, step by step, the
// parameters of single-device training with batch N*b over the same samples.
//
// The reference below is plain LibTorch (model, optimizer, loss.backward(), step) on
// the concatenated batch: independent of paratrain. Each rank's replica starts from a
// different initialisation (seed + rank), so the tests also check that rank 0's is
// broadcast; the reference starts from rank 0's.
#include <ATen/record_function.h>
#include <torch/torch.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/comm/single_device.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/strategy/local_data_parallel.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "paratrain/strategy/step_agreement.hpp"
#include "support/doctest.hpp"
#include "support/equivalence.hpp"

namespace {

namespace comm = paratrain::comm;
using namespace paratrain_test;

template <class Comm>
void check_equivalence(const Scenario& s) {
  Comm c;
  const int world = c.size();
  CAPTURE(world);
  {
    const auto opts = torch::optim::SGDOptions(0.1).momentum(0.9);
    const auto want = reference<torch::optim::SGD>(s, world, opts);
    const auto got = distributed<Comm, torch::optim::SGD>(s, Comm(), opts);
    CHECK(max_relative_difference(got, want) <= 1e-5);
  }
  {
    const auto opts = torch::optim::AdamOptions(1e-2);
    const auto want = reference<torch::optim::Adam>(s, world, opts);
    const auto got = distributed<Comm, torch::optim::Adam>(s, Comm(), opts);
    CHECK(max_relative_difference(got, want) <= 1e-5);
  }
}

}  // namespace

TEST_CASE_TEMPLATE("DataParallel equals single-device training on the union of the ranks' batches", C,
                   comm::SingleDevice, comm::Mpi) {
  SUBCASE("plain") { check_equivalence<C>({}); }
  SUBCASE("gradient accumulation over 2 and 4 micro-batches") {
    check_equivalence<C>({.batch = 4, .micro_batches = 2});
    check_equivalence<C>({.batch = 8, .micro_batches = 4});
  }
  SUBCASE("an unused parameter, with find_unused_parameters") {
    check_equivalence<C>({.features = {.unused_parameter = true}, .options = {.find_unused_parameters = true}});
  }
  SUBCASE("uneven inputs: rank r has r fewer batches, joined") { check_equivalence<C>({.uneven = true}); }
  SUBCASE("a buffer, broadcast from rank 0") { check_equivalence<C>({.features = {.buffer = true}}); }
  SUBCASE("small buckets: one parameter per bucket") {
    check_equivalence<C>({.options = {.bucket_cap_bytes = 1, .first_bucket_cap_bytes = 1}});
  }
}

TEST_CASE_TEMPLATE("DataParallel names an unused parameter on every rank instead of hanging", C, comm::SingleDevice,
                   comm::Mpi) {
  const Data data;
  C c;
  const int world = c.size(), rank = c.rank();
  paratrain::DataParallel<Mlp, C, torch::optim::SGD> dp(make_model({.unused_parameter = true}, rank), std::move(c),
                                                        torch::optim::SGDOptions(0.1));
  CHECK_THROWS_WITH_AS(dp.step(data.of(world, rank, 0, 4), loss_fn), doctest::Contains("find_unused_parameters"),
                       paratrain::error);
  // The ranks are still in step afterwards: a normal step on the used parameters works... after
  // enabling nothing, the same step throws again, on every rank, rather than deadlocking.
  CHECK_THROWS_WITH_AS(dp.step(data.of(world, rank, 1, 4), loss_fn), doctest::Contains("head"), paratrain::error);
}

TEST_CASE("DataParallel without join: different batch counts are an error on every rank") {
  const Data data;
  comm::Mpi c;
  const int world = c.size(), rank = c.rank();
  if (world == 1) return;
  paratrain::DataParallel<Mlp, comm::Mpi, torch::optim::SGD> dp(make_model({}, rank), std::move(c),
                                                                torch::optim::SGDOptions(0.1), {.join = false});
  // Rank 0 says it has no next batch, the others say they have.
  CHECK_THROWS_WITH_AS(dp.step(data.of(world, rank, 0, 4), loss_fn, rank != 0),
                       doctest::Contains("ranks have another batch"), paratrain::error);
}

TEST_CASE("DataParallel buckets follow the caps, in reverse parameter order") {
  comm::SingleDevice c;
  paratrain::DataParallel<Mlp, comm::SingleDevice, torch::optim::SGD> one(make_model({}, 0), c,
                                                                           torch::optim::SGDOptions(0.1));
  CHECK(one.bucket_count() == 1);  // 8*16+16+16*4+4 floats: well under 1 MiB
  paratrain::DataParallel<Mlp, comm::SingleDevice, torch::optim::SGD> each(
      make_model({}, 0), c, torch::optim::SGDOptions(0.1), {.bucket_cap_bytes = 1, .first_bucket_cap_bytes = 1});
  CHECK(each.bucket_count() == 4);
}

namespace {

// LocalDataParallel clones its model: the same network, as a Cloneable.
struct CloneableMlpImpl : torch::nn::Cloneable<CloneableMlpImpl> {
  CloneableMlpImpl() { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::tanh(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(CloneableMlp);

template <class Optim, class Opts>
void check_local(int replicas, std::int64_t batch, int micro_batches, Opts opts) {
  CAPTURE(replicas);
  CAPTURE(batch);
  CAPTURE(micro_batches);
  const Data data;
  torch::manual_seed(5);
  CloneableMlp reference_model;
  torch::manual_seed(5);
  // On CPU threads, so that `replicas` of them exist on a machine with GPUs too.
  paratrain::LocalDataParallel<CloneableMlp, Optim> dp(CloneableMlp(), opts, {.replicas = replicas, .cpu = true});
  REQUIRE(dp.replicas() == replicas);
  Optim reference_optim(reference_model->parameters(), opts);
  for (int k = 0; k < 20; ++k) {
    const auto b = data.of(1, 0, k, batch);
    const auto micro = batch / micro_batches;
    for (int m = 0; m + 1 < micro_batches; ++m)
      dp.accumulate({b.input().narrow(0, m * micro, micro), b.target.narrow(0, m * micro, micro)}, loss_fn);
    const auto last = (micro_batches - 1) * micro;
    dp.step({b.input().narrow(0, last, batch - last), b.target.narrow(0, last, batch - last)}, loss_fn);
    reference_optim.zero_grad();
    loss_fn(reference_model->forward(b.input()), b.target).backward();
    reference_optim.step();
  }
  CHECK(max_relative_difference(dp.model()->parameters(), reference_model->parameters()) <= 1e-5);
}

}  // namespace

TEST_CASE("LocalDataParallel (DP) equals single-device training on the whole batch") {
  for (int replicas : {1, 2, 3}) {
    check_local<torch::optim::SGD>(replicas, 8, 1, torch::optim::SGDOptions(0.1).momentum(0.9));  // 3: split 3/3/2
    check_local<torch::optim::Adam>(replicas, 8, 1, torch::optim::AdamOptions(1e-2));
    check_local<torch::optim::Adam>(replicas, 8, 2, torch::optim::AdamOptions(1e-2));
  }
  check_local<torch::optim::SGD>(4, 2, 1, torch::optim::SGDOptions(0.1));  // fewer samples than replicas
}

namespace {

std::vector<double> entries(paratrain::StepAgreement& a) {
  const auto& v = a.values();
  return {v.data_ptr<double>(), v.data_ptr<double>() + v.numel()};
}

}  // namespace

// Note [Step agreement], alone: three ranks' vectors built, summed as the all-reduce would
// and read back, against sums worked out by hand.
TEST_CASE("StepAgreement packs each rank's facts and reads their sums") {
  // 3 parameters, use tracked. Rank 0: 4 samples, a next batch, used parameters 0 and 2.
  // Rank 1: 3 samples, a next batch, found an unused parameter, used parameter 2.
  // Rank 2: joined (0 samples), no next batch, used nothing.
  std::vector<paratrain::StepAgreement> ranks;
  for (int r = 0; r < 3; ++r) ranks.emplace_back(3, /*track_use=*/true);
  ranks[0].set(4, /*has_next=*/true, /*unused=*/false, /*failed=*/false);
  ranks[0].mark_used(0);
  ranks[0].mark_used(2);
  ranks[1].set(3, true, true, false);
  ranks[1].mark_used(2);
  ranks[2].set(0, false, false, false);
  // [samples, has_next, unused, failed, used 0, used 1, used 2]
  CHECK(entries(ranks[0]) == std::vector<double>{4, 1, 0, 0, 1, 0, 1});
  CHECK(entries(ranks[1]) == std::vector<double>{3, 1, 1, 0, 0, 0, 1});
  CHECK(entries(ranks[2]) == std::vector<double>{0, 0, 0, 0, 0, 0, 0});

  SUBCASE("summed") {
    const auto sum = ranks[0].values() + ranks[1].values() + ranks[2].values();
    for (auto& a : ranks) {
      a.values().copy_(sum);
      CHECK(a.samples() == 7);
      CHECK(a.ranks_with_next() == 2);
      CHECK(a.ranks_with_unused() == 1);
      CHECK(a.ranks_failed() == 0);
      CHECK(a.used_anywhere(0));
      CHECK_FALSE(a.used_anywhere(1));
      CHECK(a.used_anywhere(2));
      const auto s = a.status();
      CHECK(s.samples == 7);
      CHECK(s.ranks_with_next == 2);
      CHECK(s.ranks_failed == 0);
    }
  }
  SUBCASE("a rank that failed: the status says only how many did") {
    ranks[2].set(0, false, false, /*failed=*/true);
    const auto sum = ranks[0].values() + ranks[1].values() + ranks[2].values();
    ranks[1].values().copy_(sum);
    const auto s = ranks[1].status();
    CHECK(s.ranks_failed == 1);
    CHECK(s.samples == 7);
    CHECK(s.ranks_with_next == 2);
  }
  SUBCASE("without tracking, no per-parameter entries, and every parameter counts as used") {
    paratrain::StepAgreement a(3, /*track_use=*/false);
    a.set(5, false, false, false);
    a.mark_used(1);  // ignored
    CHECK(entries(a) == std::vector<double>{5, 0, 0, 0});
    CHECK(a.used_anywhere(0));
    CHECK(a.used_anywhere(2));
  }
}

TEST_CASE("StepAgreement summed over the ranks of comm::Mpi") {
  comm::Mpi c;
  const int n = c.size(), r = c.rank();
  CAPTURE(n);
  // Rank r: r + 1 samples, a next batch on even ranks, the last rank of several found an
  // unused parameter, parameter 0 used by rank 0 only, parameter 1 by none.
  paratrain::StepAgreement a(2, /*track_use=*/true);
  a.set(r + 1, r % 2 == 0, n > 1 && r == n - 1, false);
  if (r == 0) a.mark_used(0);
  c.all_reduce(a.values(), paratrain::reduce_op::sum);
  // Closed forms: 1 + 2 + ... + n samples; ceil(n / 2) even ranks; one unused parameter
  // once there are several ranks (np 1, 2, 4: samples 1, 3, 10; next 1, 1, 2; unused 0, 1, 1).
  CHECK(a.samples() == n * (n + 1) / 2);
  CHECK(a.ranks_with_next() == (n + 1) / 2);
  CHECK(a.ranks_with_unused() == (n > 1 ? 1 : 0));
  CHECK(a.ranks_failed() == 0);
  CHECK(a.used_anywhere(0));
  CHECK_FALSE(a.used_anywhere(1));
}

// ---- Note [One move per batch] ----------------------------------------------------------
// Without a GPU the move cannot change a tensor's device, so it is observed where it is made:
// LibTorch's own profiling hook (RecordFunction) sees every `aten::to` call of this thread
// with its arguments. The strategy must ask, once per batch tensor, for the model's device;
// with the move left out, a CUDA model would get host tensors at its first forward.
//
// Only where NDEBUG is defined, as it was for LibTorch's own build: without it
// ATen/record_function.h declares a debug-only member, so RecordFunction's layout here would
// not be the library's (the sanitizer build, scripts/sanitize.sh, has no NDEBUG; UBSan caught
// inputs() reading that member from the library's object).
#ifdef NDEBUG

namespace {

// Each tensor (by its data) that was asked to go to a device, with the devices asked for.
class MoveRecorder {
 public:
  MoveRecorder() {
    handle_ = at::addThreadLocalCallback(
        at::RecordFunctionCallback(
            [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
              if (std::string_view(fn.name()) != "aten::to" || current_ == nullptr) return nullptr;
              const auto inputs = fn.inputs();
              if (inputs.empty() || !inputs[0].isTensor()) return nullptr;
              for (const auto& v : inputs)
                if (v.isDevice()) current_->moves_[inputs[0].toTensor().data_ptr()].push_back(v.toDevice());
              return nullptr;
            })
            .needsInputs(true));
    current_ = this;
  }
  MoveRecorder(const MoveRecorder&) = delete;
  MoveRecorder& operator=(const MoveRecorder&) = delete;
  ~MoveRecorder() {
    current_ = nullptr;
    at::removeCallback(handle_);
  }
  /// The devices `t` was asked to go to, in order.
  [[nodiscard]] std::vector<c10::Device> of(const at::Tensor& t) const {
    const auto it = moves_.find(t.data_ptr());
    return it == moves_.end() ? std::vector<c10::Device>{} : it->second;
  }
  [[nodiscard]] std::size_t tensors() const { return moves_.size(); }

 private:
  static inline thread_local MoveRecorder* current_ = nullptr;
  at::CallbackHandle handle_;
  std::map<const void*, std::vector<c10::Device>> moves_;
};

template <class Update>
void check_one_move_per_batch() {
  using Strategy = paratrain::DataParallel<Mlp, comm::Mpi, Update>;
  Strategy s(Mlp(Features{}, 0), comm::Mpi(), torch::optim::SGDOptions(0.1).momentum(0.9));
  CHECK(s.device() == torch::Device(torch::kCPU));
  const auto loss = [](const at::Tensor& out, const at::Tensor& y) { return torch::mse_loss(out, y); };
  std::vector<paratrain::Batch> batches;
  for (int i = 0; i < 3; ++i) batches.emplace_back(torch::randn({2 + i, 8}), torch::randn({2 + i, 4}));

  {  // one step over three micro-batches: each input and each target moved once
    const MoveRecorder moves;
    s.step(std::span<const paratrain::Batch>(batches), loss);
    for (const auto& b : batches) {
      CHECK(moves.of(b.input()) == std::vector<c10::Device>{s.device()});
      CHECK(moves.of(b.target) == std::vector<c10::Device>{s.device()});
    }
  }
  {  // one batch, and a prediction: its inputs once, no target asked for
    const MoveRecorder moves;
    s.step(batches[0], loss);
    CHECK(moves.of(batches[0].input()) == std::vector<c10::Device>{s.device()});
    CHECK(moves.of(batches[0].target) == std::vector<c10::Device>{s.device()});
  }
  {
    const MoveRecorder moves;
    static_cast<void>(s.predict(batches[1]));
    CHECK(moves.of(batches[1].input()) == std::vector<c10::Device>{s.device()});
    CHECK(moves.of(batches[1].target).empty());
  }
}

}  // namespace

TEST_CASE("DataParallel moves each batch tensor to the model's device once (Note [One move per batch])") {
  SUBCASE("DDP") { check_one_move_per_batch<torch::optim::SGD>(); }
  SUBCASE("ZeRO-3") { check_one_move_per_batch<paratrain::Sharded<torch::optim::SGD, paratrain::zero::stage3>>(); }
}

TEST_CASE("Batch::to asks for the device for every tensor and leaves undefined ones undefined") {
  const paratrain::Batch b({torch::ones({2, 3}), torch::zeros({2})}, at::Tensor());
  const MoveRecorder moves;
  const auto moved = b.to(torch::kCPU);
  REQUIRE(moved.inputs.size() == 2);
  CHECK(moves.of(b.inputs[0]) == std::vector<c10::Device>{torch::Device(torch::kCPU)});
  CHECK(moves.of(b.inputs[1]) == std::vector<c10::Device>{torch::Device(torch::kCPU)});
  CHECK(moves.tensors() == 2);  // the undefined target was not touched
  CHECK(!moved.target.defined());
  CHECK(torch::equal(moved.inputs[0], b.inputs[0]));
}
#endif  // NDEBUG
