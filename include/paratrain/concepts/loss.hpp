#pragma once
/// \file
/// paratrain::loss_function and paratrain::loss_for — what a strategy's step is given to
/// compute the loss of a batch: from the output and the targets, or from the model's whole
/// output and the whole batch.

#include <ATen/core/Tensor.h>

#include <concepts>
#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "paratrain/core/batch.hpp"

namespace paratrain {

namespace detail {
template <class Tuple>
inline constexpr bool all_tensors = false;
template <class... T>
inline constexpr bool all_tensors<std::tuple<T...>> = (std::same_as<T, at::Tensor> && ...);
}  // namespace detail

/// What a model (or a pipeline's last stage) may return: one tensor, or a std::tuple of
/// tensors (an output and an auxiliary loss, two heads).
template <class T>
concept model_output = std::same_as<T, at::Tensor> || detail::all_tensors<T>;

/// A loss of the output and the targets: the mean loss of a batch, `loss(output, target)`.
template <class L>
concept loss_function = std::invocable<L&, const at::Tensor&, const at::Tensor&> &&
    std::convertible_to<std::invoke_result_t<L&, const at::Tensor&, const at::Tensor&>, at::Tensor>;

/// A loss of whatever the model returns (`Output`: a tensor, or a std::tuple of tensors; a
/// pipeline's last stage's output) and the whole batch (inputs, targets, Batch::extra):
/// `loss(output, batch)`, for auxiliary losses, several outputs, per-token weights or masks.
/// Like a loss_function it returns the mean over the batch's samples (Note [Losses of a batch]).
template <class L, class Output>
concept batch_loss = std::invocable<L&, const Output&, const Batch&> &&
    std::convertible_to<std::invoke_result_t<L&, const Output&, const Batch&>, at::Tensor>;

/// A loss a strategy whose model returns `Output` can train with: a batch_loss of it, or,
/// where the output is one tensor, a loss_function. Where both fit (a generic lambda), the
/// loss_function reading wins: name the batch's type, `const paratrain::Batch&`, to be read
/// as a batch_loss.
template <class L, class Output = at::Tensor>
concept loss_for = (std::same_as<Output, at::Tensor> && loss_function<L>) || batch_loss<L, Output>;

// Note [Losses of a batch]
// Every strategy back-propagates loss * n, n the batch's samples, and divides the summed
// gradients by the samples of all ranks (Note [Exact averaging]). So a loss, of either form,
// must be the mean over the batch's samples (dimension 0) of a per-sample quantity: then
// every step is the step one device takes on the union of all ranks' batches, whatever
// their sizes. A weighted per-token loss is one when it is normalised per sample, e.g.
// (w * l).sum() / batch.size() or a mean over samples of each sample's weighted mean; a ratio
// of batch sums, (w * l).sum() / w.sum(), is not (a mean of ratios over ranks is not the
// ratio of the sums), and trains as DDP in PyTorch would, not as one device.

namespace detail {

/// The tensors of a model's output, in order: one for a tensor.
inline std::vector<at::Tensor> output_tensors(const at::Tensor& out) { return {out}; }
template <class... T>
std::vector<at::Tensor> output_tensors(const std::tuple<T...>& out) {
  return std::apply([](const auto&... x) { return std::vector<at::Tensor>{x...}; }, out);
}

/// A model's output made of its tensors in order (`tensors` holds as many as it has).
template <model_output Output>
Output output_of(std::vector<at::Tensor> tensors) {
  if constexpr (std::same_as<Output, at::Tensor>) {
    return std::move(tensors.at(0));
  } else {
    return [&]<std::size_t... I>(std::index_sequence<I...>) {
      return Output{std::move(tensors.at(I))...};
    }(std::make_index_sequence<std::tuple_size_v<Output>>{});
  }
}

/// Whether a rank has the output: its first tensor is defined (a pipeline's earlier stages
/// answer predict with undefined ones).
template <model_output Output>
bool has_output(const Output& out) {
  if constexpr (std::same_as<Output, at::Tensor>) return out.defined();
  else return std::get<0>(out).defined();
}

/// Whether `loss` reads the whole batch (a batch_loss), or only the targets.
template <class L, class Output>
inline constexpr bool reads_batch = !(std::same_as<Output, at::Tensor> && loss_function<L>);

/// The loss of `batch` from `out`, in whichever form `loss` takes.
template <class Output, class L>
  requires loss_for<L, Output>
at::Tensor compute_loss(L& loss, const Output& out, const Batch& batch) {
  if constexpr (!reads_batch<L, Output>)
    return loss(out, batch.target);
  else
    return loss(out, batch);
}

}  // namespace detail
}  // namespace paratrain
