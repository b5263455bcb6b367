#pragma once
/// \file
/// paratrain::parameter_store — who holds the parameters and who steps them, behind one
/// interface (Note [Parameter stores]); the vocabulary both stores share.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <concepts>
#include <cstddef>
#include <functional>
#include <optional>
#include <vector>

#include "paratrain/strategy/optimizer_state.hpp"
#include "paratrain/concepts/checkpointable.hpp"
#include "paratrain/strategy/bucket_layout.hpp"
#include "paratrain/strategy/detail/tensor_bytes.hpp"
#include "paratrain/strategy/gradient_buckets.hpp"

namespace paratrain {

// Note [Parameter stores]
// DataParallel is the step protocol (buckets, the step agreement, clipping, NaN checks,
// join); a parameter store answers the one question that differs between DDP and ZeRO:
// who holds the parameters and who steps them. The two stores:
//
//   ReplicatedParameters  every rank holds every parameter and steps all of them (DDP);
//   ShardedParameters     each rank steps its shard, stage 3 also keeps only that shard of
//                         each Unit's parameters at rest (ZeRO 1-3, Note [Shard layout]).
//
// A store (the parameter_store concept below) must:
// - build the BucketLayout over the model's parameters (padding and units are its choice)
//   and keep it, at a stable address, for the store's lifetime: GradientBuckets points at it;
// - name the bucket hook its gradients need (`gradient_hook`), and say whether forward
//   gathers parameters (`gathers_in_forward`: Note [Unusable batches]);
// - own the optimizer, with the user's parameter groups (Note [Optimizer on pieces]);
// - name the ranks its gradients are reduced over (`group`) and, for hybrid sharding,
//   those each shard is then summed across (`replicas`, else null): Note [Hybrid sharding];
// - around every step: begin_step() when a new step's gradients start, step(grads) with
//   the reduced gradients, end_step() after a step in which this rank ran forward, and
//   replay_gathers() in a step in which it ran none (Note [Joining at stage 3]);
// - on_gradients_complete(b) when bucket b's gradients are all ready in a backward;
// - with_gathered(f): run f with every parameter whole (collective where it gathers);
// - bytes() held between steps for parameters and optimizer state (gradients are the
//   buckets'), and checkpoint_layout(model): where each tensor lives on this rank;
// - exposed_seconds(): how long this step blocked on the store's own communication
//   (gathers), which DataParallel::exposed_communication_seconds adds to the gradients'.
// Every call a store makes on the communicator is collective, in the same order on every
// rank. New stores (pooled transient buffers, sharded construction, bf16 gathers) plug in
// here without touching the step protocol.

/// What DataParallel tells the parameter store it builds.
struct StoreOptions {
  /// The buckets' sizes (their padding is the store's).
  BucketOptions bucketing;
  /// ZeRO: the ranks of one sharding group; 0: all (Note [Hybrid sharding]). DDP refuses one.
  int shard_group = 0;
  /// ZeRO-3: units gathered ahead of the one computing (Note [Pooled transients]).
  int prefetch = 1;
  /// ZeRO-3: the type units are gathered in for a forward under autocast to that type, and
  /// for its backward; empty: the parameters' own (Note [Gathers in the compute type]).
  std::optional<at::ScalarType> gather;
};

/// Bytes a strategy holds between steps for the model's states on this rank.
struct ModelStateBytes {
  std::size_t parameters = 0;
  std::size_t gradients = 0;
  std::size_t optimizer_state = 0;
  [[nodiscard]] std::size_t total() const noexcept { return parameters + gradients + optimizer_state; }
};

/// The parameter groups of an optimizer, as LibTorch spells them.
using ParamGroups = std::vector<torch::optim::OptimizerParamGroup>;

namespace detail {

/// The bytes of an optimizer's state tensors, for the optimizers checkpoints know
/// (checkpoint::optimizer_schema lists their state); 0 for others.
template <class Optim>
std::size_t optimizer_state_bytes(const Optim& o) {
  std::size_t n = 0;
  if constexpr (checkpoint::known_optimizer<Optim>) {
    using Schema = checkpoint::schema_of<Optim>;
    for (const auto& [key, state] : o.state())
      for (const auto& [field, t] : Schema::get(static_cast<const typename Schema::state_type&>(*state)).tensors)
        n += bytes_of(t);
  }
  return n;
}

}  // namespace detail

/// What DataParallel asks of a parameter store over communicator `Comm`: Note [Parameter stores].
template <class S, class Comm>
concept parameter_store =
    requires(S& s, const S& cs, const torch::nn::Module& model, std::size_t bucket, int rank,
             const GradientBuckets<Comm, typename S::gradient_hook>& grads, const std::function<void()>& f) {
      typename S::optimizer_type;
      { S::gathers_in_forward } -> std::convertible_to<bool>;
      { cs.layout() } -> std::same_as<const BucketLayout&>;
      { s.optimizer() } -> std::same_as<typename S::optimizer_type&>;
      { s.group() } -> std::same_as<Comm&>;
      { s.replicas() } -> std::same_as<Comm*>;
      s.begin_step();
      s.step(grads);
      s.end_step();
      s.replay_gathers(rank);
      s.on_gradients_complete(bucket);
      s.with_gathered(f);
      { cs.bytes() } -> std::same_as<ModelStateBytes>;
      { cs.exposed_seconds() } -> std::same_as<double>;
      { cs.checkpoint_layout(model) } -> std::same_as<CheckpointLayout>;
    };

}  // namespace paratrain
