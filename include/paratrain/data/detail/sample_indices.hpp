#pragma once
/// \file
/// detail::check_sample_indices — what every dataset's get() checks first.

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <string_view>

#include "paratrain/core/error.hpp"

namespace paratrain::detail {

/// Throws paratrain::error naming `operation` unless `indices` is a 1-D int64 (or int32, as
/// index_select takes) CPU tensor of sample indices in [0, size): the first one outside is
/// named, so a bad sampler is found from the message rather than from LibTorch's "index out
/// of range in self". `where` begins the message (a file, "x.h5: "), `owner` says what holds
/// the samples ("the dataset holds", "datasets 'x', 'y' hold"). Returns the indices as a
/// contiguous int64 tensor.
inline at::Tensor check_sample_indices(std::string_view operation, const at::Tensor& indices, std::int64_t size,
                                       std::string_view where = {}, std::string_view owner = "the dataset holds") {
  const auto fail = [&](const std::string& what) { return error(operation, -1, std::string(where) + what); };
  if (!indices.defined() || indices.dim() != 1 || !indices.device().is_cpu() ||
      (indices.scalar_type() != at::kLong && indices.scalar_type() != at::kInt))
    throw fail("sample indices must be a 1-D int64 CPU tensor (data::to_tensor makes one)");
  auto contiguous = indices.to(at::kLong).contiguous();
  const auto* p = contiguous.data_ptr<std::int64_t>();
  for (std::int64_t k = 0; k < contiguous.numel(); ++k) {
    if (p[k] < 0 || p[k] >= size)
      throw fail("sample " + std::to_string(p[k]) + " asked for (position " + std::to_string(k) +
                 " of the batch), but " + std::string(owner) + " " + std::to_string(size) + " samples" +
                 (size > 0 ? ", 0 to " + std::to_string(size - 1) : ""));
  }
  return contiguous;
}

}  // namespace paratrain::detail
