#pragma once
/// \file
/// paratrain::module and paratrain::stage_of — what a strategy needs from a model.

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>

#include <concepts>
#include <type_traits>
#include <utility>

namespace paratrain {

/// A LibTorch module handle: a `TORCH_MODULE(Net)` holder, or `std::shared_ptr<NetImpl>`,
/// whose pointee derives from torch::nn::Module. Strategies hold the handle, so copies
/// of it share the one module, as in LibTorch.
template <class M>
concept module = std::copyable<M> && requires(M& m) {
  requires std::derived_from<std::remove_cvref_t<decltype(*m)>, torch::nn::Module>;
  { m->parameters() } -> std::same_as<std::vector<at::Tensor>>;
};

/// A module whose `forward` takes `In` and returns something convertible to `Out`:
/// one stage of a pipeline, or (with In = Out = at::Tensor) a whole model.
template <class M, class In, class Out>
concept stage_of = module<M> && requires(M& m, In in) {
  { m->forward(std::move(in)) } -> std::convertible_to<Out>;
};

/// A module that can be deep-copied with `clone()`, as in-process replication needs.
/// Every torch::nn::Module has a clone() that throws at run time unless the class
/// derives from torch::nn::Cloneable<Impl>; so the concept asks for that base.
template <class M>
concept cloneable_module = module<M> && requires(M& m) {
  requires std::derived_from<std::remove_cvref_t<decltype(*m)>,
                             torch::nn::Cloneable<std::remove_cvref_t<decltype(*m)>>>;
};

namespace detail {

/// `model`'s output for `input`: evaluation mode, no gradients, the mode restored after.
template <class M>
at::Tensor predict(M& model, const at::Tensor& input) {
  at::NoGradGuard no_grad;
  const bool training = model->is_training();
  model->eval();
  auto out = model->forward(input);
  model->train(training);
  return out;
}

}  // namespace detail

/// Checks each requirement on a model separately, so that the message names the one missed.
template <class M>
consteval bool explain_model() {
  static_assert(module<M>,
                "paratrain: the model must be a LibTorch module handle: a TORCH_MODULE(Net) holder or "
                "std::shared_ptr<NetImpl>, where NetImpl derives from torch::nn::Module");
  static_assert(stage_of<M, at::Tensor, at::Tensor>,
                "paratrain: the model's forward must take one torch::Tensor and return a torch::Tensor; "
                "give it `torch::Tensor forward(torch::Tensor x)`");
  return true;
}

}  // namespace paratrain
