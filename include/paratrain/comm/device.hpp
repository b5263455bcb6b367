#pragma once
/// \file
/// paratrain::local_device — the device a process trains on: its node's GPU for its local
/// rank, or the CPU. The rule comm::Nccl follows, so that a model put there is where the
/// communicator reduces.

#include <c10/core/Device.h>
#include <torch/cuda.h>

#include <string>
#include <string_view>

#include "paratrain/comm/launch.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain {

/// The device named by `which` for this process: "cpu"; "cuda", GPU `local_rank % GPUs` of
/// this node (detect_placement().local_rank: one rank per GPU, as comm::Nccl picks by
/// default); "auto" (or ""), "cuda" where LibTorch sees a GPU, else "cpu". Throws
/// paratrain::error for "cuda" without a GPU and for any other name.
///
/// \code
///   const auto device = paratrain::local_device(args.device);   // --device cpu|cuda
///   Net net;
///   net->to(device);
/// \endcode
[[nodiscard]] inline c10::Device local_device(std::string_view which = "auto") {
  const auto gpus = static_cast<int>(torch::cuda::device_count());
  if (which.empty() || which == "auto") which = gpus > 0 ? "cuda" : "cpu";
  if (which == "cpu") return c10::Device(c10::kCPU);
  const int rank = detect_placement().local_rank;
  if (which == "cuda") {
    if (gpus == 0)
      throw error("local_device", -1,
                  "--device cuda, but LibTorch sees no GPU (a LibTorch built without CUDA, no driver, or "
                  "CUDA_VISIBLE_DEVICES empty); use --device cpu");
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(rank % gpus));
  }
  throw error("local_device", -1, "device \"" + std::string(which) + "\" is not one of cpu, cuda and auto");
}

}  // namespace paratrain
