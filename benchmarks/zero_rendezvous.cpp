// bench_zero's models without MPI, as GPU users start them: ranks meet in a comm::Rendezvous
// (torchrun's variables; tests/launch/torchrun_style.sh starts them) and reduce over NCCL on
// their GPU (--device cuda, the local rank's GPU) or over Gloo on the CPU (--device cpu).
// One configuration per process; the JSON line of zero.hpp, with the peak of CUDA's caching
// allocator on a GPU (peak_gpu_mib: torch.cuda.max_memory_allocated()'s measure, which
// benchmarks/zero_vs_torch.py --device cuda prints for PyTorch). scripts/gpu-check.sh runs it.
//   torchrun_style.sh N build/benchmarks/bench_zero_rendezvous <cpu|cuda> <ddp|zero1|zero2|zero3> [layers 4] [steps 30]
#include <torch/cuda.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>

#include "paratrain/comm/device.hpp"
#include "paratrain/comm/gloo/gloo.hpp"
#include "paratrain/comm/rendezvous.hpp"
#include "zero.hpp"
#if PARATRAIN_HAS_NCCL
#include "paratrain/comm/nccl/bootstrap_over_store.hpp"
#include "paratrain/comm/nccl/nccl.hpp"
#endif
#if PARATRAIN_BENCH_CUDA_ALLOCATOR
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace {

// The ranks of `comm` for timing.hpp: its own barrier, a max all-reduce on `device`, and on a
// GPU a wait for the device before the clock is read.
template <class Comm>
paratrain::bench::Ranks ranks_of(Comm comm, const torch::Device& device) {
  return {.barrier = [comm]() mutable { comm.barrier(); },
          .sync = [device] { if (device.is_cuda()) torch::cuda::synchronize(device.index()); },
          .max = [comm, device](double v) mutable {
            auto t = torch::full({1}, v, torch::TensorOptions().dtype(torch::kDouble).device(device));
            comm.all_reduce(t, paratrain::reduce_op::max);
            return t.item<double>();
          }};
}

// ", \"peak_gpu_mib\": M": the largest over the ranks of what the caching allocator handed out
// at its peak; "" on the CPU.
std::string peak_gpu(const paratrain::bench::Ranks& ranks, const torch::Device& device) {
  if (!device.is_cuda()) return "";
#if PARATRAIN_BENCH_CUDA_ALLOCATOR
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
  const double mib = static_cast<double>(stats.allocated_bytes[0].peak) / (1 << 20);  // [0]: every pool
  return ", \"peak_gpu_mib\": " + std::to_string(ranks.max(mib));
#else
  throw std::runtime_error("bench_zero_rendezvous was built against a LibTorch without CUDA's allocator");
#endif
}

template <class Comm>
int measure(Comm world, const torch::Device& device, const paratrain::bench::ZeroRun& run, const char* name) {
  const auto ranks = ranks_of(world, device);
  const bool known = paratrain::bench::with_zero_stage(run.strategy, [&]<class Update>(paratrain::plan::stage stage) {
    paratrain::bench::run_zero<Update>(world, device, ranks, run, stage, name, [&] { return peak_gpu(ranks, device); });
  });
  return known ? 0 : 2;
}

}  // namespace

int main(int argc, char** argv) try {
  paratrain::bench::ZeroRun run;
  std::string where = "cpu";
  CLI::App app("bench_zero_rendezvous: DDP and ZeRO 1-3 over comm::Gloo (--device cpu) or comm::Nccl (cuda), ranks "
               "met through a store (torchrun's variables)");
  app.add_option("--device", where, "cpu (Gloo) or cuda (NCCL)")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  run.add_to(app);
  if (const auto status = paratrain::bench::parse(app, argc, argv)) return *status;
  torch::set_num_threads(1);
  const auto device = paratrain::local_device(where);
  int rc = 2;
  if (device.is_cuda()) {
#if PARATRAIN_HAS_NCCL
    paratrain::comm::Rendezvous meeting;
    rc = measure(paratrain::comm::Nccl(meeting), device, run, "nccl");
#else
    throw std::runtime_error("--device cuda: this build has no paratrain::nccl");
#endif
  } else {
    rc = measure(paratrain::comm::Gloo(), device, run, "gloo");
  }
  return rc;
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_zero_rendezvous: %s\n", e.what());
  return 1;
}
