#pragma once
/// \file
/// paratrain::data::Subset — some samples of a dataset, renumbered from 0.

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>

#include "paratrain/concepts/dataset.hpp"
#include "paratrain/core/batch.hpp"
#include "paratrain/data/detail/sample_indices.hpp"

namespace paratrain::data {

/// The samples `indices` of `base` as a dataset of its own: its sample i is base's sample
/// indices[i] (PyTorch's torch.utils.data.Subset). A train/validation split, or the first
/// n samples for a quick run. `base` must outlive it.
///
/// \code
/// const paratrain::data::Subset first(train, at::arange(1000));  // the first 1,000 samples
/// \endcode
template <dataset D>
class Subset {
 public:
  /// Throws paratrain::error if `indices` is not a 1-D int64 CPU tensor of base's samples.
  Subset(const D& base, at::Tensor indices) : base_(base), indices_(std::move(indices)) {
    paratrain::detail::check_sample_indices("Subset", indices_, static_cast<std::int64_t>(base_.size()));
  }

  /// Deleted: the subset would refer to a dataset destroyed at the end of the statement.
  Subset(const D&& base, at::Tensor indices) = delete;

  [[nodiscard]] std::int64_t size() const { return indices_.size(0); }
  [[nodiscard]] Batch get(const at::Tensor& indices) const {
    paratrain::detail::check_sample_indices("Subset", indices, size());
    return base_.get(indices_.index_select(0, indices));
  }
  [[nodiscard]] const D& base() const noexcept { return base_; }
  [[nodiscard]] const at::Tensor& indices() const noexcept { return indices_; }

 private:
  const D& base_;
  at::Tensor indices_;
};

}  // namespace paratrain::data
