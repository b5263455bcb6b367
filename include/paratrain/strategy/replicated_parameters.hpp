#pragma once
/// \file
/// paratrain::ReplicatedParameters — DDP's parameter store: every rank holds every
/// parameter whole and steps all of them (Note [Parameter stores]).

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstddef>
#include <memory>
#include <utility>

#include "paratrain/concepts/checkpointable.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/strategy/bucket_layout.hpp"
#include "paratrain/strategy/detail/state_slices.hpp"
#include "paratrain/strategy/detail/tensor_bytes.hpp"
#include "paratrain/strategy/gradient_buckets.hpp"
#include "paratrain/strategy/parameter_store.hpp"

namespace paratrain {

/// The parameters stay where the model has them, whole on every rank; the optimizer is
/// the user's, over the user's parameter groups; gradients are all-reduced whole. Every
/// step-protocol call but step() is a no-op: nothing is gathered, nothing is freed.
template <class Comm, class Optim>
class ReplicatedParameters {
 public:
  using optimizer_type = Optim;
  using gradient_hook = AllReduceGradients;
  static constexpr bool gathers_in_forward = false;

  /// Buckets `model`'s parameters (unpadded: nothing is sharded) and builds the optimizer.
  template <class OptimOptions>
  ReplicatedParameters(const torch::nn::Module& model, Comm& comm, const StoreOptions& options, ParamGroups groups,
                       OptimOptions defaults)
      : layout_(model, options.bucketing, [](auto&, auto&) { return -1; }, comm.rank()),
        comm_(&comm),
        optimizer_(std::make_unique<Optim>(std::move(groups), std::move(defaults))) {
    if (options.shard_group != 0 && options.shard_group != comm.size())
      throw error("DataParallel", comm.rank(),
                  "DataParallelOptions::shard_group is " + std::to_string(options.shard_group) +
                      ", but DDP shards nothing: hybrid sharding is a ZeRO option (Sharded<Optimizer, Stage>)");
  }

  ReplicatedParameters(const ReplicatedParameters&) = delete;
  ReplicatedParameters& operator=(const ReplicatedParameters&) = delete;

  [[nodiscard]] const BucketLayout& layout() const noexcept { return layout_; }
  [[nodiscard]] Optim& optimizer() noexcept { return *optimizer_; }
  /// Nothing is sharded: every rank reduces with every other (Note [Hybrid sharding]).
  [[nodiscard]] Comm& group() noexcept { return *comm_; }
  [[nodiscard]] Comm* replicas() noexcept { return nullptr; }

  void begin_step() noexcept {}
  /// Nothing is gathered: no time blocked on it.
  [[nodiscard]] double exposed_seconds() const noexcept { return 0; }
  /// Steps every parameter with its all-reduced gradient (a view into its bucket).
  template <class Hook>
  void step(const GradientBuckets<Comm, Hook>& /*grads*/) {
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

 private:
  BucketLayout layout_;
  Comm* comm_;
  std::unique_ptr<Optim> optimizer_;
};

}  // namespace paratrain
