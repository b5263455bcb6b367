#pragma once
/// \file
/// paratrain::ReplicatedParameters — DDP's parameter store: every rank holds every
/// parameter whole and steps all of them (Note [Parameter stores]).

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstddef>
#include <memory>
#include <utility>

#include "paratrain/collectives/model_device.hpp"
#include "paratrain/comm/mesh.hpp"
#include "paratrain/concepts/checkpointable.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/strategy/buckets/bucket_layout.hpp"
#include "paratrain/strategy/buckets/gradient_buckets.hpp"
#include "paratrain/strategy/buckets/gradient_storage.hpp"
#include "paratrain/strategy/detail/state_slices.hpp"
#include "paratrain/strategy/detail/tensor_bytes.hpp"
#include "paratrain/strategy/memory_check.hpp"
#include "paratrain/strategy/stores/parameter_store.hpp"
#include "paratrain/strategy/stores/sharded_construction.hpp"
#include "paratrain/tensor_parallel/sharding.hpp"

namespace paratrain {

/// The parameters stay where the model has them, whole on every rank; the optimizer is
/// the user's, over the user's parameter groups; gradients are summed whole over the ranks
/// that hold them (the mesh's replicas; a dense parameter's under expert parallelism with the
/// expert group too: Note [Expert buckets]), nothing sharded. Every
/// step-protocol call but step() is a no-op: nothing is gathered, nothing is freed.
template <class Comm, class Optim>
class ReplicatedParameters {
 public:
  using optimizer_type = Optim;
  using gradient_storage = WholeGradients;
  static constexpr bool gathers_in_forward = false;
  static constexpr plan::stage planned_stage = plan::stage::ddp;

  /// `build()`, placed as `options.build` says (default: the communicator's device).
  template <class Build>
  static auto construct(Build& build, Mesh<Comm>& mesh, const StoreOptions& options) {
    return detail::build_placed(build, options.build, detail::communicator_device(mesh.world()));
  }

  /// The memory plan of `model` held so (Note [Checking the plan]): nothing is sharded.
  template <class OptimOptions>
  static plan::Model plan(torch::nn::Module& model, Mesh<Comm>& mesh, const StoreOptions& options,
                          const OptimOptions& optimizer, const PlanInputs& inputs) {
    const BucketLayout probe(model, options.bucketing, [](auto&, auto&) { return -1; }, mesh.rank(),
                             tp::parameters_cut_over(model, Dim::expert));
    return detail::plan_of(model, mesh.size(Dims::replicas()), detail::largest_bucket(probe), options.prefetch, optimizer,
                           inputs.autocast, inputs.narrow_reduce, inputs.activation_bytes);
  }

  /// Buckets `model`'s parameters (unpadded: nothing is sharded) and builds the optimizer.
  template <class OptimOptions>
  ReplicatedParameters(torch::nn::Module& model, Mesh<Comm>& mesh, const StoreOptions& options, ParamGroups groups,
                       OptimOptions defaults)
      : layout_(model, options.bucketing, [](auto&, auto&) { return -1; }, mesh.rank(),
                tp::parameters_cut_over(model, Dim::expert)),
        group_(&mesh.gradient_group(Dims::replicas())),
        dense_group_(&mesh.gradient_group(Dims::batch())),
        optimizer_(std::make_unique<Optim>(std::move(groups), std::move(defaults))) {
    if (options.shard_group != 0 && options.shard_group != mesh.size(Dims::data()))
      throw error("DataParallel", mesh.rank(),
                  "DataParallelOptions::shard_group is " + std::to_string(options.shard_group) +
                      ", but DDP shards nothing: hybrid sharding is a ZeRO option (Sharded<Optimizer, Stage>)");
  }

  ReplicatedParameters(const ReplicatedParameters&) = delete;
  ReplicatedParameters& operator=(const ReplicatedParameters&) = delete;

  [[nodiscard]] const BucketLayout& layout() const noexcept { return layout_; }
  [[nodiscard]] Optim& optimizer() noexcept { return *optimizer_; }
  /// Every rank keeps every bucket's whole sum.
  [[nodiscard]] gradient_storage gradients() const { return WholeGradients(layout_); }
  /// An expert's over its replicas, a dense parameter's over the expert group too: Note
  /// [Expert buckets].
  [[nodiscard]] SumRanks<Comm> gradient_ranks(std::size_t bucket) const {
    return {layout_.buckets().at(bucket).expert ? group_ : dense_group_};
  }
  [[nodiscard]] Dims partitions() const noexcept { return {}; }

  void begin_step() noexcept {}
  /// Nothing is gathered: no time blocked on it.
  [[nodiscard]] double exposed_seconds() const noexcept { return 0; }
  /// Steps every parameter with its summed gradient (a view into its bucket).
  template <class Storage>
  void step(const GradientBuckets<Comm, Storage>& /*grads*/) {
    optimizer_->step();
  }
  void end_step() noexcept {}
  void replay_gathers(int /*rank*/) noexcept {}
  void on_gradients_complete(std::size_t /*bucket*/) noexcept {}
  /// Every parameter is whole already: runs `f`.
  template <class F>
  void with_gathered(F&& f) {
    std::forward<F>(f)();
  }

  /// Every parameter, and the optimizer's state over all of them.
  [[nodiscard]] ModelStateBytes bytes() const {
    ModelStateBytes out;
    for (const auto& p : layout_.params()) out.parameters += detail::bytes_of(p.tensor);
    out.optimizer_state = detail::optimizer_state_bytes(*optimizer_);
    return out;
  }
  /// Everything whole, on every rank.
  [[nodiscard]] CheckpointLayout checkpoint_layout(const torch::nn::Module& model) const {
    return detail::whole_model_layout(model);
  }
  /// The plan as it was: nothing changes once the strategy runs.
  [[nodiscard]] plan::Model planned(plan::Model m) const { return m; }

 private:
  BucketLayout layout_;
  Comm* group_;        // the replicas: Dims::replicas() (Note [Gradient communicators])
  Comm* dense_group_;  // and the expert group: Dims::batch()
  std::unique_ptr<Optim> optimizer_;
};

}  // namespace paratrain
