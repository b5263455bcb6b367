#pragma once
/// \file
/// The CheckpointLayout of a model held whole (single device, DDP, DP): every parameter
/// and buffer a replicated slice of itself.

#include <torch/nn/module.h>

#include <string>
#include <utility>

#include "paratrain/concepts/checkpointable.hpp"

namespace paratrain::detail {

inline TensorSlice whole_slice(std::string name, const at::Tensor& t) {
  TensorSlice sl;
  sl.name = std::move(name);
  sl.shape = t.sizes().vec();
  sl.tensor = t;
  sl.replicated = true;
  return sl;
}

/// Every buffer of `model`, whole: rank 0's count. Each rank's batch-norm statistics
/// move with its own samples during a step, and DataParallel makes them rank 0's again
/// (broadcast_buffers) before the next one, so rank 0's are what training goes on with.
inline void add_buffers(const torch::nn::Module& model, CheckpointLayout& out) {
  for (const auto& b : model.named_buffers(/*recurse=*/true)) {
    out.model.push_back(whole_slice(b.key(), b.value()));
    out.model.back().writer = 0;
  }
}

/// `model` held whole on every rank, its optimizer over its own parameters.
inline CheckpointLayout whole_model_layout(const torch::nn::Module& model) {
  CheckpointLayout out;
  for (const auto& p : model.named_parameters(/*recurse=*/true)) {
    out.model.push_back(whole_slice(p.key(), p.value()));
    if (p.value().requires_grad()) out.optimized.push_back(whole_slice(p.key(), p.value()));
  }
  add_buffers(model, out);
  return out;
}

}  // namespace paratrain::detail
