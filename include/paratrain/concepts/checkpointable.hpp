#pragma once
/// \file
/// paratrain::checkpointable — what saving and loading a strategy's state asks of it.

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <string>
#include <vector>

#include "paratrain/concepts/strategy.hpp"

namespace paratrain {

/// One run of a slice's elements in the whole tensor: [begin, begin + numel), row-major.
struct FlatRun {
  std::int64_t begin = 0;
  std::int64_t numel = 0;
};

/// The part of one named tensor that this rank holds: the whole tensor (a replica, or a
/// tensor that is not sharded), a flat, row-major range of it (a ZeRO shard), or either of
/// those of a box of it (a tensor-parallel slice: rows, columns, ... of the whole; a ZeRO
/// shard of such a slice).
struct TensorSlice {
  std::string name;                 ///< as named_parameters() / named_buffers() name it
  std::vector<std::int64_t> shape;  ///< of the whole tensor
  std::int64_t begin = 0;           ///< flat offset of `tensor`'s first element in the whole (in the box)
  at::Tensor tensor;                ///< the live storage: saved from, loaded into; may be empty
  bool replicated = true;           ///< every rank holds it whole (written by one)
  /// Which rank writes a replicated slice: -1 when every rank holds the same values (the
  /// checkpoint picks one to balance the bytes); else the rank whose values count, as
  /// rank 0's buffers do under DataParallel, which broadcasts them before each step.
  int writer = -1;
  /// False where another rank holds and writes the same elements of a sharded tensor (a
  /// replica of its shard: Note [Hybrid sharding]); the slice is still loaded into.
  bool saved = true;
  /// The box this slice lies in: its first element's index in each dimension of the whole,
  /// and its sizes (empty: the box is the whole tensor). `begin` counts row-major in the box.
  std::vector<std::int64_t> box_offset;
  std::vector<std::int64_t> box_shape;

  /// The runs of the whole tensor, in order, that `numel` elements from `begin` (the box's
  /// row-major count) occupy: one for a slice of the whole, one per row (or block of rows)
  /// of a box that cuts a trailing dimension.
  [[nodiscard]] std::vector<FlatRun> runs(std::int64_t numel) const {
    if (box_shape.empty()) return {{begin, numel}};
    const auto dims = shape.size();
    // k: the first dimension from which the box spans every later one whole; the box is a
    // sequence of blocks of `block` contiguous elements, one per index of the dimensions before k.
    std::size_t k = dims;
    while (k > 0 && box_shape[k - 1] == shape[k - 1]) --k;  // [k, dims): whole
    if (k > 0) --k;  // a part of dimension k over whole later ones is contiguous too
    std::int64_t block = 1;
    for (std::size_t d = k; d < dims; ++d) block *= box_shape[d];
    std::vector<std::int64_t> stride(dims, 1);
    for (std::size_t d = dims; d-- > 1;) stride[d - 1] = stride[d] * shape[d];
    std::vector<FlatRun> out;
    if (numel == 0 || block == 0) return out;
    for (std::int64_t i = begin / block; i * block < begin + numel; ++i) {
      // The block's start in the whole: its index over the dimensions before k, offset by the box.
      std::int64_t at = 0, rest = i;
      for (std::size_t d = k; d-- > 0;) {
        at += (box_offset[d] + rest % box_shape[d]) * stride[d];
        rest /= box_shape[d];
      }
      for (std::size_t d = k; d < dims; ++d) at += box_offset[d] * stride[d];
      const auto lo = std::max(begin, i * block), hi = std::min(begin + numel, (i + 1) * block);
      out.push_back({at + (lo - i * block), hi - lo});
    }
    return out;
  }
};

/// Where a strategy keeps the state of its model and optimizer on this rank.
///
/// - `model`: every parameter and buffer, on every rank in the same order (a rank that
///   holds nothing of a sharded tensor lists it with an empty `tensor`), or, without
///   `whole`, those of this rank's part of the model;
/// - `optimized`: the tensors the optimizer steps (its param_groups' tensors) as slices of
///   the model's parameters: the parameters themselves, or ZeRO's pieces of them.
struct CheckpointLayout {
  std::vector<TensorSlice> model;
  std::vector<TensorSlice> optimized;
  /// Whether every rank lists every tensor of the model. A pipeline rank lists only its
  /// stages' (false): the model is then the union over the ranks, and every replicated
  /// slice names its writer.
  bool whole = true;
};

/// A strategy whose state paratrain::checkpoint can save and load, and reshard: any
/// checkpointable strategy at N ranks loads what any other saved at M ranks.
///
/// - `s.checkpoint_layout()`: this rank's slices (see CheckpointLayout);
/// - `s.loaded()`: called on every rank after the slices were written, for what the
///   strategy derives from them (replicas of the model, ...). Collective.
template <class S>
concept checkpointable = strategy<S> && requires(S& s) {
  { s.checkpoint_layout() } -> std::same_as<CheckpointLayout>;
  s.loaded();
};

}  // namespace paratrain
