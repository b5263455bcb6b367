#pragma once
/// \file
/// paratrain::Batch — the samples of one step: the model's inputs, the targets and any
/// extra per-sample tensors a loss or metric reads (weights, masks).

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "paratrain/core/error.hpp"
#include "paratrain/core/move_to.hpp"

namespace paratrain {

/// A batch of samples: the model's inputs (the arguments of its forward, in order:
/// one for most models, two for a Transformer's `forward(src, tgt)`), the targets, and
/// named extra tensors the model does not read but a loss or a metric may (per-token
/// weights, masks: `batch.extra.at("weight")`), all indexed by dimension 0.
struct Batch {
  std::vector<at::Tensor> inputs;
  at::Tensor target;
  std::map<std::string, at::Tensor> extra;

  Batch() = default;
  /// A model with one input: `Batch{x, y}`.
  Batch(at::Tensor input, at::Tensor target_) : inputs{std::move(input)}, target(std::move(target_)) {}
  /// A model with several inputs: `Batch{{src, tgt}, y}`.
  Batch(std::vector<at::Tensor> inputs_, at::Tensor target_) : inputs(std::move(inputs_)), target(std::move(target_)) {}

  /// The first input: the only one of a one-input model.
  [[nodiscard]] const at::Tensor& input() const { return inputs.at(0); }
  [[nodiscard]] std::int64_t size() const {
    return !inputs.empty() && inputs.front().defined() ? inputs.front().size(0) : 0;
  }
  /// The samples [begin, begin + n) of every input, the targets and the extras.
  [[nodiscard]] Batch narrow(std::int64_t begin, std::int64_t n) const {
    return map([&](const at::Tensor& t) { return t.narrow(0, begin, n); });
  }
  /// The batch with `f` applied to each of its defined tensors (inputs, targets, extras);
  /// undefined ones stay undefined.
  template <class F>
  [[nodiscard]] Batch map(F&& f) const {
    const auto apply = [&](const at::Tensor& t) { return t.defined() ? at::Tensor(f(t)) : t; };
    Batch out;
    out.inputs.reserve(inputs.size());
    for (const auto& x : inputs) out.inputs.push_back(apply(x));
    out.target = apply(target);
    for (const auto& [name, x] : extra) out.extra.emplace(name, apply(x));
    return out;
  }
  /// Calls `f` on each of its defined tensors, mutably (inputs, targets, extras).
  template <class F>
  void for_each_tensor(F&& f) {
    for (auto& x : inputs)
      if (x.defined()) f(x);
    if (target.defined()) f(target);
    for (auto& [name, x] : extra)
      if (x.defined()) f(x);
  }
  /// The batch on `device`: each tensor moved there (or itself, where it is there already),
  /// asynchronously from page-locked memory (data::LoaderOptions::pin_memory, which fit
  /// turns on for a CUDA model). Strategies call it once per batch: Note [One move per batch].
  [[nodiscard]] Batch to(at::Device device) const {
    return map([&](const at::Tensor& t) { return detail::move_to(t, device); });
  }
};

// Note [One move per batch]
// A batch arrives on the host (a dataset, the Loader) and the model may be on a GPU. The
// strategy that runs the model moves the batch, not the user: DataParallel in
// forward_backward and predict, a pipeline at its first stage (inputs) and its last
// (targets), LocalDataParallel per replica's slice. Each tensor moves once per batch,
// before the forward that reads it; a strategy never moves it back. From pinned memory the
// copy is asynchronous (non_blocking): the host goes on to enqueue the forward, which the
// device orders after the copy on the same stream. fit and evaluate have their loader copy
// the batches to a GPU ahead instead, beside the step (Note [Copies beside the step]): the
// strategy's move then finds each tensor on its device and copies nothing, so each tensor
// still moves once.

namespace detail {

/// Why `b` cannot be trained on, or "" when it can (an empty batch can: the rank joins).
/// Every input, and the targets where there are some, indexes samples by dimension 0,
/// and all hold the same number of them.
inline std::string batch_problem(const Batch& b) {
  if (!b.inputs.empty() && !b.inputs.front().defined()) {
    bool data = b.target.defined();
    for (const auto& x : b.inputs) data = data || x.defined();
    return data ? "the batch's input 0 is undefined, while it holds other tensors" : "";
  }
  if (!b.inputs.empty() && b.inputs.front().dim() == 0)
    return "the batch's input 0 is a scalar; samples are indexed by dimension 0";
  const auto n = b.size();
  if (n == 0) return {};
  const auto samples = [](const at::Tensor& t) { return std::to_string(t.size(0)) + " samples"; };
  for (std::size_t i = 0; i < b.inputs.size(); ++i) {
    const auto& x = b.inputs[i];
    const auto which = "input " + std::to_string(i);
    if (!x.defined()) return "the batch's " + which + " is undefined";
    if (x.dim() == 0) return "the batch's " + which + " is a scalar; samples are indexed by dimension 0";
    if (x.size(0) != n)
      return "the batch's input 0 holds " + samples(b.inputs[0]) + " and its " + which + " " + samples(x) +
             " (dimension 0)";
  }
  if (b.target.defined() && (b.target.dim() == 0 || b.target.size(0) != n))
    return "the batch's inputs hold " + std::to_string(n) + " samples and its targets " +
           (b.target.dim() == 0 ? std::string("are a scalar") : samples(b.target)) + " (dimension 0)";
  for (const auto& [name, x] : b.extra)
    if (x.defined() && (x.dim() == 0 || x.size(0) != n))
      return "the batch's inputs hold " + std::to_string(n) + " samples and its extra tensor '" + name + "' " +
             (x.dim() == 0 ? std::string("is a scalar") : samples(x)) + " (dimension 0)";
  return {};
}

/// Mixes into `h` what the ranks given the same micro-batch `b` must agree on: its sample
/// count and, where they cut its sequences over a context group (`shapes`), the whole shape
/// of every input and of the targets. Context ranks given sequences of different lengths
/// would exchange shards of different sizes in attention: a truncated message on one rank
/// and a hang on another, where the step's agreement makes it an error on every rank.
/// `Hash` mixes 64-bit values (`h.mix(v)`: detail::Fnv1a).
template <class Hash>
void mix_micro_batch(Hash& h, const Batch& b, bool shapes) {
  h.mix(static_cast<std::uint64_t>(b.size()));
  if (!shapes) return;
  const auto mix_shape = [&](const at::Tensor& t) {
    h.mix(static_cast<std::uint64_t>(t.defined() ? t.dim() : -1));
    if (t.defined())
      for (const auto d : t.sizes()) h.mix(static_cast<std::uint64_t>(d));
  };
  for (const auto& x : b.inputs) mix_shape(x);
  mix_shape(b.target);
}

/// A batch that every strategy refuses (batch_problem names it), for a rank that could not
/// load its batch: given to the step in its place, it takes part in the step's agreement on
/// unusable batches, so every rank throws instead of some waiting for the others in a
/// collective (Note [Unusable batches]).
inline Batch unusable_batch() {
  Batch b;
  b.inputs.emplace_back();
  b.target = at::zeros({1});
  return b;
}

}  // namespace detail
}  // namespace paratrain
