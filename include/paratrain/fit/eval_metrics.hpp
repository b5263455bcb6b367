#pragma once
/// \file
/// paratrain::metric — what evaluation computes beside the loss, exactly over all ranks:
/// the concept, paratrain::AnyMetric (a set of them in FitOptions::metrics and
/// EvaluateOptions::metrics) and the provided ones in paratrain::metrics: Accuracy, TopK,
/// MeanAbsoluteError, Perplexity.

#include <ATen/ATen.h>

#include <cmath>
#include <concepts>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>

#include "paratrain/core/batch.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain {

// Note [Metrics as sums]
// A metric is a ratio, or a function, of sums over samples: correct answers and samples,
// absolute errors and elements, token log-likelihoods and tokens. Evaluation adds each
// batch's sums on the rank that evaluated it (on the output's device: no host round trip
// per batch), adds them over the ranks in the one all-reduce that carries the loss's, and
// computes the metric once, from the totals. Since every sample is evaluated exactly once
// (data::ExactSampler), the totals are those of one device over the whole set, and so is
// the metric; a mean of per-rank metrics would not be (ranks evaluate different numbers of
// samples). A metric therefore has no state: `sums(outputs, batch)` of one batch, and
// `compute(totals)`.

/// An evaluation metric: `name()`; `sums(outputs, batch)`, a 1-D tensor of sums over the
/// batch's samples (any floating or integer type, on any device; the same length for every
/// batch), where `outputs` are the model's output tensors in order (one for a model returning
/// a tensor) and the batch is on their device; and `compute(totals)`, the metric from those
/// sums added over every batch of every rank (a 1-D double tensor on the CPU).
template <class M>
concept metric = std::copy_constructible<M> &&
    requires(const M& m, std::span<const at::Tensor> outputs, const Batch& batch, const at::Tensor& totals) {
      { m.name() } -> std::convertible_to<std::string>;
      { m.sums(outputs, batch) } -> std::convertible_to<at::Tensor>;
      { m.compute(totals) } -> std::convertible_to<double>;
    };

/// Any paratrain::metric, held by value: `FitOptions::metrics = {metrics::Accuracy{}, metrics::TopK{5}}`.
class AnyMetric {
 public:
  template <metric M>
    requires(!std::same_as<std::remove_cvref_t<M>, AnyMetric>)
  AnyMetric(M m)  // NOLINT(google-explicit-constructor): a list of metrics reads as one
      : held_(std::make_shared<Held<M>>(std::move(m))) {}

  [[nodiscard]] std::string name() const { return held_->name(); }
  [[nodiscard]] at::Tensor sums(std::span<const at::Tensor> outputs, const Batch& batch) const {
    return held_->sums(outputs, batch);
  }
  [[nodiscard]] double compute(const at::Tensor& totals) const { return held_->compute(totals); }

 private:
  struct Base {
    virtual ~Base() = default;
    virtual std::string name() const = 0;
    virtual at::Tensor sums(std::span<const at::Tensor> outputs, const Batch& batch) const = 0;
    virtual double compute(const at::Tensor& totals) const = 0;
  };
  template <class M>
  struct Held final : Base {
    explicit Held(M m) : m_(std::move(m)) {}
    std::string name() const override { return m_.name(); }
    at::Tensor sums(std::span<const at::Tensor> outputs, const Batch& batch) const override {
      return m_.sums(outputs, batch);
    }
    double compute(const at::Tensor& totals) const override { return m_.compute(totals); }
    M m_;
  };
  std::shared_ptr<const Base> held_;
};

namespace metrics {

namespace detail {
/// Output `k` of `outputs`, or an error naming the metric.
inline const at::Tensor& output(std::span<const at::Tensor> outputs, int k, const std::string& metric) {
  if (k < 0 || static_cast<std::size_t>(k) >= outputs.size())
    throw error("metric " + metric, -1,
                "reads output " + std::to_string(k) + ", but the model returns " + std::to_string(outputs.size()) +
                    " tensor(s)");
  return outputs[static_cast<std::size_t>(k)];
}
/// Scores of shape (..., C) against class indices of shape (...): checked, with a message.
inline void check_scores(const at::Tensor& scores, const at::Tensor& target, const std::string& metric) {
  if (!target.defined() || at::isFloatingType(target.scalar_type()) || scores.dim() != target.dim() + 1 ||
      scores.sizes().slice(0, static_cast<std::size_t>(target.dim())).vec() != target.sizes().vec())
    throw error("metric " + metric, -1,
                "needs scores of shape (..., classes) and class indices of the same shape without the last "
                "dimension; got scores " + std::to_string(scores.dim()) + "-D and " +
                    (target.defined() ? std::to_string(target.dim()) + "-D targets" : std::string("no targets")) +
                    (target.defined() && at::isFloatingType(target.scalar_type()) ? " of a floating type" : ""));
}
inline double ratio(const at::Tensor& totals) {
  const auto* t = totals.data_ptr<double>();
  return t[1] > 0 ? t[0] / t[1] : 0.0;
}
}  // namespace detail

/// The fraction of predictions whose `k` highest scores include the target class (targets
/// equal to `ignore_index` left out).
struct TopK {
  std::int64_t k = 5;
  int output = 0;
  std::int64_t ignore_index = -100;
  [[nodiscard]] std::string name() const { return "top" + std::to_string(k) + "_accuracy"; }
  [[nodiscard]] at::Tensor sums(std::span<const at::Tensor> outputs, const Batch& b) const {
    return counts(outputs, b, name());
  }
  [[nodiscard]] double compute(const at::Tensor& totals) const { return detail::ratio(totals); }

  /// [answers among the top k, targets counted], for a metric named `metric`.
  [[nodiscard]] at::Tensor counts(std::span<const at::Tensor> outputs, const Batch& b, const std::string& metric) const {
    const auto& scores = detail::output(outputs, output, metric);
    detail::check_scores(scores, b.target, metric);
    if (k < 1 || k > scores.size(-1))
      throw error("metric " + metric, -1,
                  "k must lie in [1, classes = " + std::to_string(scores.size(-1)) + "]; it is " + std::to_string(k));
    const auto kept = b.target.ne(ignore_index);
    const auto top = std::get<1>(scores.topk(k, -1));
    const auto hit = top.eq(b.target.unsqueeze(-1)).any(-1).logical_and(kept);
    return at::stack({hit.sum().to(at::kDouble), kept.sum().to(at::kDouble)});
  }
};

/// The fraction of predictions whose highest score is the target class: scores (N, C) or
/// (N, ..., C) against class indices (N) or (N, ...), each element counted but those whose
/// target is `ignore_index` (padding; -100, as cross_entropy's default).
struct Accuracy {
  int output = 0;  ///< which of the model's outputs holds the scores
  std::int64_t ignore_index = -100;
  [[nodiscard]] std::string name() const { return "accuracy"; }
  [[nodiscard]] at::Tensor sums(std::span<const at::Tensor> outputs, const Batch& b) const {
    return TopK{.k = 1, .output = output, .ignore_index = ignore_index}.counts(outputs, b, name());
  }
  [[nodiscard]] double compute(const at::Tensor& totals) const { return detail::ratio(totals); }
};

/// The mean of |output - target| over every element; the target is the batch's, or the
/// Batch::extra tensor named `extra` (a regression head beside a classifier's).
struct MeanAbsoluteError {
  int output = 0;
  std::string extra{};
  [[nodiscard]] std::string name() const { return "mae"; }
  [[nodiscard]] at::Tensor sums(std::span<const at::Tensor> outputs, const Batch& b) const {
    const at::Tensor out = detail::output(outputs, output, name());  // a handle: no reference into a temporary
    const auto it = b.extra.find(extra);
    if (!extra.empty() && it == b.extra.end())
      throw error("metric " + name(), -1, "reads the batch's extra tensor '" + extra + "', which the batch has not");
    const auto& target = extra.empty() ? b.target : it->second;
    if (!target.defined() || out.sizes() != target.sizes())
      throw error("metric " + name(), -1, "needs targets of the output's shape");
    return at::stack({(out.to(at::kDouble) - target.to(at::kDouble)).abs().sum(),
                      at::scalar_tensor(double(out.numel()), out.options().dtype(at::kDouble))});
  }
  [[nodiscard]] double compute(const at::Tensor& totals) const { return detail::ratio(totals); }
};

/// exp of the mean negative log-likelihood per token: scores (N, ..., V) against token
/// indices (N, ...); tokens equal to `ignore_index` (padding) are left out.
struct Perplexity {
  std::int64_t ignore_index = -100;
  int output = 0;
  [[nodiscard]] std::string name() const { return "perplexity"; }
  [[nodiscard]] at::Tensor sums(std::span<const at::Tensor> outputs, const Batch& b) const {
    const at::Tensor scores = detail::output(outputs, output, name());
    detail::check_scores(scores, b.target, name());
    const auto logits = scores.reshape({-1, scores.size(-1)}).to(at::kDouble);
    const auto target = b.target.reshape({-1});
    const auto kept = target.ne(ignore_index);
    const auto nll = -at::log_softmax(logits, -1).gather(1, target.clamp_min(0).unsqueeze(1)).squeeze(1);
    return at::stack({nll.masked_fill(kept.logical_not(), 0).sum(), kept.sum().to(at::kDouble)});
  }
  [[nodiscard]] double compute(const at::Tensor& totals) const { return std::exp(detail::ratio(totals)); }
};

}  // namespace metrics
}  // namespace paratrain
