#pragma once
/// \file
/// Broadcasting many small tensors as few large ones.

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <map>
#include <vector>

#include "paratrain/concepts/communicator.hpp"

namespace paratrain::detail {

/// Broadcasts `tensors` from `root`, one collective per dtype: each group is packed
/// into one buffer, sent, and unpacked in place. Every rank must pass tensors of the
/// same shapes and dtypes in the same order (replicas of one model do).
template <communicator Comm>
void broadcast_coalesced(Comm& comm, const std::vector<at::Tensor>& tensors, int root) {
  if (comm.size() == 1 || tensors.empty()) return;
  c10::NoGradGuard no_grad;
  std::map<at::ScalarType, std::vector<at::Tensor>> groups;
  for (const auto& t : tensors) groups[t.scalar_type()].push_back(t);
  for (auto& [dtype, group] : groups) {
    std::vector<at::Tensor> flat;
    for (const auto& t : group) flat.push_back(t.reshape({-1}));
    auto packed = at::cat(flat);
    comm.broadcast(packed, root);
    std::int64_t offset = 0;
    for (auto& t : group) {
      t.copy_(packed.narrow(0, offset, t.numel()).view_as(t));
      offset += t.numel();
    }
  }
}

}  // namespace paratrain::detail
