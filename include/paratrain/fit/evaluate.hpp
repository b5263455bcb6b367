#pragma once
/// \file
/// paratrain::evaluate — a model's loss and accuracy on a dataset, each sample counted once
/// over all ranks: what fit does after each epoch, callable on its own.

#include <ATen/ATen.h>

#include <cstdint>
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
#include "paratrain/fit/options.hpp"

namespace paratrain {

/// A dataset's mean loss and accuracy, over all ranks.
struct Evaluation {
  double loss = 0;           ///< mean over the samples
  double accuracy = 0;       ///< the fraction whose argmax is the target, where targets are class indices
  std::int64_t samples = 0;  ///< every sample of the set, once
};

struct EvaluateOptions {
  std::int64_t batch_size = 1000;  ///< per replica
  data::LoaderOptions loader{};    ///< threads reading the next batches while one is evaluated
};

namespace detail {

template <strategy S, loss_function Loss>
Evaluation evaluate(S& s, const data::DatasetRef& set, const EvaluateOptions& options, Loss& loss,
                    const char* operation) {
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
    if (!out.defined() || batch.size() == 0) continue;
    const auto target = batch.target.to(out.device());  // a GPU replica answers on its device
    const auto n = static_cast<double>(batch.size());
    sums[0] += loss(out, target).template item<double>() * n;
    if (out.dim() == 2 && !at::isFloatingType(target.scalar_type()))
      sums[1] += out.argmax(1).eq(target).sum().template item<double>();
    sums[2] += n;
  }
  s.all_reduce(sums, reduce_op::sum);
  if (sums[3].template item<double>() > 0) raise_everywhere(s, operation, failed);
  const auto n = sums[2].template item<double>();
  return {.loss = n > 0 ? sums[0].template item<double>() / n : 0,
          .accuracy = n > 0 ? sums[1].template item<double>() / n : 0,
          .samples = static_cast<std::int64_t>(n)};
}

}  // namespace detail

/// Evaluates `s`'s model on `set`, any paratrain::dataset: each data-parallel replica
/// predicts its exact shard (data::ExactSampler: every sample once, none twice) and the
/// loss (weighted by samples) and the correct answers are summed over all ranks.
/// Ranks without an output (a pipeline's earlier stages) take part and count nothing. A
/// rank that cannot load a batch makes every rank throw the same paratrain::error.
///
/// Collective: every rank calls it with the same set and options.
///
/// \code
///   const auto e = paratrain::evaluate(strategy, test, {.batch_size = 500});
///   std::printf("test loss %.4f, accuracy %.2f%%\n", e.loss, 100 * e.accuracy);
/// \endcode
template <strategy S, dataset D, loss_function Loss = CrossEntropy>
Evaluation evaluate(S& s, const D& set, const EvaluateOptions& options = {}, Loss loss = {}) {
  if (options.batch_size < 1) throw error("evaluate", s.rank(), "batch_size must be >= 1");
  if constexpr (std::is_same_v<D, data::DatasetRef>)
    return detail::evaluate(s, set, options, loss, "evaluate");
  else
    return detail::evaluate(s, data::DatasetRef(&set), options, loss, "evaluate");
}

}  // namespace paratrain
