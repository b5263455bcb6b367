#pragma once
/// \file
/// paratrain::Recompute — activation checkpointing: a layer whose activations are not kept
/// for backward but computed again there, under every strategy.

#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <ATen/core/grad_mode.h>
#include <ATen/core/ivalue.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/nn/pimpl.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "paratrain/concepts/module.hpp"
#include "paratrain/core/backward_scale.hpp"
#include "paratrain/util/torch_compat.hpp"
#include "paratrain/strategy/layer_wrapper.hpp"
#include "paratrain/strategy/unit.hpp"

namespace paratrain {

// Note [Recomputing activations]
// A layer declared as `paratrain::Recompute<Layer>` runs its forward without recording a
// graph, so none of its inner activations are kept: only its tensor arguments are. Its
// output hangs from one autograd node (detail::RecomputeFunction) whose inputs are those
// arguments *and the layer's parameters*. When backward reaches the node, it runs the
// layer's forward again, with the random-number and autocast state forward had (dropout
// draws the same mask), and takes the gradients of the recomputed output with
// torch::autograd::grad: never with backward(), so nothing accumulates inside the node.
// The parameters' gradients are the node's own outputs, delivered to their accumulators
// by the outer backward like any other operation's, exactly once. Hence:
//
//  - DDP's gradient-ready hooks fire once per parameter and in one backward pass (the
//    "Expected to mark a variable ready only once" of reentrant checkpointing under
//    PyTorch's DDP, pytorch#65537, cannot arise);
//  - ZeRO-3: write `paratrain::Unit<paratrain::Recompute<Layer>>`. The unit gathers the
//    parameters before forward and again before the node's backward (Note [Units]), so
//    the recomputation finds them whole; the reverse order would gather twice;
//  - a zero-bubble pipeline's split backward (Note [Splitting backward]) asks the node for
//    its inputs' gradients in B and for its parameters' in W: the node computes only what
//    it is asked for (ctx->needs_input_grad), recomputing the forward in each half.
//
// The price: the layer's forward runs twice per step (once more in W where a schedule
// splits backward), and the arguments are kept. Layers whose forward returns one tensor
// and takes tensors (defined or not) and other values by copy: the Transformer's encoder
// and decoder layers, a block of your own.

namespace detail {

/// The random-number and autocast state of the thread as a layer's forward ran, to run it
/// again under the same state.
struct ForwardState {
  at::Tensor cpu_rng;
  std::optional<at::Device> device;  ///< a GPU among the inputs: its generator too
  at::Tensor device_rng;
  bool autocast_cpu = false, autocast_gpu = false, autocast_cache = true;
  at::ScalarType autocast_cpu_dtype = at::kBFloat16, autocast_gpu_dtype = at::kHalf;
  double backward_scale = 1;  ///< BackwardScale: a layer's loss added in backward (Note [Auxiliary loss in backward])

  static at::Tensor rng_of(at::Device d) {
    auto g = at::globalContext().defaultGenerator(d);
    std::lock_guard<std::mutex> lock(g.mutex());
    return g.get_state();
  }
  static void set_rng(at::Device d, const at::Tensor& state) {
    auto g = at::globalContext().defaultGenerator(d);
    std::lock_guard<std::mutex> lock(g.mutex());
    g.set_state(state);
  }

  static ForwardState now(const std::vector<at::Tensor>& inputs) {
    ForwardState s;
    s.cpu_rng = rng_of(at::kCPU);
    for (const auto& x : inputs)
      if (x.defined() && !x.is_cpu()) {
        s.device = x.device();
        s.device_rng = rng_of(x.device());
        break;
      }
    s.autocast_cpu = detail::autocast_enabled(c10::DeviceType::CPU);
    s.autocast_gpu = detail::autocast_enabled(c10::DeviceType::CUDA);
    s.autocast_cpu_dtype = detail::autocast_dtype(c10::DeviceType::CPU);
    s.autocast_gpu_dtype = detail::autocast_dtype(c10::DeviceType::CUDA);
    s.autocast_cache = at::autocast::is_autocast_cache_enabled();
    s.backward_scale = BackwardScale::current();
    return s;
  }
};

/// Puts a ForwardState in place for its lifetime, and the thread's own back after (as
/// torch.random.fork_rng does): recomputing draws nothing from the training's stream.
class StateScope {
 public:
  explicit StateScope(const ForwardState& s)
      : saved_(ForwardState::now({})), device_(s.device), backward_scale_(s.backward_scale) {
    if (device_) saved_device_rng_ = ForwardState::rng_of(*device_);
    apply(s, s.device_rng);
    // Autocast's cache of cast weights lives until the outermost autocast region ends,
    // which in backward is none: casts cached here would outlive the optimizer step.
    at::autocast::set_autocast_cache_enabled(false);
  }
  ~StateScope() { apply(saved_, saved_device_rng_); }
  StateScope(const StateScope&) = delete;
  StateScope& operator=(const StateScope&) = delete;

 private:
  void apply(const ForwardState& s, const at::Tensor& device_rng) {
    ForwardState::set_rng(at::kCPU, s.cpu_rng);
    if (device_) ForwardState::set_rng(*device_, device_rng);
    detail::set_autocast_enabled(c10::DeviceType::CPU, s.autocast_cpu);
    detail::set_autocast_enabled(c10::DeviceType::CUDA, s.autocast_gpu);
    detail::set_autocast_dtype(c10::DeviceType::CPU, s.autocast_cpu_dtype);
    detail::set_autocast_dtype(c10::DeviceType::CUDA, s.autocast_gpu_dtype);
    at::autocast::set_autocast_cache_enabled(s.autocast_cache);
  }
  ForwardState saved_;
  std::optional<at::Device> device_;
  BackwardScale backward_scale_;  // forward's, while it runs again
  at::Tensor saved_device_rng_;
};

/// What the node needs to run a layer's forward again: the call (its non-tensor
/// arguments bound), the layer's parameters, and the state forward ran under.
struct Recomputation : torch::CustomClassHolder {
  std::function<at::Tensor(const std::vector<at::Tensor>&)> forward;  ///< every tensor argument, in order
  std::function<std::vector<at::Tensor>()> parameters;                ///< those requiring a gradient
  /// Which tensor arguments were defined: only those are the node's inputs (autograd
  /// takes no undefined tensor as a Function's input).
  std::vector<bool> defined;
  std::size_t inputs = 0;  ///< the defined ones
  std::size_t parameter_count = 0;
  ForwardState state;

  /// Every tensor argument, from the defined ones.
  [[nodiscard]] std::vector<at::Tensor> arguments(const std::vector<at::Tensor>& inputs_) const {
    std::vector<at::Tensor> all;
    std::size_t k = 0;
    for (const bool d : defined) all.push_back(d ? inputs_.at(k++) : at::Tensor());
    return all;
  }
};

/// The node of Note [Recomputing activations]: inputs are the layer's tensor arguments
/// then its parameters; forward runs without a graph, backward recomputes.
struct RecomputeFunction : torch::autograd::Function<RecomputeFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList tensors,
                            const c10::intrusive_ptr<Recomputation>& r) {
    std::vector<at::Tensor> inputs(tensors.begin(), tensors.begin() + static_cast<std::ptrdiff_t>(r->inputs));
    ctx->save_for_backward(inputs);
    ctx->saved_data["recomputation"] = c10::IValue::make_capsule(r);
    return r->forward(r->arguments(inputs));  // grad mode is off here: no graph, no activations kept
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto r = c10::static_intrusive_pointer_cast<Recomputation>(ctx->saved_data["recomputation"].toCapsule());
    const auto saved = ctx->get_saved_variables();
    const auto parameters = r->parameters();
    TORCH_CHECK(parameters.size() == r->parameter_count,
                "paratrain::Recompute: the layer has ", parameters.size(), " parameters requiring a gradient in "
                "backward but had ", r->parameter_count, " in forward");
    // One gradient per input of the node (the tensors, then the Recomputation argument).
    torch::autograd::variable_list out(r->inputs + parameters.size() + 1);
    std::vector<at::Tensor> inputs, wanted;
    std::vector<std::size_t> where;
    for (std::size_t i = 0; i < saved.size(); ++i) {
      const auto& x = saved[i];
      const bool differentiable = x.requires_grad();
      inputs.push_back(differentiable ? x.detach().requires_grad_(true) : x.detach());
      if (differentiable && ctx->needs_input_grad(i)) wanted.push_back(inputs.back()), where.push_back(i);
    }
    for (std::size_t j = 0; j < parameters.size(); ++j)
      if (ctx->needs_input_grad(r->inputs + j)) wanted.push_back(parameters[j]), where.push_back(r->inputs + j);
    if (wanted.empty()) return out;
    at::Tensor y;
    {
      at::AutoGradMode grad(true);
      const StateScope state(r->state);
      y = r->forward(r->arguments(inputs));
    }
    TORCH_CHECK(y.requires_grad(), "paratrain::Recompute: the recomputed output does not depend on what needs a "
                                   "gradient; was the layer's forward the same as in forward?");
    const auto g = torch::autograd::grad({y}, wanted, {grads.at(0)}, /*retain_graph=*/false, /*create_graph=*/false,
                                         /*allow_unused=*/true);
    for (std::size_t k = 0; k < where.size(); ++k) out[where[k]] = g[k];
    return out;
  }
};

template <class T>
inline constexpr bool is_tensor_v = std::is_same_v<std::remove_cvref_t<T>, at::Tensor>;

/// Arguments the node cannot see through: tensors it would not recompute from.
template <class T>
inline constexpr bool hides_tensors_v = !is_tensor_v<T> && (std::is_convertible_v<T, at::TensorList> ||
                                                            std::is_convertible_v<T, c10::optional<at::Tensor>>);

}  // namespace detail

/// The implementation behind `Recompute<Layer>`: `Layer`'s implementation, whose forward
/// keeps no activations for backward and recomputes them there. Note [Recomputing activations],
/// Note [Layer wrappers].
template <class Impl, class Args = detail::forward_parameters_t<Impl>>
class RecomputeImpl;

template <class Impl, class... A>
class RecomputeImpl<Impl, std::tuple<A...>> : public Impl {
  static_assert(!std::is_base_of_v<detail::UnitBase, Impl>,
                "paratrain: write paratrain::Unit<paratrain::Recompute<Layer>>, not Recompute<Unit<Layer>>: the unit "
                "must gather the parameters before the recomputation (Note [Recomputing activations])");
  static_assert((!detail::hides_tensors_v<A> && ...),
                "paratrain: Recompute takes layers whose forward's tensor arguments are plain torch::Tensor "
                "parameters (not lists or optionals of tensors)");

 public:
  using Impl::Impl;

  at::Tensor forward(A... args) {
    using Out = decltype(Impl::forward(std::forward<A>(args)...));
    static_assert(std::is_same_v<std::remove_cvref_t<Out>, at::Tensor>,
                  "paratrain: a Recompute layer's forward must return one torch::Tensor; make the layer a block "
                  "whose forward returns a Tensor");
    // Off, or no backward to come (evaluation): the layer's own forward.
    if (!recompute_ || !at::GradMode::is_enabled()) return Impl::forward(std::forward<A>(args)...);

    // The call, its tensors taken out (the node keeps them) and the rest bound by copy.
    Bound bound(args...);
    std::vector<at::Tensor> tensors;
    std::apply([&](auto&... v) { (take(v, tensors), ...); }, bound);
    auto r = c10::make_intrusive<detail::Recomputation>();
    r->state = detail::ForwardState::now(tensors);
    for (const auto& t : tensors) r->defined.push_back(t.defined());
    std::erase_if(tensors, [](const at::Tensor& t) { return !t.defined(); });
    r->inputs = tensors.size();
    r->forward = [this, bound = std::move(bound)](const std::vector<at::Tensor>& xs) {
      auto call = bound;
      std::size_t k = 0;
      std::apply([&](auto&... v) { (put(v, xs, k), ...); }, call);
      return invoke(call, std::index_sequence_for<A...>{});
    };
    r->parameters = [this] { return trainable(); };
    auto parameters = trainable();
    r->parameter_count = parameters.size();
    tensors.insert(tensors.end(), parameters.begin(), parameters.end());
    return detail::RecomputeFunction::apply(at::TensorList(tensors), r);
  }

  /// Whether forward keeps no activations and backward recomputes them (the default), or
  /// the layer runs as itself: a switch at run time, e.g. from a command line.
  void set_recompute(bool on) noexcept { recompute_ = on; }
  [[nodiscard]] bool recomputes() const noexcept { return recompute_; }

 private:
  using Bound = std::tuple<std::decay_t<A>...>;

  template <class T>
  static void take(T& x, std::vector<at::Tensor>& out) {
    if constexpr (detail::is_tensor_v<T>) out.push_back(std::exchange(x, at::Tensor()));
  }
  template <class T>
  static void put(T& x, const std::vector<at::Tensor>& xs, std::size_t& k) {
    if constexpr (detail::is_tensor_v<T>) x = xs[k++];
  }
  template <std::size_t... I>
  at::Tensor invoke(Bound& call, std::index_sequence<I...>) {
    return Impl::forward(std::get<I>(call)...);
  }

  bool recompute_ = true;

  std::vector<at::Tensor> trainable() {
    std::vector<at::Tensor> out;
    for (auto& p : this->parameters())
      if (p.requires_grad()) out.push_back(p);
    return out;
  }
};

/// A layer whose activations are recomputed in backward instead of kept (activation
/// checkpointing): `paratrain::Recompute<torch::nn::TransformerEncoderLayer>`, and under
/// ZeRO-3 `paratrain::Unit<paratrain::Recompute<Layer>>`. Same parameters, names and
/// results as `Layer`; forward runs once more in backward. Note [Recomputing activations].
template <class Layer>
class Recompute : public LayerHolder<RecomputeImpl, Layer> {
 public:
  using LayerHolder<RecomputeImpl, Layer>::LayerHolder;
};

}  // namespace paratrain
