#pragma once
/// \file
/// paratrain::data::batches and to_tensor — cutting a sampler's indices into batches.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <concepts>
#include <cstdint>
#include <string>
#include <vector>

#include <range/v3/algorithm/copy.hpp>
#include <range/v3/range/concepts.hpp>
#include <range/v3/range/primitives.hpp>
#include <range/v3/range/traits.hpp>
#include <range/v3/view/chunk.hpp>
#include <range/v3/view/take.hpp>

#include "paratrain/core/error.hpp"

namespace paratrain::data {

/// A lazy range of consecutive batches of `indices`, each `batch_size` long except
/// perhaps the last; with `drop_last` a short last batch is left out (as in PyTorch's
/// DataLoader). The range views `indices`, which must outlive it. Throws
/// paratrain::error if batch_size < 1.
///
/// \code
/// const auto indices = sampler.indices();  // a named vector: batches() does not copy it
/// for (auto batch : paratrain::data::batches(indices, 32)) {
///   const torch::Tensor ids = paratrain::data::to_tensor(batch);
/// }
/// \endcode
inline auto batches(const std::vector<std::int64_t>& indices, std::int64_t batch_size,
                    bool drop_last = false) {
  if (batch_size < 1) {
    throw error("batches", -1,
                "batch_size is " + std::to_string(batch_size) + "; pass a batch_size of at least 1");
  }
  const auto n = static_cast<std::int64_t>(indices.size());
  // Cutting the input to whole batches up front keeps one return type for both cases.
  const auto kept = drop_last ? n / batch_size * batch_size : n;
  return indices | ranges::views::take(kept) | ranges::views::chunk(batch_size);
}

/// Deleted: the batches would view a vector destroyed at the end of the statement, as
/// in `for (auto b : batches(sampler.indices(), 32))`. Name the vector first:
/// `const auto indices = sampler.indices();`.
void batches(std::vector<std::int64_t>&& indices, std::int64_t batch_size,
             bool drop_last = false) = delete;

/// Copies one batch of indices (an element of batches(), or any sized range of
/// integers) into a 1-D int64 CPU tensor (a torch::Tensor), ready for `index_select`.
template <class Batch>
  requires ranges::sized_range<Batch> &&
           std::convertible_to<ranges::range_value_t<Batch>, std::int64_t>
at::Tensor to_tensor(Batch&& batch) {
  auto out = at::empty({static_cast<std::int64_t>(ranges::size(batch))}, at::kLong);
  ranges::copy(batch, out.data_ptr<std::int64_t>());
  return out;
}

}  // namespace paratrain::data
