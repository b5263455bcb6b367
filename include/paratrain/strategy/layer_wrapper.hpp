#pragma once
/// \file
/// paratrain::LayerHolder — what every layer wrapper shares (Unit, Recompute, and the
/// layers to come): a module holder of `Wrapper<Layer's implementation, its forward's
/// parameters>`, so that the wrapper *is* the layer (its parameters, names, options and
/// clone() unchanged) with a forward of its own around the layer's (Note [Layer wrappers]).

#include <torch/nn/pimpl.h>

#include "paratrain/concepts/module.hpp"

namespace paratrain {

// Note [Layer wrappers]
// ~~~~~~~~~~~~~~~~~~~~~
// A wrapper changes what happens around a layer's forward and leaves the layer alone: ZeRO-3
// gathers a Unit's parameters before it and frees them after (Note [Units]); Recompute runs
// it without keeping activations (Note [Recomputing activations]). (Tensor-parallel layers
// are layers of their own, not wrappers: Note [Regions].) Each is written as `XImpl<Impl, std::tuple<A...>>`,
// deriving from the layer's implementation `Impl` (inheriting its constructors) with a
// `forward(A...)` that calls `Impl::forward`: LibTorch's ModuleHolder needs a forward that is
// not a template, so the wrapper repeats the parameter list read off the layer's one forward
// (detail::forward_parameters_t). `X<Layer>` is then LayerHolder<XImpl, Layer>. Wrappers
// nest: `Unit<Recompute<Layer>>` is a unit whose layer recomputes.

namespace detail {
/// The parameters of `Impl`'s one forward, as declared, as a std::tuple.
template <class Impl>
using forward_parameters_t = typename member_signature<decltype(&Impl::forward)>::parameters;
}  // namespace detail

/// The module holder of `Wrapper` around `Layer` (a TORCH_MODULE holder): Note [Layer wrappers].
template <template <class, class> class Wrapper, class Layer>
class LayerHolder : public torch::nn::ModuleHolder<Wrapper<typename Layer::ContainedType,
                                                           detail::forward_parameters_t<typename Layer::ContainedType>>> {
  using Base = torch::nn::ModuleHolder<
      Wrapper<typename Layer::ContainedType, detail::forward_parameters_t<typename Layer::ContainedType>>>;

 public:
  using Base::Base;
};

}  // namespace paratrain
