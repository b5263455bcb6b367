#pragma once
/// \file
/// A slice's elements in the flat whole tensor, by its runs (TensorSlice::runs): what saving,
/// loading and the model file do with a tensor-parallel slice (a box of the whole).

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "paratrain/concepts/checkpointable.hpp"

namespace paratrain::checkpoint::detail {

/// Copies `values` (the slice's elements, any shape) into their places in `whole` (flat).
inline void place_in_whole(at::Tensor& whole, const TensorSlice& sl, const at::Tensor& values) {
  const auto flat = values.detach().reshape({-1});
  std::int64_t at = 0;
  for (const auto& r : sl.runs(flat.numel())) {
    whole.narrow(0, r.begin, r.numel).copy_(flat.narrow(0, at, r.numel));
    at += r.numel;
  }
}

/// The slice's `numel` elements out of `whole` (flat), in the slice's order.
[[nodiscard]] inline at::Tensor take_from_whole(const at::Tensor& whole, const TensorSlice& sl, std::int64_t numel) {
  const auto runs = sl.runs(numel);
  if (runs.size() == 1) return whole.narrow(0, runs[0].begin, runs[0].numel);
  std::vector<at::Tensor> parts;
  parts.reserve(runs.size());
  for (const auto& r : runs) parts.push_back(whole.narrow(0, r.begin, r.numel));
  return at::cat(parts);
}

/// The slice's `numel` elements as `read(begin, numel)` reads flat ranges of the whole.
template <class Read>
[[nodiscard]] at::Tensor read_slice(const TensorSlice& sl, std::int64_t numel, Read&& read) {
  const auto runs = sl.runs(numel);
  if (runs.size() == 1) return read(runs[0].begin, runs[0].numel);
  std::vector<at::Tensor> parts;
  parts.reserve(runs.size());
  for (const auto& r : runs) parts.push_back(read(r.begin, r.numel));
  return at::cat(parts);
}

/// Whether the slice holds the whole tensor's first element: where a per-tensor scalar (an
/// optimizer's step) is written, once.
[[nodiscard]] inline bool holds_first(const TensorSlice& sl) {
  if (sl.begin != 0) return false;
  for (const auto o : sl.box_offset)
    if (o != 0) return false;
  return true;
}

}  // namespace paratrain::checkpoint::detail
