// Hostile inputs: what one rank is given and the others are not (another model, a batch
// no strategy can use, NaN), or launcher variables that contradict the MPI world, is an
// error on every rank that names the problem, never a hang or a silently wrong model.
// The expectations are independent of paratrain's code: the shapes the test builds, the
// step it poisons, and parameters that a skipped step must leave exactly as they were.
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/comm/launch.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/strategy/local_data_parallel.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "support/doctest.hpp"
#include "support/equivalence.hpp"

namespace {

namespace comm = paratrain::comm;
namespace zero = paratrain::zero;
using namespace paratrain_test;
using Zero2 = paratrain::Sharded<torch::optim::SGD, zero::stage2>;
using Zero3 = paratrain::Sharded<torch::optim::SGD, zero::stage3>;

// Mlp with a hidden layer of any width.
struct WidthImpl : torch::nn::Module {
  explicit WidthImpl(int hidden) {
    fc1 = register_module("fc1", paratrain::Unit<torch::nn::Linear>(8, hidden));
    fc2 = register_module("fc2", paratrain::Unit<torch::nn::Linear>(hidden, 4));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::tanh(fc1(x))); }
  paratrain::Unit<torch::nn::Linear> fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Width);

bool all_finite(const std::vector<torch::Tensor>& ts) {
  for (const auto& t : ts)
    if (!torch::isfinite(t).all().item<bool>()) return false;
  return true;
}

}  // namespace

TEST_CASE_TEMPLATE("replicas built differently are an error on every rank that names the difference", U,
                   torch::optim::SGD, Zero3) {
  comm::Mpi c;
  if (c.size() < 2) return;
  const int last = c.size() - 1;
  using S = paratrain::DataParallel<Width, comm::Mpi, U>;
  SUBCASE("a layer of another width on the last rank") {
    const auto what = error_of([&] { S s(Width(c.rank() == last ? 17 : 16), c, torch::optim::SGDOptions(0.1)); });
    CAPTURE(what);
    CHECK(what.find("the ranks built different models") != std::string::npos);
    CHECK(what.find("rank 0's model is 'parameter fc1.weight Float [16, 8]' but of rank " + std::to_string(last) +
                    "'s 'parameter fc1.weight Float [17, 8]'") != std::string::npos);
  }
  SUBCASE("a buffer on the last rank only") {
    using M = paratrain::DataParallel<Mlp, comm::Mpi, U>;
    const auto what = error_of(
        [&] { M s(make_model({.buffer = c.rank() == last}, c.rank()), c, torch::optim::SGDOptions(0.1)); });
    CAPTURE(what);
    CHECK(what.find("rank " + std::to_string(last) +
                    "'s model has 5 entries, rank 0's 4: the first extra one is 'buffer scale Float [8]'") !=
          std::string::npos);
  }
  // The ranks are still in step: the same model everywhere constructs.
  CHECK_NOTHROW(S(Width(16), c, torch::optim::SGDOptions(0.1)));
}

TEST_CASE_TEMPLATE("NaN gradients: skipped alike on every rank, or a stop that names the step", U, torch::optim::SGD,
                   Zero2, Zero3) {
  comm::Mpi c;
  const int world = c.size(), rank = c.rank();
  const Data data;
  using S = paratrain::DataParallel<Mlp, comm::Mpi, U>;
  constexpr bool sharded = !std::is_same_v<U, torch::optim::SGD>;
  // Rank r's batch has 3 + r samples. At step 2 the last rank's gradient of fc2.bias alone is
  // NaN: averaged, it is NaN on every rank, in the one shard that holds fc2.bias (the first
  // parameter of the first bucket: rank 0's) when sharded, so the others learn it only
  // from the ranks' agreement.
  const auto step = [&](auto& s, int k) {
    const auto b = data.of(world, rank, k, 3 + rank, 3 + world);
    if (k != 2 || rank != world - 1) return s.step(b, loss_fn);
    auto& bias = s.model()->fc2->bias;
    const auto hook = bias.register_hook([](const torch::Tensor& g) { return torch::full_like(g, std::nan("")); });
    const auto r = s.step(b, loss_fn);
    bias.remove_hook(hook);
    return r;
  };
  const auto opts = torch::optim::SGDOptions(0.1).momentum(0.9);
  SUBCASE("skip: the poisoned step leaves every parameter as it was, and training goes on") {
    S s(make_model({}, rank), c, opts, {.nonfinite_gradients = paratrain::NonFinite::skip});
    for (int k = 0; k < 5; ++k) {
      CAPTURE(k);
      const auto before = s.full_parameters();
      const auto r = step(s, k);
      const auto after = s.full_parameters();
      CHECK(r.skipped == (k == 2));
      CHECK(all_finite(after));
      if (k == 2) CHECK(max_relative_difference(after, before) == 0);
      else CHECK(max_relative_difference(after, before) > 0);
    }
  }
  SUBCASE("stop: every rank throws at the poisoned step, naming it") {
    S s(make_model({}, rank), c, opts, {.nonfinite_gradients = paratrain::NonFinite::stop});
    CHECK_NOTHROW(step(s, 0));
    CHECK_NOTHROW(step(s, 1));
    const auto what = error_of([&] { step(s, 2); });
    CAPTURE(what);
    CHECK(what.find("the averaged gradients of step 3 (counted from 1) hold NaN or Inf") != std::string::npos);
    // Replicated gradients are whole on every rank; sharded, only rank 0 holds fc2.bias's.
    if (!sharded || rank == 0) CHECK(what.find("first in parameter 'fc2.bias'") != std::string::npos);
    else CHECK(what.find("in a part of the model another rank holds") != std::string::npos);
  }
  SUBCASE("apply, the default: the NaN reaches the parameters, as in PyTorch") {
    S s(make_model({}, rank), c, opts);
    for (int k = 0; k < 3; ++k) step(s, k);
    CHECK_FALSE(all_finite(s.full_parameters()));
  }
}

TEST_CASE_TEMPLATE("a batch one rank cannot use is an error on every rank, and the ranks stay in step", U,
                   torch::optim::SGD, Zero3) {
  comm::Mpi c;
  const int world = c.size(), rank = c.rank(), last = world - 1;
  const Data data;
  paratrain::DataParallel<Mlp, comm::Mpi, U> s(make_model({}, rank), c, torch::optim::SGDOptions(0.1));
  // The rank names its problem; the others say a rank could not use its batch: below
  // stage 3 after the step ("see their message"), at stage 3 before it, quoting the rank.
  const auto expect = [&](const std::string& what, const std::string& on_last) {
    CAPTURE(what);
    if (rank == last) CHECK(what.find(on_last) != std::string::npos);
    else if (std::is_same_v<U, Zero3>) CHECK(what.find("rank " + std::to_string(last) + " failed: " + on_last) != std::string::npos);
    else CHECK(what.find("other rank(s) were given a batch they cannot use") != std::string::npos);
  };
  SUBCASE("targets for fewer samples than the inputs") {
    auto b = data.of(world, rank, 0, 4);
    if (rank == last) b.target = b.target.narrow(0, 0, 3);
    expect(error_of([&] { s.step(b, loss_fn); }), "the batch's inputs hold 4 samples and its targets 3 samples");
  }
  SUBCASE("a scalar input among accumulated micro-batches") {
    std::vector<paratrain::Batch> micro{data.of(world, rank, 0, 2), data.of(world, rank, 1, 2)};
    if (rank == last) micro[1].inputs[0] = torch::zeros({});
    expect(error_of([&] { s.step(std::span<const paratrain::Batch>(micro), loss_fn); }),
           "the batch's input 0 is a scalar");
  }
  CHECK_NOTHROW(s.step(data.of(world, rank, 2, 4), loss_fn));
  CHECK(all_finite(s.full_parameters()));
}

TEST_CASE("LocalDataParallel names a batch it cannot split over its replicas") {
  paratrain::LocalDataParallel<torch::nn::Linear, torch::optim::SGD> s(torch::nn::Linear(8, 4), torch::optim::SGDOptions(0.1),
                                                    {.replicas = 2});
  const paratrain::Batch b{torch::randn({4, 8}), torch::zeros({3}, torch::kLong)};
  CHECK_THROWS_WITH_AS(s.step(std::span<const paratrain::Batch>(&b, 1), loss_fn),
                       doctest::Contains("targets 3 samples (dimension 0): it cannot be split over the replicas"),
                       paratrain::error);
}

TEST_CASE("launcher variables that contradict the MPI world are named") {
  using paratrain::contradiction_with_mpi;
  const paratrain::Placement torchrun{.rank = 0, .world_size = 2, .launcher = "torchrun"};
  // RANK=0 WORLD_SIZE=2 exported around `mpirun -np 2`: rank 1 reads rank 0.
  CHECK(contradiction_with_mpi(torchrun, 1, 2) ==
        "the launcher variables (torchrun) say this process is rank 0 of 2, but MPI says rank 1 of 2: RANK and "
        "WORLD_SIZE were set for another launch (exported around mpirun or srun?); unset them");
  CHECK(contradiction_with_mpi(torchrun, 0, 2).empty());
  // A comm::Mpi program started by torchrun: each process an MPI world of one.
  CHECK(contradiction_with_mpi({.rank = 1, .world_size = 2, .launcher = "torchrun"}, 0, 1).find(
            "under torchrun use comm::Gloo") != std::string::npos);
  // A batch script's own process sees SLURM_PROCID=0 of the allocation's tasks: legitimate.
  CHECK(contradiction_with_mpi({.rank = 0, .world_size = 4, .launcher = "slurm"}, 0, 1).empty());
  CHECK(contradiction_with_mpi({.rank = 2, .world_size = 4, .launcher = "pmix"}, 1, 4).find("another launch") !=
        std::string::npos);
  CHECK(contradiction_with_mpi({}, 3, 4).empty());  // no launcher variables at all
  // And this very process, under ctest's mpirun, agrees with its world.
  comm::Mpi c;
  CHECK(contradiction_with_mpi(paratrain::detect_placement(), c.rank(), c.size()).empty());
}
