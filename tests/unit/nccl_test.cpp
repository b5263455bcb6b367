// comm::Nccl. Its bootstrap (NCCL's unique id, broadcast over MPI by
// comm/nccl/bootstrap_over_mpi.hpp, or given as a Nccl::Bootstrap) and its refusal to start without
// a GPU run on every machine. The collectives, tagged [gpu], skip
// themselves where no CUDA device is visible; they use comm_test.cpp's formula (rank r
// holds f(r, i) = i % 7 + r + 1, the expectation is computed on the host). Debian's
// LibTorch has no CUDA, so device buffers are cudaMalloc'd and filled by cudaMemcpy
// from CPU tensors: Note [NCCL without CUDA-enabled LibTorch].
#include <torch/torch.h>

#include <cuda_runtime.h>
#include <mpi.h>
#include <nccl.h>

#include <algorithm>
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
#include "support/collectives.hpp"
#include "support/doctest.hpp"
#include "support/shared_dir.hpp"

using paratrain::reduce_op;
namespace comm = paratrain::comm;

static_assert(paratrain::communicator<comm::Nccl>);
static_assert(paratrain::sharding_communicator<comm::Nccl>);
static_assert(paratrain::point_to_point_communicator<comm::Nccl>);
static_assert(paratrain::async_communicator<comm::Nccl>);
static_assert(paratrain::request<comm::Nccl::Request>);
static_assert(paratrain::explain_sharding_communicator<comm::Nccl>());
static_assert(paratrain::async_sharding_communicator<comm::Nccl>);
static_assert(paratrain::explain_async_sharding_communicator<comm::Nccl>());

namespace {

// Read at static initialisation, when doctest's skip() decorators are evaluated.
const bool no_gpu = comm::Nccl::device_count() == 0;

// The formula-based values and expectations every communicator's tests share.
using collectives::all_dtypes;
using collectives::expected;
using collectives::values;

// NCCL averages floating-point buffers by multiplying each input by 1/size before the
// sum, which is exact only where size is a power of two; elsewhere allow 16-bit rounding.
bool matches(const torch::Tensor& actual, const torch::Tensor& want, reduce_op op) {
  if (op != reduce_op::average) return torch::equal(actual, want);
  return torch::allclose(actual.to(torch::kDouble), want.to(torch::kDouble), /*rtol=*/2e-2, /*atol=*/0);
}

std::string describe(reduce_op op, torch::Dtype dtype, std::int64_t n) {
  return std::string(paratrain::to_string(op)) + " " + std::string(c10::toString(dtype)) + " n=" + std::to_string(n);
}

/// A cudaMalloc'd copy of a contiguous CPU tensor; to_host() copies it back.
class DeviceBuffer {
 public:
  explicit DeviceBuffer(const torch::Tensor& host) : like_(host), bytes_(host.numel() * host.element_size()) {
    REQUIRE(cudaMalloc(&data_, std::max<std::size_t>(bytes_, 1)) == cudaSuccess);
    REQUIRE(cudaMemcpy(data_, host.data_ptr(), bytes_, cudaMemcpyHostToDevice) == cudaSuccess);
  }
  DeviceBuffer(std::int64_t n, torch::Dtype dtype) : DeviceBuffer(torch::zeros({n}, dtype)) {}
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { cudaFree(data_); }

  [[nodiscard]] void* get() const { return data_; }
  [[nodiscard]] std::size_t count() const { return static_cast<std::size_t>(like_.numel()); }
  [[nodiscard]] torch::Tensor to_host() const {
    auto t = torch::empty_like(like_);
    REQUIRE(cudaMemcpy(t.data_ptr(), data_, bytes_, cudaMemcpyDeviceToHost) == cudaSuccess);
    return t;
  }

 private:
  torch::Tensor like_;
  std::size_t bytes_;
  void* data_ = nullptr;
};

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
  comm::Rendezvous meeting({.rank = mpi.rank(), .world_size = mpi.size(), .local_rank = 0, .file = (dir / "store").string()});
  check_unique_ids(mpi, meeting);
}

TEST_CASE("comm::Nccl started from a store without a GPU throws on every rank, before NCCL" * doctest::skip(!no_gpu)) {
  comm::Mpi mpi;
  const auto dir = paratrain_test::shared_dir(mpi, "nccl-store-nogpu");
  comm::Rendezvous meeting({.rank = mpi.rank(), .world_size = mpi.size(), .local_rank = 0, .file = (dir / "store").string()});
  int threw = 0;
  try {
    comm::Nccl nccl(meeting);
  } catch (const paratrain::error& e) {
    threw = 1;
    CHECK(e.operation() == "comm::Nccl");
    CHECK(std::string(e.what()).find("no CUDA device is visible") != std::string::npos);
  }
  int threw_on = 0;  // every rank threw, none is left waiting in ncclCommInitRank
  REQUIRE(MPI_Allreduce(&threw, &threw_on, 1, MPI_INT, MPI_SUM, mpi.native()) == MPI_SUCCESS);
  CHECK(threw_on == mpi.size());
}

TEST_CASE("comm::Nccl::device_count() never throws and counts no more GPUs than /dev has") {
  int nodes = 0;  // /dev/nvidia0, /dev/nvidia1, ...: one per GPU the driver exposes
  if (std::filesystem::exists("/dev"))
    for (const auto& entry : std::filesystem::directory_iterator("/dev"))
      nodes += std::regex_match(entry.path().filename().string(), std::regex("nvidia[0-9]+")) ? 1 : 0;
  int n = -1;
  CHECK_NOTHROW(n = comm::Nccl::device_count());
  CHECK(n >= 0);
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

template <class Strategy, class Model, class Bootstrap, class OptimOptions>
void train(Bootstrap& bootstrap, Model model, OptimOptions optimizer) {
  Strategy s(std::move(model), comm::Nccl(bootstrap), optimizer);
  const paratrain::data::TensorDataset data(torch::randn({16, 4}), torch::randint(2, {16}));
  paratrain::fit(s, data, {.epochs = 1, .batch_size = 4, .eval = &data, .progress = false});
  paratrain::checkpoint::save(s, "nccl_checkpoint", /*step=*/1);
  paratrain::checkpoint::load(s, "nccl_checkpoint");
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

// ---- GPUs only ------------------------------------------------------------------------

TEST_CASE("[gpu] comm::Nccl: all_reduce matches the formula for every dtype and op" * doctest::skip(no_gpu)) {
  comm::Mpi mpi;
  comm::Nccl c(mpi);
  for (auto dtype : all_dtypes)
    for (auto op : {reduce_op::sum, reduce_op::average, reduce_op::max, reduce_op::min})
      for (std::int64_t n : {std::int64_t{1}, std::int64_t{1001}, std::int64_t{(16 << 20) / 4 + 7}}) {
        if (op == reduce_op::average && !torch::isFloatingType(dtype)) continue;
        if (n > 2000 && (dtype != torch::kFloat32 || op != reduce_op::sum)) continue;  // one large case
        CAPTURE(describe(op, dtype, n));
        DeviceBuffer buffer(values(c.rank(), n, dtype));
        auto request = c.iall_reduce(buffer.get(), buffer.count(), dtype, op);
        if (n == 1001) {
          while (!request.test()) {
          }
        }
        request.wait();
        CHECK(matches(buffer.to_host(), expected(op, c.size(), n, dtype), op));
      }
}

TEST_CASE("[gpu] comm::Nccl: broadcast copies the root's buffer to every rank" * doctest::skip(no_gpu)) {
  comm::Mpi mpi;
  comm::Nccl c(mpi);
  const int root = c.size() - 1;
  for (auto dtype : all_dtypes) {
    CAPTURE(c10::toString(dtype));
    DeviceBuffer buffer(c.rank() == root ? values(root, 1001, dtype) : torch::zeros({1001}, dtype));
    c.ibroadcast(buffer.get(), buffer.count(), dtype, root).wait();
    CHECK(torch::equal(buffer.to_host(), values(root, 1001, dtype)));
  }
}

TEST_CASE("[gpu] comm::Nccl: reduce_scatter and all_gather split and join in rank order" * doctest::skip(no_gpu)) {
  comm::Mpi mpi;
  comm::Nccl c(mpi);
  for (auto dtype : all_dtypes)
    for (std::int64_t part : {1, 333}) {
      for (auto op : {reduce_op::sum, reduce_op::max}) {
        CAPTURE(describe(op, dtype, part));
        DeviceBuffer in(values(c.rank(), part * c.size(), dtype)), out(part, dtype);
        c.ireduce_scatter(in.get(), out.get(), out.count(), dtype, op).wait();
        const auto whole = expected(op, c.size(), part * c.size(), dtype);
        CHECK(torch::equal(out.to_host(), whole.slice(0, c.rank() * part, (c.rank() + 1) * part)));
      }
      CAPTURE(describe(reduce_op::sum, dtype, part));
      DeviceBuffer in((torch::arange(part, torch::kLong) + 100 * c.rank()).to(dtype)), out(part * c.size(), dtype);
      c.iall_gather(in.get(), out.get(), in.count(), dtype).wait();
      std::vector<torch::Tensor> parts;
      for (int r = 0; r < c.size(); ++r) parts.push_back(torch::arange(part, torch::kLong) + 100 * r);
      CHECK(torch::equal(out.to_host(), torch::cat(parts).to(dtype)));
    }
}

TEST_CASE("[gpu] comm::Nccl: send and recv pass buffers around a ring" * doctest::skip(no_gpu)) {
  comm::Mpi mpi;
  comm::Nccl c(mpi);
  if (c.size() == 1) return;  // a ring of one would send to itself
  const int next = (c.rank() + 1) % c.size(), prev = (c.rank() + c.size() - 1) % c.size();
  for (auto dtype : all_dtypes) {
    CAPTURE(c10::toString(dtype));
    DeviceBuffer mine(values(c.rank(), 1001, dtype)), theirs(1001, dtype);
    // ncclSend and ncclRecv each hold the stream until their peer matches them, so a
    // ring where every rank sends first would deadlock: even ranks send first.
    if (c.rank() % 2 == 0) {
      c.isend(mine.get(), mine.count(), dtype, next).wait();
      c.irecv(theirs.get(), theirs.count(), dtype, prev).wait();
    } else {
      c.irecv(theirs.get(), theirs.count(), dtype, prev).wait();
      c.isend(mine.get(), mine.count(), dtype, next).wait();
    }
    CHECK(torch::equal(theirs.to_host(), values(prev, 1001, dtype)));
  }
}

TEST_CASE("[gpu] comm::Nccl: iexchange sends and receives around a ring at once" * doctest::skip(no_gpu)) {
  comm::Mpi mpi;
  comm::Nccl c(mpi);
  if (c.size() == 1) return;
  const int next = (c.rank() + 1) % c.size(), prev = (c.rank() + c.size() - 1) % c.size();
  const auto on_gpu = torch::TensorOptions().device(torch::kCUDA, c.device());
  // Every rank sends first: with separate calls this deadlocks (see the ring test above).
  auto mine = values(c.rank(), 1001, torch::kFloat).to(on_gpu.device());
  auto theirs = torch::zeros({1001}, on_gpu);
  const std::vector<comm::Nccl::Message> sends{{mine, next, 3}}, recvs{{theirs, prev, 3}};
  c.iexchange(sends, recvs).wait();
  CHECK(torch::equal(theirs.cpu(), values(prev, 1001, torch::kFloat)));
}

TEST_CASE("[gpu] comm::Nccl: split groups ranks by colour, ordered by key" * doctest::skip(no_gpu)) {
  comm::Mpi mpi;
  comm::Nccl c(mpi);
  const int colour = c.rank() % 2;
  auto half = c.split(colour, -c.rank());  // reversed order within each colour
  int expected_size = 0;
  for (int r = 0; r < c.size(); ++r) expected_size += r % 2 == colour ? 1 : 0;
  CHECK(half.size() == expected_size);
  auto t = torch::full({4}, static_cast<double>(c.rank()), torch::TensorOptions(torch::kDouble).device(torch::kCUDA, c.device()));
  half.all_reduce(t, reduce_op::sum);
  double want = 0;
  int higher = 0;  // ranks of my colour above me come first (key -rank)
  for (int r = 0; r < c.size(); ++r)
    if (r % 2 == colour) {
      want += r;
      higher += r > c.rank() ? 1 : 0;
    }
  CHECK(half.rank() == higher);
  CHECK(torch::equal(t.cpu(), torch::full({4}, want, torch::kDouble)));
}

TEST_CASE("[gpu] comm::Nccl: misuse throws paratrain::error before reaching NCCL" * doctest::skip(no_gpu)) {
  comm::Mpi mpi;
  comm::Nccl c(mpi);
  auto cpu = torch::ones({4});
  auto gathered = torch::ones({4 * c.size()});
  CHECK_THROWS_WITH_AS(c.all_reduce(cpu, reduce_op::sum), doctest::Contains("comm::Nccl takes CUDA tensors"),
                       paratrain::error);
  CHECK_THROWS_WITH_AS(c.broadcast(cpu, 0), doctest::Contains("comm::Nccl takes CUDA tensors"), paratrain::error);
  CHECK_THROWS_WITH_AS(c.all_gather(cpu, gathered), doctest::Contains("comm::Nccl takes CUDA tensors"),
                       paratrain::error);
  DeviceBuffer ints(4, torch::kInt32);
  CHECK_THROWS_WITH_AS(c.iall_reduce(ints.get(), 4, torch::kInt32, reduce_op::average),
                       doctest::Contains("would truncate"), paratrain::error);
  CHECK_THROWS_WITH_AS(c.ibroadcast(ints.get(), 4, torch::kUInt8, 0),
                       doctest::Contains("is not supported by comm::Nccl"), paratrain::error);
  CHECK_THROWS_WITH_AS(c.ibroadcast(ints.get(), 4, torch::kInt32, c.size()),
                       doctest::Contains("is not in this communicator"), paratrain::error);
  c.barrier();  // the ranks are still in step
}
