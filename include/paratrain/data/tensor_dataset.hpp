#pragma once
/// \file
/// paratrain::data::TensorDataset — samples held in memory, as tensors.

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "paratrain/core/batch.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/data/detail/sample_indices.hpp"

namespace paratrain {
namespace data {

/// A dataset held in tensors whose dimension 0 indexes the samples: one input tensor
/// per argument of the model's forward, and the targets.
class TensorDataset {
 public:
  TensorDataset(at::Tensor inputs, at::Tensor targets)
      : TensorDataset(std::vector<at::Tensor>{std::move(inputs)}, std::move(targets)) {}

  /// With named extra tensors that batches carry beside inputs and targets, for a loss
  /// or a metric (Batch::extra): `TensorDataset({src, tgt}, targets, {{"weight", w}})`.
  TensorDataset(std::vector<at::Tensor> inputs, at::Tensor targets, std::map<std::string, at::Tensor> extra = {})
      : inputs_(std::move(inputs)), targets_(std::move(targets)), extra_(std::move(extra)) {
    bool ok = !inputs_.empty() && targets_.defined() && targets_.dim() > 0;
    for (const auto& x : inputs_) ok = ok && x.defined() && x.dim() > 0 && x.size(0) == targets_.size(0);
    for (const auto& [name, x] : extra_) ok = ok && x.defined() && x.dim() > 0 && x.size(0) == targets_.size(0);
    if (!ok)
      throw error("TensorDataset", -1,
                  "inputs, targets and extra tensors must be defined tensors with the same size in dimension 0 (one "
                  "row per sample), and there must be at least one input");
  }

  [[nodiscard]] std::int64_t size() const { return targets_.size(0); }

  /// The samples at `indices` (a 1-D int64 tensor), in that order. Throws paratrain::error
  /// naming an index outside [0, size()).
  [[nodiscard]] Batch get(const at::Tensor& indices) const {
    paratrain::detail::check_sample_indices("TensorDataset", indices, size());
    Batch b;
    for (const auto& x : inputs_) b.inputs.push_back(x.index_select(0, indices));
    b.target = targets_.index_select(0, indices);
    for (const auto& [name, x] : extra_) b.extra.emplace(name, x.index_select(0, indices));
    return b;
  }

  /// The first input tensor: all of them for a one-input model.
  [[nodiscard]] const at::Tensor& inputs() const noexcept { return inputs_.front(); }
  /// Every input tensor, one per argument of the model's forward.
  [[nodiscard]] const std::vector<at::Tensor>& all_inputs() const noexcept { return inputs_; }
  [[nodiscard]] const at::Tensor& targets() const noexcept { return targets_; }
  /// The named extra tensors.
  [[nodiscard]] const std::map<std::string, at::Tensor>& extra() const noexcept { return extra_; }

 private:
  std::vector<at::Tensor> inputs_;
  at::Tensor targets_;
  std::map<std::string, at::Tensor> extra_;
};

}  // namespace data
}  // namespace paratrain

