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

/// A group that reduces on `device` (the model's, where `comm` works): what the algorithms
/// of this folder (agree, all_gather_strings, check_same_model) take, for a communicator
/// that reduces only tensors of its own device (comm::Nccl) and the CPU tensors they make.
template <class Comm>
struct ReducingOn {
  Comm& comm;
  at::Device device;
  [[nodiscard]] int rank() const { return comm.rank(); }
  [[nodiscard]] int size() const { return comm.size(); }
  void all_reduce(at::Tensor& t, reduce_op op) { all_reduce_on(comm, t, device, op); }
};

}  // namespace paratrain::detail
