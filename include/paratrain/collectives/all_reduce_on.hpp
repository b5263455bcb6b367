#pragma once
/// \file
/// An all-reduce of a tensor that may live elsewhere than the communicator works.

#include <ATen/ATen.h>

#include "paratrain/core/reduce_op.hpp"

namespace paratrain::detail {

/// Reduces `t` in place over `comm`'s ranks through a copy on `device` (the model's,
/// where the communicator works: comm::Nccl reduces CUDA tensors only) when `t` is not there.
template <class Comm>
void all_reduce_on(Comm& comm, at::Tensor& t, const at::Device& device, reduce_op op) {
  if (t.device() == device) return comm.all_reduce(t, op);
  auto on_device = t.to(device);
  comm.all_reduce(on_device, op);
  t.copy_(on_device);
}

}  // namespace paratrain::detail
