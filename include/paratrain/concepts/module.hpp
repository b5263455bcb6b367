#pragma once
/// \file
/// paratrain::module and paratrain::stage_of — what a strategy needs from a model.

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>

#include <ATen/core/Tensor.h>
#include <c10/core/GradMode.h>

#include <concepts>
#include <cstddef>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "paratrain/core/move_to.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/concepts/loss.hpp"

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

template <class M>
using impl_of = std::remove_cvref_t<decltype(*std::declval<M&>())>;

/// The parameter and result types of a member function: a module's forward.
template <class F>
struct member_signature {
  static_assert(sizeof(F) == 0,
                "paratrain: a module's forward must be one non-static member function (not a template, not "
                "overloaded): paratrain reads its parameters and result off its type");
};
template <class R, class C, class... A>
struct member_signature<R (C::*)(A...)> {
  using result = R;
  using parameters = std::tuple<A...>;  ///< as declared
  using args = std::tuple<std::remove_cvref_t<A>...>;
};
template <class R, class C, class... A>
struct member_signature<R (C::*)(A...) const> : member_signature<R (C::*)(A...)> {};
template <class R, class C, class... A>
struct member_signature<R (C::*)(A...) noexcept> : member_signature<R (C::*)(A...)> {};
template <class R, class C, class... A>
struct member_signature<R (C::*)(A...) const noexcept> : member_signature<R (C::*)(A...)> {};

/// A forward that is one function (not overloaded, not a template), so that its
/// parameters can be read off its type.
template <class M>
concept plain_forward = requires { &impl_of<M>::forward; };

/// Of a plain_forward: what it returns, and its parameters without references and const.
template <class M>
using forward_result_t = std::remove_cvref_t<typename member_signature<decltype(&impl_of<M>::forward)>::result>;
template <class M>
using forward_args_t = typename member_signature<decltype(&impl_of<M>::forward)>::args;

/// How many tensors M's forward takes: its parameter count when forward is one function
/// of tensors only; 1 otherwise (an overloaded forward that takes a tensor).
template <class M>
consteval std::size_t forward_arity() {
  if constexpr (plain_forward<M>) {
    using Args = forward_args_t<M>;
    if constexpr (all_tensors<Args>) return std::tuple_size_v<Args>;
    else return 1;
  } else {
    return 1;
  }
}

/// Whether M's forward can be called with as many tensors as Seq has indices (a forward
/// with defaulted trailing tensors, as LibTorch's Transformer layers have, takes fewer).
template <class M, class Seq>
inline constexpr bool forward_takes = false;
template <class M, std::size_t... I>
inline constexpr bool forward_takes<M, std::index_sequence<I...>> =
    requires(M& m, const at::Tensor& t) { m->forward((static_cast<void>(I), t)...); };

template <class M, std::size_t... I>
decltype(auto) forward_with(M& model, const std::vector<at::Tensor>& inputs, std::index_sequence<I...>) {
  return model->forward(inputs[I]...);
}

/// Sets `out` to M's forward of the first K + 1 inputs where there are K + 1 and forward takes
/// that many, trying K = First, First + 1, ... below N. A recursion rather than a fold over a
/// lambda: g++ 14 fails on the fold (an internal compiler error in tsubst).
template <std::size_t First, std::size_t N, class M, class Result>
void forward_first_fitting(M& model, const std::vector<at::Tensor>& inputs, std::optional<Result>& out) {
  if constexpr (First < N) {
    if constexpr (forward_takes<M, std::make_index_sequence<First + 1>>)
      if (!out && inputs.size() == First + 1) out = forward_with(model, inputs, std::make_index_sequence<First + 1>{});
    forward_first_fitting<First + 1, N>(model, inputs, out);
  }
}

/// Calls M's forward with `inputs` as its first arguments, in order (the rest defaulted).
template <class M>
auto forward(M& model, const std::vector<at::Tensor>& inputs) {
  constexpr auto n = forward_arity<M>();
  using Result = std::remove_cvref_t<decltype(forward_with(model, inputs, std::make_index_sequence<n>{}))>;
  std::optional<Result> out;
  forward_first_fitting<0, n>(model, inputs, out);
  if (!out)
    throw error("forward", -1,
                "the model's forward takes " + std::to_string(n) + " tensor(s) and cannot be called with the batch's " +
                    std::to_string(inputs.size()) + " input(s); give the data set one input tensor per argument");
  return std::move(*out);
}

/// Evaluation mode and no gradients for a module while it lives; its mode restored after,
/// also when forward throws.
class EvalMode {
 public:
  explicit EvalMode(torch::nn::Module& m) : module_(m), training_(m.is_training()) { module_.eval(); }
  EvalMode(const EvalMode&) = delete;
  EvalMode& operator=(const EvalMode&) = delete;
  ~EvalMode() { module_.train(training_); }

 private:
  c10::NoGradGuard no_grad_;
  torch::nn::Module& module_;
  bool training_;
};

/// `tensors`, each on `device` (no copy where one is there already): detail::move_to, Note
/// [One move per batch].
inline std::vector<at::Tensor> to_device(const std::vector<at::Tensor>& tensors, at::Device device) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const auto& t : tensors) out.push_back(move_to(t, device));
  return out;
}

/// What M's forward returns, as a paratrain::model_output: its result where that is a
/// tuple of tensors, else a tensor (a forward whose result converts to one).
template <class M, bool = plain_forward<M>>
struct model_output_of {
  using type = at::Tensor;
};
template <class M>
struct model_output_of<M, true> {
  using type = std::conditional_t<all_tensors<forward_result_t<M>>, forward_result_t<M>, at::Tensor>;
};
template <class M>
using model_output_t = typename model_output_of<M>::type;

/// `model`'s output for `inputs`: evaluation mode, no gradients, the mode restored after.
template <class M>
model_output_t<M> predict(M& model, const std::vector<at::Tensor>& inputs) {
  EvalMode eval(*model);
  return forward(model, inputs);
}

}  // namespace detail

/// A whole model: a module whose forward takes one or more tensors (the inputs of a
/// batch, in order) and returns a tensor (the output the loss compares with the targets)
/// or a std::tuple of tensors (outputs a batch_loss reads: two heads, an auxiliary loss).
template <class M>
concept model = module<M> && (stage_of<M, at::Tensor, at::Tensor> ||
                              (detail::plain_forward<M> && detail::all_tensors<detail::forward_args_t<M>> &&
                               (std::convertible_to<detail::forward_result_t<M>, at::Tensor> ||
                                detail::all_tensors<detail::forward_result_t<M>>)));

/// Checks that M is a module handle, with a message that says what one is.
template <class M>
consteval bool explain_module() {
  static_assert(module<M>,
                "paratrain: the model must be a LibTorch module handle: a TORCH_MODULE(Net) holder or "
                "std::shared_ptr<NetImpl>, where NetImpl derives from torch::nn::Module");
  return true;
}

/// Checks each requirement on a model separately, so that the message names the one missed.
/// Strategies check it where they call the model's forward (a pipeline's stage group has none).
template <class M>
consteval bool explain_model() {
  static_assert(explain_module<M>());
  static_assert(model<M>,
                "paratrain: the model's forward must take one or more torch::Tensor and return a torch::Tensor (or a "
                "std::tuple of them); give it `torch::Tensor forward(torch::Tensor x)` (or `forward(torch::Tensor "
                "src, torch::Tensor tgt)`, one argument per input tensor of the data set)");
  return true;
}


}  // namespace paratrain
