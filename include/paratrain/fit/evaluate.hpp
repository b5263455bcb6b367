#pragma once
/// \file
/// paratrain::evaluate — a model's loss and accuracy on a dataset, each sample counted once
/// over all ranks: what fit does after each epoch, callable on its own.

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "paratrain/collectives/agree.hpp"
#include "paratrain/concepts/dataset.hpp"
#include "paratrain/concepts/strategy.hpp"
#include "paratrain/core/batch.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/core/reduce_op.hpp"
#include "paratrain/data/batches.hpp"
#include "paratrain/data/dataset_ref.hpp"
#include "paratrain/data/exact_sampler.hpp"
#include "paratrain/data/loader.hpp"
#include "paratrain/fit/eval_metrics.hpp"
#include "paratrain/fit/options.hpp"

namespace paratrain {

/// A dataset's mean loss, accuracy and metrics, over all ranks.
struct Evaluation {
  double loss = 0;           ///< mean over the samples
  double accuracy = 0;       ///< the fraction whose argmax is the target, where targets are class indices
  std::int64_t samples = 0;  ///< every sample of the set, once
  std::map<std::string, double> metrics;  ///< EvaluateOptions::metrics, by name, each over the whole set
};

struct EvaluateOptions {
  std::int64_t batch_size = 1000;  ///< per replica
  data::LoaderOptions loader{};    ///< threads reading the next batches while one is evaluated
  /// Computed beside the loss over the same samples, exactly (Note [Metrics as sums]).
  std::vector<AnyMetric> metrics{};
};

namespace detail {

/// Why `metrics` cannot be evaluated together ("" when they can): two share a name.
inline std::string metric_names_problem(const std::vector<AnyMetric>& metrics) {
  std::set<std::string> seen;
  for (const auto& m : metrics)
    if (!seen.insert(m.name()).second)
      return "two metrics are named '" + m.name() + "'; give each metric a name of its own";
  return {};
}

template <strategy S, class Loss>
Evaluation evaluate(S& s, const data::DatasetRef& set, const EvaluateOptions& options, Loss& loss,
                    const char* operation) {
  using Output = typename S::output_type;
  static_assert(loss_for<Loss, Output>,
                "paratrain: the evaluation's loss does not take the model's output: give a loss(output, target) for a "
                "model that returns a tensor, or a loss(const Output&, const paratrain::Batch&) for one that returns "
                "a tuple");
  if (const auto problem = metric_names_problem(options.metrics); !problem.empty()) throw error(operation, s.rank(), problem);
  const auto batch_size = options.batch_size;
  const auto loading = data::for_device(options.loader, s.device());
  s.synchronize();  // every rank's replica evaluates alike (batch-norm statistics, ...)
  const auto shard = s.data_shard();
  const data::ExactSampler sampler(set.size(), {.num_replicas = shard.count, .rank = shard.index});
  const auto indices = sampler.indices();
  // Every rank makes as many predict() calls as the rank with the most batches: a
  // strategy may communicate inside predict (ZeRO-3 gathers parameters, a pipeline
  // passes activations), so a rank with fewer samples runs empty batches.
  std::vector<at::Tensor> chunks;
  for (auto&& chunk : data::batches(indices, batch_size)) chunks.push_back(data::to_tensor(chunk));
  auto rounds = at::full({1}, static_cast<double>(chunks.size()), at::kDouble);
  s.all_reduce(rounds, reduce_op::max);
  const auto empty = set.get(at::zeros({0}, at::kLong));
  const auto mine = chunks.size();
  data::Loader<data::DatasetRef> loader(set, std::move(chunks), loading);
  // [loss * n, correct, n, ranks that could not load a batch]: sums, so ranks with fewer
  // samples (or none) count exactly. A rank that cannot load a batch goes on with empty
  // ones, so that no rank waits for it in predict's collectives, and says so in the sums.
  auto sums = at::zeros({4}, at::kDouble);
  std::vector<at::Tensor> metric_sums(options.metrics.size());  // Note [Metrics as sums]
  std::string failed;
  for (std::size_t k = 0; k < static_cast<std::size_t>(rounds.template item<double>()); ++k) {
    Batch batch = empty;
    if (k < mine && failed.empty()) {
      try {
        batch = *loader.next();
      } catch (const std::exception& e) {
        failed = inner_message(e);
        sums[3] = 1;
      }
    }
    const auto out = s.predict(batch);
    if (!failed.empty() || !has_output(out) || batch.size() == 0) continue;
    // A loss or metric that throws on one rank must not leave the others waiting in the
    // all-reduce below: it is counted there as a failure, and every rank throws.
    try {
      const auto outputs = output_tensors(out);
      // A GPU replica answers on its device: the targets and extras go there (the inputs,
      // too, for a loss of the whole batch).
      const auto on_device = batch.to(outputs.front().device());
      const auto n = static_cast<double>(batch.size());
      sums[0] += compute_loss<Output>(loss, out, on_device).template item<double>() * n;
      if constexpr (std::same_as<Output, at::Tensor>)
        if (out.dim() == 2 && !at::isFloatingType(on_device.target.scalar_type()))
          sums[1] += out.argmax(1).eq(on_device.target).sum().template item<double>();
      sums[2] += n;
      for (std::size_t m = 0; m < options.metrics.size(); ++m) {
        const auto part = options.metrics[m].sums(outputs, on_device).to(at::kDouble).reshape({-1});
        metric_sums[m] = metric_sums[m].defined() ? metric_sums[m] + part : part;
      }
    } catch (const std::exception& e) {
      failed = inner_message(e);
      sums[3] = 1;
    }
  }
  // The metrics' sums go in the loss's all-reduce; a rank that evaluated nothing learns
  // their lengths first (it never called sums()).
  auto lengths = at::zeros({static_cast<std::int64_t>(metric_sums.size())}, at::kDouble);
  for (std::size_t m = 0; m < metric_sums.size(); ++m)
    if (metric_sums[m].defined()) lengths[static_cast<std::int64_t>(m)] = double(metric_sums[m].numel());
  if (!metric_sums.empty()) s.all_reduce(lengths, reduce_op::max);
  std::vector<at::Tensor> all{sums};
  for (std::size_t m = 0; m < metric_sums.size(); ++m) {
    const auto length = static_cast<std::int64_t>(lengths[static_cast<std::int64_t>(m)].template item<double>());
    const auto local = metric_sums[m].defined() ? metric_sums[m].cpu() : at::zeros({length}, at::kDouble);
    if (local.numel() == length) {
      all.push_back(local);
    } else {
      if (failed.empty())
        failed = "metric '" + options.metrics[m].name() + "' gave " + std::to_string(local.numel()) +
                 " sums here and " + std::to_string(length) + " on another rank; give every batch as many";
      all.push_back(at::zeros({length}, at::kDouble));
    }
  }
  auto totals = at::cat(all);
  if (!failed.empty()) totals[3] = 1;
  s.all_reduce(totals, reduce_op::sum);
  if (totals[3].template item<double>() > 0) raise_everywhere(s, operation, failed);
  const auto n = totals[2].template item<double>();
  Evaluation e{.loss = n > 0 ? totals[0].template item<double>() / n : 0,
               .accuracy = n > 0 ? totals[1].template item<double>() / n : 0,
               .samples = static_cast<std::int64_t>(n)};
  std::int64_t at = 4;
  for (std::size_t m = 0; m < metric_sums.size(); ++m) {
    const auto length = static_cast<std::int64_t>(lengths[static_cast<std::int64_t>(m)].template item<double>());
    e.metrics[options.metrics[m].name()] = options.metrics[m].compute(totals.narrow(0, at, length).contiguous());
    at += length;
  }
  return e;
}

}  // namespace detail

/// Evaluates `s`'s model on `set`, any paratrain::dataset: each data-parallel replica
/// predicts its exact shard (data::ExactSampler: every sample once, none twice) and the
/// loss (weighted by samples), the correct answers and the sums of `options.metrics` are
/// summed over all ranks (Note [Metrics as sums]).
/// Ranks without an output (a pipeline's earlier stages) take part and count nothing. A
/// rank that cannot load a batch makes every rank throw the same paratrain::error.
///
/// Collective: every rank calls it with the same set and options.
///
/// \code
///   const auto e = paratrain::evaluate(strategy, test, {.batch_size = 500});
///   std::printf("test loss %.4f, accuracy %.2f%%\n", e.loss, 100 * e.accuracy);
/// \endcode
template <strategy S, dataset D, class Loss = CrossEntropy>
Evaluation evaluate(S& s, const D& set, const EvaluateOptions& options = {}, Loss loss = {}) {
  if (options.batch_size < 1) throw error("evaluate", s.rank(), "batch_size must be >= 1");
  if constexpr (std::is_same_v<D, data::DatasetRef>)
    return detail::evaluate(s, set, options, loss, "evaluate");
  else
    return detail::evaluate(s, data::DatasetRef(&set), options, loss, "evaluate");
}

}  // namespace paratrain
