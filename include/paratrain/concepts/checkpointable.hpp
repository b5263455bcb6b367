#pragma once
/// \file
/// paratrain::checkpointable — what saving and loading a strategy's state asks of it.

#include <ATen/core/Tensor.h>

#include <concepts>
#include <cstdint>
#include <string>
#include <vector>

#include "paratrain/concepts/strategy.hpp"

namespace paratrain {

/// The part of one named tensor that this rank holds: the whole tensor (a replica, or a
/// tensor that is not sharded), or a flat, row-major range of it (a ZeRO shard).
struct TensorSlice {
  std::string name;                 ///< as named_parameters() / named_buffers() name it
  std::vector<std::int64_t> shape;  ///< of the whole tensor
  std::int64_t begin = 0;           ///< flat offset of `tensor`'s first element in the whole
  at::Tensor tensor;                ///< the live storage: saved from, loaded into; may be empty
  bool replicated = true;           ///< every rank holds it whole (written by one)
  /// Which rank writes a replicated slice: -1 when every rank holds the same values (the
  /// checkpoint picks one to balance the bytes); else the rank whose values count, as
  /// rank 0's buffers do under DataParallel, which broadcasts them before each step.
  int writer = -1;
  /// False where another rank holds and writes the same elements of a sharded tensor (a
  /// replica of its shard: Note [Hybrid sharding]); the slice is still loaded into.
  bool saved = true;
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
