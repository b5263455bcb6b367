// comm::Nccl on every machine: its bootstrap (NCCL's unique id, broadcast over MPI by
// comm/nccl/bootstrap_over_mpi.hpp, agreed in a store, or given as a Nccl::Bootstrap), its
// refusal to start without a GPU, and every strategy instantiated over it. Its operations on
// GPUs are the GPU suite's (tests/gpu/nccl_gpu_test.cpp), which needs no MPI.
#include <torch/torch.h>

#include <mpi.h>
#include <nccl.h>

#include <cstring>
#include <filesystem>
#include <regex>
#include <string>
#include <tuple>
#include <vector>

#include "paratrain/checkpoint/checkpoint.hpp"
#include "paratrain/comm/nccl/bootstrap_over_mpi.hpp"
#include "paratrain/comm/nccl/bootstrap_over_store.hpp"
#include "paratrain/comm/nccl/nccl.hpp"
#include "paratrain/data/tensor_dataset.hpp"
#include "paratrain/pipeline/pipeline.hpp"
#include "paratrain/fit/fit.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "paratrain/concepts/communicator.hpp"
#include "support/doctest.hpp"
#include "support/shared_dir.hpp"

namespace comm = paratrain::comm;

static_assert(paratrain::communicator<comm::Nccl>);
static_assert(paratrain::sharding_communicator<comm::Nccl>);
static_assert(paratrain::point_to_point_communicator<comm::Nccl>);
static_assert(paratrain::async_communicator<comm::Nccl>);
static_assert(paratrain::async_all_to_all_communicator<comm::Nccl> && paratrain::explain_all_to_all_communicator<comm::Nccl>());
static_assert(paratrain::request<comm::Nccl::Request>);
static_assert(paratrain::explain_sharding_communicator<comm::Nccl>());
static_assert(paratrain::async_sharding_communicator<comm::Nccl>);
static_assert(paratrain::explain_async_sharding_communicator<comm::Nccl>());

namespace {

// Read at static initialisation, when doctest's skip() decorators are evaluated.
const bool no_gpu = comm::Nccl::device_count() == 0;

}  // namespace

// ---- every machine ------------------------------------------------------------------

// Every rank of `mpi` holds rank 0's id (not zeros), and the next id differs: NCCL draws a
// random magic number for every id, so a stale one would show.
template <class Bootstrap>
void check_unique_ids(comm::Mpi& mpi, Bootstrap& bootstrap) {
  const ncclUniqueId id = comm::Nccl::unique_id(bootstrap);
  static_assert(sizeof id == 128);
  std::vector<char> all(sizeof id * static_cast<std::size_t>(mpi.size()));
  REQUIRE(MPI_Allgather(&id, sizeof id, MPI_BYTE, all.data(), sizeof id, MPI_BYTE, mpi.native()) == MPI_SUCCESS);
  const std::string first(all.data(), sizeof id);
  CHECK(first != std::string(sizeof id, '\0'));
  for (int r = 0; r < mpi.size(); ++r) {
    CAPTURE(r);
    CHECK(std::string(all.data() + r * sizeof id, sizeof id) == first);
  }
  const ncclUniqueId again = comm::Nccl::unique_id(bootstrap);
  CHECK(std::memcmp(&again, &id, sizeof id) != 0);
}

TEST_CASE("comm::Nccl::unique_id gives every rank rank 0's 128 bytes, fresh on each call") {
  comm::Mpi mpi;
  check_unique_ids(mpi, mpi);
}

TEST_CASE("comm::Nccl started from a store: every rank gets rank 0's id, fresh on each call, without MPI") {
  comm::Mpi mpi;  // starts the processes and compares; the ids travel through the file
  const auto dir = paratrain_test::shared_dir(mpi, "nccl-store");
  {
    comm::Rendezvous meeting(
        {.rank = mpi.rank(), .world_size = mpi.size(), .local_rank = 0, .file = (dir / "store").string()});
    check_unique_ids(mpi, meeting);
  }
  paratrain_test::remove_shared_dir(mpi, dir);
}

TEST_CASE("comm::Nccl started from a store without a GPU throws on every rank, before NCCL" * doctest::skip(!no_gpu)) {
  comm::Mpi mpi;
  const auto dir = paratrain_test::shared_dir(mpi, "nccl-store-nogpu");
  int threw = 0;
  {
    comm::Rendezvous meeting(
        {.rank = mpi.rank(), .world_size = mpi.size(), .local_rank = 0, .file = (dir / "store").string()});
    try {
      comm::Nccl nccl(meeting);
    } catch (const paratrain::error& e) {
      threw = 1;
      CHECK(e.operation() == "comm::Nccl");
      CHECK(std::string(e.what()).find("no CUDA device is visible") != std::string::npos);
    }
  }
  int threw_on = 0;  // every rank threw, none is left waiting in ncclCommInitRank
  REQUIRE(MPI_Allreduce(&threw, &threw_on, 1, MPI_INT, MPI_SUM, mpi.native()) == MPI_SUCCESS);
  CHECK(threw_on == mpi.size());
  paratrain_test::remove_shared_dir(mpi, dir);
}

TEST_CASE("comm::Nccl::device_count() never throws and counts no more GPUs than /dev has") {
  int nodes = 0;  // /dev/nvidia0, /dev/nvidia1, ...: one per GPU the driver exposes
  if (std::filesystem::exists("/dev"))
    for (const auto& entry : std::filesystem::directory_iterator("/dev"))
      nodes += std::regex_match(entry.path().filename().string(), std::regex("nvidia[0-9]+")) ? 1 : 0;
  static_assert(noexcept(comm::Nccl::device_count()), "device_count() answers, it never throws");
  const int n = comm::Nccl::device_count();
  CHECK(n <= nodes);  // so 0 on a machine without a GPU
}

TEST_CASE("comm::Nccl without a GPU throws on every rank, naming the cause and the fix" * doctest::skip(!no_gpu)) {
  comm::Mpi mpi;
  for (const comm::Nccl::Options options : {comm::Nccl::Options{}, comm::Nccl::Options{.device = 0}}) {
    CAPTURE(options.device);
    int threw = 0;
    try {
      comm::Nccl nccl(mpi, options);
    } catch (const paratrain::error& e) {
      threw = 1;
      CHECK(e.operation() == "comm::Nccl");
      CHECK(e.rank() == mpi.rank());
      CHECK(std::string(e.what()).find("no CUDA device") != std::string::npos);
      CHECK(std::string(e.what()).find("use comm::Mpi for CPU tensors") != std::string::npos);
    }
    // Every rank threw, and none is left inside NCCL: otherwise this would hang.
    int threw_on = 0;
    REQUIRE(MPI_Allreduce(&threw, &threw_on, 1, MPI_INT, MPI_SUM, mpi.native()) == MPI_SUCCESS);
    CHECK(threw_on == mpi.size());
  }
}

TEST_CASE("comm::Nccl made from a Bootstrap checks it before any CUDA call, without MPI") {
  // On a machine without a GPU, a check after the first CUDA call would say "no CUDA device".
  comm::Nccl::Bootstrap b;
  b.rank = 2;
  b.size = 2;
  CHECK_THROWS_WITH_AS(comm::Nccl{b}, "paratrain: comm::Nccl on rank 2: Bootstrap::rank 2 is not in a world of 2 (0..1)",
                       paratrain::error);
  b.rank = 0;
  b.size = 0;
  CHECK_THROWS_WITH_AS(comm::Nccl{b}, doctest::Contains("Bootstrap::size 0 is not at least 1"), paratrain::error);
  b.size = 2;
  b.world_ranks = {5};
  CHECK_THROWS_WITH_AS(comm::Nccl{b}, doctest::Contains("Bootstrap::world_ranks names 1 ranks but size is 2"),
                       paratrain::error);
}

TEST_CASE("comm::Nccl made from a Bootstrap of one rank refuses to start without a GPU" * doctest::skip(!no_gpu)) {
  const comm::Nccl::Bootstrap alone;  // rank 0 of 1: nobody to wait for, no MPI involved
  CHECK_THROWS_WITH_AS(comm::Nccl{alone}, doctest::Contains("no CUDA device is visible"), paratrain::error);
}

// ---- every strategy over comm::Nccl compiles --------------------------------------------
// Instantiated on every machine with CUDA and NCCL, GPU or not: each strategy's whole training
// path as fit runs it (the batch's move to the model's device, forward, the bucketed backward
// hooks, the step, evaluation, the checkpoint's save and load), so code that cannot work with
// comm::Nccl fails this build, not a run on a GPU: DDP, ZeRO 1-3 (stage 3 gathers on a
// split), and pipelines (GPipe, 1F1B; replicated and sharded) over a store's bootstrap and
// MPI's. Run where there are GPUs: the [gpu] cases below and tests/gpu/.
namespace nccl_strategies {

struct NetImpl : torch::nn::Module {
  NetImpl() : fc(register_module("fc", torch::nn::Linear(4, 2))) {}
  at::Tensor forward(const at::Tensor& x) { return fc(x); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Net);

struct HalfImpl : torch::nn::Module {
  HalfImpl() : fc(register_module("fc", torch::nn::Linear(4, 4))) {}
  at::Tensor forward(const at::Tensor& x) { return torch::relu(fc(x)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(Half);

// Trains, saves into `dir` and loads back (the step's directory: checkpoint::save's layout).
template <class Strategy, class Model, class Bootstrap, class OptimOptions>
void train(Bootstrap& bootstrap, Model model, OptimOptions optimizer, const std::filesystem::path& dir) {
  Strategy s(std::move(model), comm::Nccl(bootstrap), optimizer);
  const paratrain::data::TensorDataset data(torch::randn({16, 4}), torch::randint(2, {16}));
  paratrain::fit(s, data, {.epochs = 1, .batch_size = 4, .eval = &data, .progress = false});
  paratrain::checkpoint::save(s, dir, /*step=*/1);
  paratrain::checkpoint::load(s, dir / "step-000000001");
}

template <class Update>
using Ddp = paratrain::DataParallel<Net, comm::Nccl, Update>;
template <class Update>
using Piped = paratrain::DataParallel<paratrain::Pipeline<Half, Net>, comm::Nccl, Update>;
using Sgd = torch::optim::SGDOptions;
using Adam = torch::optim::AdamOptions;
template <class O, int N>
using Zero = paratrain::Sharded<O, std::conditional_t<N == 1, paratrain::zero::stage1,
                                                      std::conditional_t<N == 2, paratrain::zero::stage2,
                                                                         paratrain::zero::stage3>>>;

// Referenced, so instantiated; never called here (Debian's LibTorch has no CUDA tensors to
// train on): tests/gpu/ trains them on a GPU.
[[maybe_unused]] constexpr auto strategies = std::make_tuple(
    &train<Ddp<torch::optim::SGD>, Net, comm::Mpi, Sgd>,
    &train<Ddp<Zero<torch::optim::SGD, 1>>, Net, comm::Rendezvous, Sgd>,
    &train<Ddp<Zero<torch::optim::Adam, 2>>, Net, comm::Mpi, Adam>,
    &train<Ddp<Zero<torch::optim::Adam, 3>>, Net, comm::Rendezvous, Adam>,
    &train<Piped<torch::optim::SGD>, paratrain::Pipeline<Half, Net>, comm::Mpi, Sgd>,
    &train<Piped<Zero<torch::optim::Adam, 3>>, paratrain::Pipeline<Half, Net>, comm::Rendezvous, Adam>);

}  // namespace nccl_strategies
