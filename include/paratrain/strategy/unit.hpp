#pragma once
/// \file
/// paratrain::Unit — marks a layer (or block) of a model as one unit of ZeRO stage 3:
/// its parameters are gathered just before its forward and its backward, and freed after.

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/pimpl.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

#include "paratrain/concepts/module.hpp"
#include "paratrain/strategy/layer_wrapper.hpp"
#include "paratrain/strategy/stores/sharded_construction.hpp"

namespace paratrain {

// Note [Units]
// LibTorch's C++ modules have no forward pre-hooks, so ZeRO stage 3 cannot discover on
// its own when a layer is about to run. The model says so instead: a layer declared as
// `paratrain::Unit<torch::nn::Linear>` (or any `Unit<YourBlock>`) *is* that layer (it
// derives from its implementation, so parameter names, options and clone() are
// unchanged) with a forward that tells the strategy before and after it runs. Its
// output passes through an identity autograd node whose backward runs before the
// layer's own backward nodes (autograd reaches it first), which is where the strategy
// gathers the layer's parameters again. Under every other strategy the unit is not
// attached and its forward is the layer's, plus one pointer test. Built inside a
// ShardedConstruction, a unit keeps only its shard from the end of its constructor on
// (Note [Sharded construction]).

namespace detail {

/// What a unit reports to the strategy that shards it (ZeRO stage 3).
class UnitObserver {
 public:
  virtual void before_forward(std::size_t unit) = 0;
  /// `out`: the unit's output (autograd's graph of its forward ends there).
  virtual void after_forward(std::size_t unit, const at::Tensor& out) = 0;
  virtual void before_backward(std::size_t unit) = 0;

 protected:
  ~UnitObserver() = default;
};

/// The part of every Unit the strategy finds with dynamic_cast while walking the model.
class UnitBase {
 public:
  void attach(UnitObserver* observer, std::size_t index) noexcept {
    observer_ = observer;
    index_ = index;
  }
  /// This rank's shards, when the unit was built inside a ShardedConstruction; else null.
  [[nodiscard]] const std::shared_ptr<ConstructedUnit>& constructed() const noexcept { return constructed_; }
  /// Hands the shards over (to the strategy that adopts them).
  std::shared_ptr<ConstructedUnit> take_constructed() noexcept { return std::move(constructed_); }

 protected:
  ~UnitBase() = default;
  /// Called by the unit at the end of its construction: Note [Sharded construction].
  bool shard_if_constructing(torch::nn::Module& self) {
    if (auto* scope = ShardedConstruction::current()) constructed_ = scope->shard(self);
    return constructed_ != nullptr;
  }
  UnitObserver* observer_ = nullptr;
  std::size_t index_ = 0;
  std::shared_ptr<ConstructedUnit> constructed_;
};

/// Identity in forward; in backward, tells the observer before the unit's own backward.
struct BeforeBackward : torch::autograd::Function<BeforeBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor x, std::int64_t observer,
                            std::int64_t index) {
    ctx->saved_data["observer"] = observer;
    ctx->saved_data["index"] = index;
    return x;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto* observer = reinterpret_cast<UnitObserver*>(ctx->saved_data["observer"].toInt());
    observer->before_backward(static_cast<std::size_t>(ctx->saved_data["index"].toInt()));
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

}  // namespace detail

/// The implementation behind `Unit<Layer>`: `Layer`'s implementation, reporting to a
/// ZeRO-3 strategy around its forward. Note [Units], Note [Layer wrappers].
template <class Impl, class Args = detail::forward_parameters_t<Impl>>
class UnitImpl;

template <class Impl, class... A>
class UnitImpl<Impl, std::tuple<A...>> : public Impl, public detail::UnitBase {
 public:
  using Impl::Impl;

  at::Tensor forward(A... args) {
    using Out = decltype(Impl::forward(std::forward<A>(args)...));
    static_assert(std::is_same_v<std::remove_cvref_t<Out>, at::Tensor>,
                  "paratrain: a Unit's forward must return one torch::Tensor (ZeRO stage 3 attaches its backward "
                  "gather to it); make the unit a block whose forward returns a Tensor");
    if (observer_ == nullptr) return Impl::forward(std::forward<A>(args)...);
    observer_->before_forward(index_);
    at::Tensor out = Impl::forward(std::forward<A>(args)...);
    observer_->after_forward(index_, out);
    if (!at::GradMode::is_enabled() || !out.requires_grad()) return out;
    return detail::BeforeBackward::apply(out, reinterpret_cast<std::int64_t>(observer_),
                                         static_cast<std::int64_t>(index_));
  }

 private:
  // Initialised after both bases, by every constructor (the inherited ones too): the end
  // of the unit's construction. Note [Sharded construction].
  bool sharded_at_construction_ = shard_if_constructing(*this);
};

/// A layer that is one unit of ZeRO stage 3 and an ordinary layer everywhere else:
/// `paratrain::Unit<torch::nn::Linear> fc{nullptr};` then
/// `fc = register_module("fc", paratrain::Unit<torch::nn::Linear>(128, 10));`. Note [Units].
template <class Layer>
class Unit : public LayerHolder<UnitImpl, Layer> {
 public:
  using LayerHolder<UnitImpl, Layer>::LayerHolder;
};

}  // namespace paratrain
