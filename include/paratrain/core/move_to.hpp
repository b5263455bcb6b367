#pragma once
/// \file
/// detail::move_to — a tensor on a device, the one move of Note [One move per batch].

#include <ATen/core/Tensor.h>

namespace paratrain::detail {

/// `t` on `device` (`t` itself where it is there already: Tensor::to copies nothing then), or
/// `t` where it is undefined: the one move of Note [One move per batch]. Asynchronous only
/// from page-locked host memory to a GPU, the one case where the host may go on while the
/// copy runs; whether `t` is pinned is asked only then (in a CUDA LibTorch the question is a
/// CUDA call).
inline at::Tensor move_to(const at::Tensor& t, at::Device device) {
  if (!t.defined()) return t;
  return t.to(device, /*non_blocking=*/device.is_cuda() && t.is_cpu() && t.is_pinned());
}

}  // namespace paratrain::detail
