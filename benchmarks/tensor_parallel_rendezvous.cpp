// The tensor-parallelism benchmark (tensor_parallel.hpp) without MPI, as GPU users start it:
// ranks meet in a comm::Rendezvous (torchrun's variables; tests/launch/torchrun_style.sh starts
// them) and exchange over NCCL, one GPU each (--device cuda, the local rank's GPU), or over
// Gloo on the CPU (--device cpu). scripts/gpu-check.sh runs it beside
// benchmarks/tensor_parallel_vs_dtensor.py --device cuda where there are two GPUs.
//   torchrun_style.sh 2 build/benchmarks/bench_tensor_parallel_rendezvous --device cuda --sequence-parallel
#include <torch/cuda.h>

#include <cstdio>
#include <stdexcept>
#include <string>

#include "paratrain/comm/device.hpp"
#include "paratrain/comm/gloo/gloo.hpp"
#include "paratrain/comm/rendezvous.hpp"
#include "tensor_parallel.hpp"
#if PARATRAIN_HAS_NCCL
#include "paratrain/comm/nccl/nccl.hpp"
#endif

int main(int argc, char** argv) try {
  namespace bench = paratrain::bench::tensor_parallel;
  bench::Run run;
  std::string where = "cpu";
  CLI::App app("bench_tensor_parallel_rendezvous: tensor parallelism over comm::Gloo (--device cpu) or comm::Nccl "
               "(cuda), ranks met through a store (torchrun's variables)");
  app.add_option("--device", where, "cpu (Gloo) or cuda (NCCL, a GPU per rank)")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  run.add_to(app);
  if (const auto status = paratrain::bench::parse(app, argc, argv)) return *status;
  const auto device = paratrain::local_device(where);
  if (device.is_cuda()) {
#if PARATRAIN_HAS_NCCL
    paratrain::comm::Rendezvous meeting;
    return bench::measure(paratrain::comm::Nccl(meeting), device, run, "nccl",
                          [device] { torch::cuda::synchronize(device.index()); });
#else
    throw std::runtime_error("--device cuda: this build has no paratrain::nccl");
#endif
  }
  return bench::measure(paratrain::comm::Gloo(), device, run, "gloo");
} catch (const std::exception& e) {
  std::fprintf(stderr, "bench_tensor_parallel_rendezvous: %s\n", e.what());
  return 1;
}
