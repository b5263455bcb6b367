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

#include "paratrain/comm/mesh.hpp"
#include "paratrain/concepts/checkpointable.hpp"
#include "paratrain/concepts/optimizer_state.hpp"
#include "paratrain/strategy/buckets/bucket_layout.hpp"
#include "paratrain/strategy/buckets/gradient_buckets.hpp"
#include "paratrain/strategy/buckets/gradient_storage.hpp"
#include "paratrain/strategy/detail/tensor_bytes.hpp"
#include "paratrain/plan/plan.hpp"
#include "paratrain/strategy/stores/sharded_construction.hpp"

namespace paratrain {

// Note [Parameter stores]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// The step protocol (ReplicaSteps: buckets, the step agreement, clipping, NaN checks,
// join) asks a parameter store the one question that differs between DDP and ZeRO: who
// holds the parameters and who steps them. The two stores:
//
//   ReplicatedParameters  every rank holds every parameter and steps all of them (DDP);
//   ShardedParameters     each rank steps its shard, stage 3 also keeps only that shard of
//                         each Unit's parameters at rest (ZeRO 1-3, Note [Shard layout]).
//
// A store (the parameter_store concept below) owns everything that depends on it:
// - construction: `construct(build, mesh, options)` calls a build function as the store
//   needs it (inside a ShardedConstruction at stage 3: Note [Sharded construction]) and
//   places the model; and the plan: `plan(model, mesh, options, optimizer, inputs)` is the
//   memory plan of the model under it before anything is allocated (Note [Checking the
//   plan]), `planned(plan)` the same once it runs (ZeRO-3's gathers in the compute type);
// - the BucketLayout over the model's parameters (padding and units are its choice), kept
//   at a stable address for the store's lifetime: GradientBuckets points at it;
// - where gradients accumulate and what is kept of their sum (`gradient_storage`: whole or
//   sharded), the ranks each bucket is summed over (`gradient_ranks(b)`: a group, and its
//   replicas for hybrid sharding: Note [Hybrid sharding]; experts' and dense parameters'
//   buckets their own: Note [Expert buckets]), and the mesh dimensions its sums are cut
//   along (`partitions`): the ranks whose parts make up the whole gradient, over which
//   clipping's norm is summed;
// - whether forward gathers parameters (`gathers_in_forward`: Note [Unusable batches]);
// - the optimizer, with the user's parameter groups (Note [Optimizer on pieces]);
// - around every step: begin_step() when a new step's gradients start, step(grads) with
//   the summed gradients, end_step() after a step in which this rank ran forward, and
//   replay_gathers() in a step in which it ran none (Note [Joining at stage 3]);
// - on_gradients_complete(b) when bucket b's gradients are all ready in a backward;
// - with_gathered(f): run f with every parameter whole (collective where it gathers);
// - bytes() held between steps for parameters and optimizer state (gradients are the
//   buckets'), and checkpoint_layout(model): where each tensor lives on this rank;
// - exposed_seconds(): how long this step blocked on the store's own communication
//   (gathers), which the strategy's exposed_communication_seconds adds to the gradients'.
// Every call a store makes on a communicator is collective, in the same order on every
// rank. The strategy asks no "which stage?": a new store plugs in here.

/// What a strategy tells the parameter store it builds.
struct StoreOptions {
  /// The buckets' sizes (their padding is the store's).
  BucketOptions bucketing;
  /// DataParallelOptions::shard_group as given: the mesh carries the groups it spells (Note
  /// [Process mesh]); a store that shards nothing refuses one.
  int shard_group = 0;
  /// ZeRO-3: units gathered ahead of the one computing (Note [Pooled transients]).
  int prefetch = 1;
  /// ZeRO-3: the type units are gathered in for a forward under autocast to that type, and
  /// for its backward; empty: the parameters' own (Note [Gathers in the compute type]).
  std::optional<at::ScalarType> gather;
  /// Where and in which type a model the store builds is placed.
  BuildOptions build;
};

/// What the memory plan counts besides the model and the store (Note [Checking the plan]).
struct PlanInputs {
  bool autocast = false;       ///< forward under autocast: its copies of the weights
  bool narrow_reduce = false;  ///< gradients summed in a narrower type
  std::size_t activation_bytes = 0;
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
/// (optimizer_schema lists their state); 0 for others.
template <class Optim>
std::size_t optimizer_state_bytes(const Optim& o) {
  std::size_t n = 0;
  if constexpr (known_optimizer<Optim>) {
    using Schema = schema_of<Optim>;
    for (const auto& [key, state] : o.state())
      for (const auto& [field, t] : Schema::get(static_cast<const typename Schema::state_type&>(*state)).tensors)
        n += bytes_of(t);
  }
  return n;
}

}  // namespace detail

/// What a strategy asks of a parameter store over communicator `Comm`: Note [Parameter stores].
template <class S, class Comm>
concept parameter_store =
    gradient_storage<typename S::gradient_storage> &&
    requires(S& s, const S& cs, const torch::nn::Module& model, std::size_t bucket, int rank,
             const GradientBuckets<Comm, typename S::gradient_storage>& grads, const std::function<void()>& f,
             plan::Model m) {
      typename S::optimizer_type;
      { S::gathers_in_forward } -> std::convertible_to<bool>;
      { S::planned_stage } -> std::convertible_to<plan::stage>;
      { cs.layout() } -> std::same_as<const BucketLayout&>;
      { cs.gradients() } -> std::same_as<typename S::gradient_storage>;
      { s.gradient_ranks(bucket) } -> std::same_as<SumRanks<Comm>>;
      { cs.partitions() } -> std::same_as<Dims>;
      { s.optimizer() } -> std::same_as<typename S::optimizer_type&>;
      s.begin_step();
      s.step(grads);
      s.end_step();
      s.replay_gathers(rank);
      s.on_gradients_complete(bucket);
      s.with_gathered(f);
      { cs.bytes() } -> std::same_as<ModelStateBytes>;
      { cs.exposed_seconds() } -> std::same_as<double>;
      { cs.checkpoint_layout(model) } -> std::same_as<CheckpointLayout>;
      { cs.planned(m) } -> std::same_as<plan::Model>;
    };

}  // namespace paratrain
