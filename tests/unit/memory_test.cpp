// A model bigger than one rank trains: under a kernel cap on each process's memory, below
// that model's DDP footprint, ZeRO-3 at 4 ranks built sharded trains it and ends where
// single-device LibTorch ends (computed by another, uncapped process: the ctest fixture
// memory.capped.reference), while DDP under the same cap stops at construction with the
// planner's message (Note [Checking the plan]) instead of the OOM killer.
//
// The cap is RLIMIT_DATA, set by each process on itself after MPI and LibTorch have
// started: it covers the heap and every private writable mapping, where LibTorch's CPU
// tensors live, and needs neither root nor a delegated cgroup (CI may have neither); it
// leaves out the shared-memory segments through which Open MPI moves messages, which
// are not the model's. An allocation past it fails (malloc returns null, LibTorch throws)
// rather than waking the OOM killer. Both tests are skipped in the suite's own runs.
#include <sys/resource.h>

#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/strategy/memory_check.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "support/doctest.hpp"
#include "support/equivalence.hpp"

namespace {

namespace comm = paratrain::comm;

// 16 units of 1024 x 1024 (and bias): Ψ = 16.8M, 64 MiB of fp32 parameters.
constexpr int layers = 16;
constexpr std::int64_t width = 1024, batch = 16;
constexpr int steps = 4;

struct CappedImpl : torch::nn::Module {
  CappedImpl() {
    for (int i = 0; i < layers; ++i)
      fc.push_back(register_module("fc" + std::to_string(i), paratrain::Unit<torch::nn::Linear>(width, width)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : fc) x = torch::tanh(l(x));
    return x;
  }
  std::vector<paratrain::Unit<torch::nn::Linear>> fc;
};
TORCH_MODULE(Capped);

Capped make_capped() {
  torch::manual_seed(11);
  return Capped();
}

// Global step k's batch: 16 samples; rank r of `world` takes a contiguous part of them.
paratrain::Batch part(int k, int world, int rank) {
  torch::manual_seed(500 + k);
  const auto x = torch::randn({batch, width}), y = torch::randint(0, width, {batch}, torch::kLong);
  const auto begin = batch * rank / world, end = batch * (rank + 1) / world;
  return {x.narrow(0, begin, end - begin), y.narrow(0, begin, end - begin)};
}

// SGD with momentum: a wrong gradient scale shows (Adam would hide it).
const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);

std::filesystem::path reference_file() {
  const char* dir = std::getenv("PARATRAIN_CAPPED_DIR");
  REQUIRE(dir != nullptr);
  return std::filesystem::path(dir) / "reference.pt";
}

// RLIMIT_DATA's soft limit at `bytes` above what the process's data segment holds now,
// until destroyed.
class DataCap {
 public:
  explicit DataCap(double bytes) {
    getrlimit(RLIMIT_DATA, &before_);
    rlimit cap = before_;
    cap.rlim_cur = static_cast<rlim_t>(paratrain::detail::proc_status_bytes("VmData") + bytes);
    REQUIRE(setrlimit(RLIMIT_DATA, &cap) == 0);
  }
  ~DataCap() { setrlimit(RLIMIT_DATA, &before_); }
  DataCap(const DataCap&) = delete;
  DataCap& operator=(const DataCap&) = delete;

 private:
  rlimit before_{};
};

}  // namespace

TEST_CASE("capped memory: the single-device reference" * doctest::skip()) {
  auto model = make_capped();
  torch::optim::SGD optim(model->parameters(), sgd);
  for (int k = 0; k < steps; ++k) {
    optim.zero_grad();
    const auto b = part(k, 1, 0);
    paratrain_test::loss_fn(model->forward(b.input()), b.target).backward();
    optim.step();
  }
  torch::save(model->parameters(), reference_file().string());
}

TEST_CASE("capped memory: ZeRO-3 at 4 ranks trains a model DDP cannot hold, DDP stops with the plan" *
          doctest::skip()) {
  comm::Mpi c;
  const int world = c.size(), rank = c.rank();
  REQUIRE(world == 4);
  // Threads and pools LibTorch starts on its first operations, before the baseline.
  (void)torch::mm(torch::randn({256, 256}), torch::randn({256, 256})).sum().item<float>();
  const double psi = layers * (width * width + width);
  // The cap: 10 bytes per parameter above the baseline (160 MiB), room for the model built
  // whole (4) but not for DDP, which plans 12 (parameters, gradients, momentum) and its
  // transients; ZeRO-3 at 4 ranks plans 3 and its transients (Note [Peak memory model]),
  // and the process needs some more besides (Open MPI's scratch, the heap's fragments).
  const double cap = 10 * psi;
  using Ddp = paratrain::DataParallel<Capped, comm::Mpi, torch::optim::SGD>;
  using Zero3 = paratrain::DataParallel<Capped, comm::Mpi, paratrain::Sharded<torch::optim::SGD, paratrain::zero::stage3>>;
  const paratrain::DataParallelOptions checked{.memory = {.check = true}};
  std::optional<DataCap> limit(std::in_place, cap);
  const auto message = paratrain_test::error_of([&] { Ddp ddp(make_capped(), c, sgd, checked); });
  CAPTURE(message);
  CHECK(message.find("memory plan of DDP at 4 ranks") != std::string::npos);
  CHECK(message.find("RLIMIT_DATA") != std::string::npos);
  // The smallest stage whose plan fits, at this world size.
  CHECK(message.find(" at 4 ranks plans ") != std::string::npos);
  CHECK(message.find("which fits") != std::string::npos);
  Zero3 z(make_capped, c, sgd, checked);
  CAPTURE(z.planned_peak().total());
  for (int k = 0; k < steps; ++k) z.step(part(k, world, rank), paratrain_test::loss_fn);
  limit.reset();
  // Uncapped again: the whole model, gathered, against the other process's reference.
  std::vector<torch::Tensor> want;
  torch::load(want, reference_file().string());
  CHECK(paratrain_test::max_relative_difference(z.full_parameters(), want) <= 1e-5);
}
