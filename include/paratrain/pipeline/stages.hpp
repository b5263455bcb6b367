#pragma once
/// \file
/// paratrain::Pipeline — a model cut into stages, each a module of its own, chained at
/// compile time: stage i+1's forward takes what stage i's returns.

#include <torch/nn/module.h>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "paratrain/concepts/module.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain {
namespace detail {

/// Whether a stage's forward returns tensors (one, or a tuple of them), and how many.
template <class R>
inline constexpr bool tensor_outputs = std::same_as<R, at::Tensor> || all_tensors<R>;
template <class R>
inline constexpr std::size_t output_count = 1;
template <class... T>
inline constexpr std::size_t output_count<std::tuple<T...>> = sizeof...(T);

/// Checks one stage on its own: a module with one forward of tensors, returning tensors.
template <std::size_t I, class Stage>
consteval bool explain_stage() {
  static_assert(module<Stage>,
                "paratrain: a Pipeline stage must be a LibTorch module handle (a TORCH_MODULE(Stage) holder or "
                "std::shared_ptr<StageImpl>); see the stage's index and type in this instantiation");
  static_assert(plain_forward<Stage>,
                "paratrain: a Pipeline stage needs exactly one forward, not overloaded and not a template, so that "
                "its inputs and outputs can be read off its type; see the stage's index and type in this instantiation");
  if constexpr (plain_forward<Stage>) {
    static_assert(all_tensors<forward_args_t<Stage>>,
                  "paratrain: a Pipeline stage's forward must take torch::Tensor arguments only (activations travel "
                  "between ranks as tensors); see the stage's index and type in this instantiation");
    static_assert(tensor_outputs<forward_result_t<Stage>>,
                  "paratrain: a Pipeline stage's forward must return a torch::Tensor or a std::tuple of "
                  "torch::Tensor; see the stage's index and type in this instantiation");
  }
  return true;
}

/// Checks that stage I+1 (`To`) takes what stage I (`From`) returns. A failure names
/// both stages' types in the instantiation the compiler prints with it.
template <std::size_t I, class From, class To>
consteval bool stage_link() {
  if constexpr (plain_forward<From> && plain_forward<To> && tensor_outputs<forward_result_t<From>>) {
    static_assert(output_count<forward_result_t<From>> == std::tuple_size_v<forward_args_t<To>>,
                  "paratrain: Pipeline stage I+1 (To) cannot take the output of stage I (From): the number of "
                  "tensors stage I's forward returns differs from the number stage I+1's forward takes; make "
                  "stage I return a std::tuple of what stage I+1 takes, in order");
  }
  return true;
}

template <class... Stage, std::size_t... I>
consteval bool check_stages(std::index_sequence<I...>) {
  using Stages = std::tuple<Stage...>;
  (explain_stage<I, Stage>() && ...);
  using Last = std::tuple_element_t<sizeof...(Stage) - 1, Stages>;
  if constexpr (plain_forward<Last>)
    static_assert(model_output<forward_result_t<Last>>,
                  "paratrain: a Pipeline's last stage must return one torch::Tensor, the output the loss compares "
                  "with the targets, or a std::tuple of them for a loss of the whole output (paratrain::batch_loss)");
  if constexpr (sizeof...(Stage) > 1) {
    return [&]<std::size_t... J>(std::index_sequence<J...>) {
      return (stage_link<J, std::tuple_element_t<J, Stages>, std::tuple_element_t<J + 1, Stages>>() && ...);
    }(std::make_index_sequence<sizeof...(Stage) - 1>{});
  }
  return true;
}

/// The stages one pipeline rank owns, as one module whose submodules are named after
/// the stages: its parameter names are the whole model's (Note [Stage names]).
struct StageGroupImpl : torch::nn::Module {};
using StageGroup = std::shared_ptr<StageGroupImpl>;

}  // namespace detail

// Note [Stage names]
// A stage's parameters are named "<stage name>.<name in the stage>", so a pipeline's
// state is the whole model's state: with the default names "0", "1", ... that of a
// torch::nn::Sequential of the stages, and with names of your own that of a model whose
// submodules carry those names (a Transformer's "encoder" and "decoder"). Checkpoints
// are keyed by these names, so a pipeline's checkpoint loads into the whole model and back.

/// A model cut into `Stage...`, in order: stage i+1's forward takes the tensors stage i's
/// returns (a std::tuple for several), stage 0's takes the batch's inputs and the last
/// stage's output (a tensor, or a tuple of them) goes to the loss. Checked at compile time. Train it with
/// `DataParallel<Pipeline<Stage...>, Comm, Optimizer>` (pipeline/pipeline.hpp): each
/// pipeline rank builds and owns only its own stages.
///
/// \code
///   paratrain::Pipeline<Encoder, Decoder> stages([] { return Encoder(512); }, [] { return Decoder(512); });
///   stages.named({"encoder", "decoder"});
/// \endcode
template <class... Stage>
class Pipeline {
  static_assert(sizeof...(Stage) >= 1, "paratrain: a Pipeline needs at least one stage");
  static_assert(detail::check_stages<Stage...>(std::index_sequence_for<Stage...>{}));

 public:
  static constexpr std::size_t size = sizeof...(Stage);
  using stages = std::tuple<Stage...>;

  /// Each stage default-constructed, on the rank that owns it.
  Pipeline()
    requires(std::default_initializable<Stage> && ...)
      : Pipeline([] { return Stage(); }...) {}

  /// Each stage made by its function, called only on the rank that owns the stage.
  explicit Pipeline(std::function<Stage()>... makers) : makers_(std::move(makers)...) {
    for (std::size_t i = 0; i < size; ++i) names_.push_back(std::to_string(i));
  }

  /// Names the stages in the model's state (Note [Stage names]); default "0", "1", ...
  Pipeline& named(std::vector<std::string> names) {
    if (names.size() != size)
      throw error("Pipeline::named", -1,
                  "got " + std::to_string(names.size()) + " names for " + std::to_string(size) + " stages");
    for (std::size_t i = 0; i < names.size(); ++i) {
      const auto& n = names[i];
      if (n.empty() || n.find('.') != std::string::npos)
        throw error("Pipeline::named", -1, "stage name '" + n + "' must be non-empty and have no '.'");
      if (std::find(names.begin(), names.begin() + static_cast<std::ptrdiff_t>(i), n) != names.begin() + static_cast<std::ptrdiff_t>(i))
        throw error("Pipeline::named", -1, "stage name '" + n + "' is given twice: the stages' tensors would share names");
    }
    names_ = std::move(names);
    return *this;
  }

  [[nodiscard]] const std::vector<std::string>& names() const noexcept { return names_; }

  /// Builds stage I.
  template <std::size_t I>
  [[nodiscard]] std::tuple_element_t<I, stages> make() const {
    return std::get<I>(makers_)();
  }

 private:
  std::tuple<std::function<Stage()>...> makers_;
  std::vector<std::string> names_;
};

}  // namespace paratrain
