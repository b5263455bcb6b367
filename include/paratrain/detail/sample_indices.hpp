#pragma once
/// \file
/// detail::check_sample_indices — what every dataset's get() checks first.

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "paratrain/error.hpp"

namespace paratrain::detail {

/// Throws paratrain::error naming `operation` unless `indices` is a 1-D int64 (or int32, as
/// index_select takes) CPU tensor of sample indices in [0, size): the first one outside is
/// named, so a bad sampler is found from the message rather than from LibTorch's "index out
/// of range in self".
inline void check_sample_indices(std::string_view operation, const at::Tensor& indices, std::int64_t size) {
  if (!indices.defined() || indices.dim() != 1 || !indices.device().is_cpu() ||
      (indices.scalar_type() != at::kLong && indices.scalar_type() != at::kInt))
    throw error(operation, -1, "sample indices must be a 1-D int64 CPU tensor (data::to_tensor makes one)");
  const auto n = indices.numel();
  const auto contiguous = indices.to(at::kLong).contiguous();
  const auto* p = contiguous.data_ptr<std::int64_t>();
  for (std::int64_t k = 0; k < n; ++k) {
    if (p[k] < 0 || p[k] >= size)
      throw error(operation, -1,
                  "sample " + std::to_string(p[k]) + " asked for (position " + std::to_string(k) +
                      " of the batch), but the dataset holds " + std::to_string(size) + " samples, 0 to " +
                      std::to_string(size - 1));
  }
}

}  // namespace paratrain::detail
