#pragma once
/// \file
/// The model's device against the communicator's: checked on every rank before the first
/// collective that would hand the communicator the model's tensors.

#include <ATen/ATen.h>

#include <concepts>
#include <string>

#include "paratrain/collectives/agree.hpp"
#include "paratrain/collectives/all_reduce_on.hpp"
#include "paratrain/core/reduce_op.hpp"

namespace paratrain::detail {

/// Where `comm` works: its GPU for a communicator of one GPU (comm::Nccl), else the CPU.
template <class Comm>
at::Device communicator_device(const Comm& comm) {
  if constexpr (requires {
                  requires Comm::device_buffers_only;
                  { comm.device() } -> std::convertible_to<int>;
                })
    return {at::kCUDA, static_cast<c10::DeviceIndex>(comm.device())};
  else
    return at::kCPU;
}

/// Collective over `comm`. A communicator that works on one GPU of its own (comm::Nccl:
/// `device_buffers_only` and `int device()`) reduces the model's tensors in place, so the
/// model must be on that GPU: a model elsewhere would hand NCCL pointers of another device
/// (an error deep inside NCCL, or silent traffic between GPUs). Throws paratrain::error on
/// every rank, naming the rank and both devices, when some rank's is not. Communicators that
/// take tensors on any device have nothing to check.
template <class Comm>
void check_model_device(Comm& comm, const at::Device& model, const char* operation) {
  if constexpr (requires {
                  requires Comm::device_buffers_only;
                  { comm.device() } -> std::convertible_to<int>;
                }) {
    const at::Device gpu(at::kCUDA, static_cast<c10::DeviceIndex>(comm.device()));
    const std::string problem =
        model == gpu ? std::string()
                     : "the model is on " + model.str() + " but this rank's communicator works on " + gpu.str() +
                           "; move the model there before making the strategy (paratrain::local_device(\"cuda\") "
                           "picks the GPU comm::Nccl picks: the local rank's), or give the communicator that device";
    // The agreement itself runs where the communicator works, whatever the model's device.
    struct OnGpu {
      Comm& comm;
      at::Device gpu;
      [[nodiscard]] int rank() const { return comm.rank(); }
      [[nodiscard]] int size() const { return comm.size(); }
      void all_reduce(at::Tensor& t, reduce_op op) { all_reduce_on(comm, t, gpu, op); }
    } group{comm, gpu};
    agree(group, operation, problem);
  }
}

}  // namespace paratrain::detail
