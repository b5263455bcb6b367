#pragma once
/// \file
/// paratrain::Chain — a model written as stages, run in order on one device: the
/// single-device twin of paratrain::Pipeline, whose same stages go to different ranks.

#include <torch/nn/cloneable.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstddef>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

#include "paratrain/concepts/module.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/pipeline/stages.hpp"

namespace paratrain {

// Note [Chain and Pipeline]
// A model written as stages trains under every strategy: `Chain<Features, Classifier>` is one
// module (stage i+1's forward takes what stage i's returns, checked at compile time as a
// Pipeline's stages are), and `Pipeline<Features, Classifier>` puts the same stages on
// different ranks. The Chain's state names are the Pipeline's ("0.fc.weight", "1.fc.bias",
// ...: Note [Stage names]), so a checkpoint of one loads into the other; with the strategy
// alias the only change, one program trains single-device, DP, DDP, ZeRO or pipelined
// (examples/quickstart). A Chain is Cloneable (LocalDataParallel's replicas) where every
// stage is; clone() clones each stage.

template <class... Stage>
class ChainImpl;

namespace detail {

template <class T>
inline constexpr bool is_tuple = false;
template <class... T>
inline constexpr bool is_tuple<std::tuple<T...>> = true;

/// The Chain's forward, with the first stage's parameters and the last stage's result, so
/// that paratrain reads them off its type as of any module (plain_forward).
template <class Derived, class Args, class Result>
struct ChainForward;
template <class Derived, class... A, class Result>
struct ChainForward<Derived, std::tuple<A...>, Result> {
  Result forward(A... inputs) { return static_cast<Derived*>(this)->template run<0>(std::move(inputs)...); }
};

template <class... Stage>
using first_stage = std::tuple_element_t<0, std::tuple<Stage...>>;
template <class... Stage>
using last_stage = std::tuple_element_t<sizeof...(Stage) - 1, std::tuple<Stage...>>;

}  // namespace detail

template <class... Stage>
class ChainImpl : public torch::nn::Cloneable<ChainImpl<Stage...>>,
                  public detail::ChainForward<ChainImpl<Stage...>, detail::forward_args_t<detail::first_stage<Stage...>>,
                                              detail::forward_result_t<detail::last_stage<Stage...>>> {
  static_assert(sizeof...(Stage) >= 1, "paratrain: a Chain needs at least one stage");
  static_assert(detail::check_stages<Stage...>(std::index_sequence_for<Stage...>{}));
  template <class, class, class>
  friend struct detail::ChainForward;

 public:
  static constexpr std::size_t size = sizeof...(Stage);

  /// Each stage default-constructed.
  ChainImpl()
    requires(std::default_initializable<Stage> && ...)
      : ChainImpl(Stage()...) {}
  /// The stages given, in order.
  explicit ChainImpl(Stage... stages) : stages_(std::move(stages)...) { register_all(std::index_sequence_for<Stage...>{}); }

  /// Cloneable's: the copy clone() makes re-registers a clone of each stage. A stage that
  /// is not Cloneable cannot be copied: an error, rather than a replica of other values.
  void reset() override {
    if constexpr ((cloneable_module<Stage> && ...)) {
      clone_all(std::index_sequence_for<Stage...>{});
      register_all(std::index_sequence_for<Stage...>{});
    } else {
      throw error("Chain::clone", -1,
                  "a stage of this Chain is not Cloneable (derive its module from torch::nn::Cloneable<Impl>), so "
                  "the Chain cannot be copied (LocalDataParallel's replicas need copies)");
    }
  }

  /// Stage I, as given.
  template <std::size_t I>
  [[nodiscard]] auto& stage() noexcept {
    return std::get<I>(stages_);
  }

 private:
  template <std::size_t... I>
  void register_all(std::index_sequence<I...>) {
    (this->register_module(std::to_string(I), std::get<I>(stages_)), ...);
  }
  template <std::size_t... I>
  void clone_all(std::index_sequence<I...>) {
    ((std::get<I>(stages_) =
          Stage(std::dynamic_pointer_cast<typename Stage::ContainedType>(std::get<I>(stages_)->clone()))),
     ...);
  }

  /// Stage I's forward of `inputs`, then the stages after it.
  template <std::size_t I, class... X>
  auto run(X&&... inputs) {
    auto out = std::get<I>(stages_)->forward(std::forward<X>(inputs)...);
    if constexpr (I + 1 == size) {
      return out;
    } else if constexpr (detail::is_tuple<decltype(out)>) {
      return std::apply([this](auto&&... t) { return run<I + 1>(std::move(t)...); }, std::move(out));
    } else {
      return run<I + 1>(std::move(out));
    }
  }

  std::tuple<Stage...> stages_;
};

/// The module holder of ChainImpl<Stage...>, as TORCH_MODULE makes for a module of one's own.
template <class... Stage>
class Chain : public torch::nn::ModuleHolder<ChainImpl<Stage...>> {
 public:
  using torch::nn::ModuleHolder<ChainImpl<Stage...>>::ModuleHolder;
  using Impl = ChainImpl<Stage...>;
};

}  // namespace paratrain
