#pragma once
/// \file
/// paratrain::Batch and paratrain::data::TensorDataset — samples in memory.

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

#include "paratrain/error.hpp"

namespace paratrain {

/// A batch of samples: inputs and targets, both indexed by dimension 0.
struct Batch {
  at::Tensor input;
  at::Tensor target;

  [[nodiscard]] std::int64_t size() const { return input.defined() ? input.size(0) : 0; }
};

namespace data {

/// A dataset held in two tensors whose dimension 0 indexes the samples.
class TensorDataset {
 public:
  TensorDataset(at::Tensor inputs, at::Tensor targets) : inputs_(std::move(inputs)), targets_(std::move(targets)) {
    if (!inputs_.defined() || !targets_.defined() || inputs_.dim() == 0 || targets_.dim() == 0 ||
        inputs_.size(0) != targets_.size(0))
      throw error("TensorDataset", -1,
                  "inputs and targets must be defined tensors with the same size in dimension 0 (one row per "
                  "sample)");
  }

  [[nodiscard]] std::int64_t size() const { return inputs_.size(0); }

  /// The samples at `indices` (a 1-D int64 tensor), in that order.
  [[nodiscard]] Batch get(const at::Tensor& indices) const {
    return {inputs_.index_select(0, indices), targets_.index_select(0, indices)};
  }

  [[nodiscard]] const at::Tensor& inputs() const noexcept { return inputs_; }
  [[nodiscard]] const at::Tensor& targets() const noexcept { return targets_; }

 private:
  at::Tensor inputs_;
  at::Tensor targets_;
};

}  // namespace data
}  // namespace paratrain
