#pragma once
/// \file
/// paratrain::fit — the one training loop, the same for every strategy.

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "paratrain/concepts/strategy.hpp"
#include "paratrain/data/batch.hpp"
#include "paratrain/data/batches.hpp"
#include "paratrain/data/distributed_sampler.hpp"
#include "paratrain/data/exact_sampler.hpp"
#include "paratrain/detail/progress.hpp"
#include "paratrain/error.hpp"
#include "paratrain/fit_checkpoints.hpp"
#include "paratrain/metrics.hpp"
#include "paratrain/observe/observer.hpp"

namespace paratrain {

/// The linear scaling rule with gradual warm-up (Goyal et al. 2017, "Accurate, Large
/// Minibatch SGD"): the optimizer's learning rate was tuned for a global batch of
/// `reference_batch`; with a global batch of B it becomes lr * B / reference_batch,
/// reached linearly from lr over the first `warmup_epochs`.
struct LrScaling {
  std::int64_t reference_batch = 0;  ///< 0: off
  double warmup_epochs = 0;
};

/// After each optimizer step.
struct StepInfo {
  int epoch = 0;                 ///< from 0
  std::int64_t step = 0;         ///< optimizer steps since fit began
  double loss = 0;               ///< this rank's mean loss in this step
  double lr = 0;                 ///< of the first parameter group
  double global_samples = 0;     ///< the step's effective batch
  double seconds = 0;            ///< this step's wall time on this rank
  Metrics* metrics = nullptr;    ///< log your own values here; fit reduces them safely
};

/// After each epoch; the losses, accuracy and metrics are reduced over all ranks.
struct EpochInfo {
  int epoch = 0;
  double train_loss = 0;         ///< mean over the epoch's samples
  double eval_loss = 0;          ///< when an evaluation set was given
  double eval_accuracy = 0;      ///< when targets are class indices
  std::int64_t eval_samples = 0; ///< evaluated once each, never duplicated
  double seconds = 0;            ///< training time of the epoch on this rank (evaluation excluded)
  double samples_per_second = 0; ///< over all ranks
  std::map<std::string, double> metrics;  ///< everything logged, reduced (Note [Safe metric reduction])
};

struct FitResult {
  std::vector<EpochInfo> epochs;
  double train_seconds = 0;       ///< all epochs' training time
  double samples_per_second = 0;  ///< over all ranks and epochs
  /// Every rank's step-time statistics and the stragglers, with ObserveOptions::straggler_report.
  std::optional<observe::StepTimeReport> step_times;
  /// The checkpoint this run resumed from (FitOptions::checkpoint); `epochs` then holds
  /// only the epochs it finished, the first of them possibly begun before.
  std::optional<std::filesystem::path> resumed_from;
};

struct FitOptions {
  int epochs = 1;
  std::int64_t batch_size = 32;  ///< per rank (per process), per micro-batch
  int accumulation = 1;          ///< micro-batches per optimizer step
  bool shuffle = true;           ///< DistributedSampler's shuffle, seed and drop_last
  std::uint64_t seed = 0;
  bool drop_last = false;
  const data::TensorDataset* eval = nullptr;  ///< evaluated after each epoch, exactly sharded
  std::int64_t eval_batch_size = 1000;
  LrScaling lr_scaling{};
  /// A multiplier of the learning rate at a fractional epoch (2.5: half-way through the
  /// third), on top of lr_scaling; e.g. a cosine decay. Empty: constant.
  std::function<double(double epoch)> lr_schedule{};
  std::int64_t log_every = 100;  ///< steps between progress lines and metric reductions
  bool progress = true;          ///< rank 0 reports progress on stdout
  std::function<void(const StepInfo&)> on_step{};
  std::function<void(const EpochInfo&)> on_epoch{};
  /// TensorBoard, trace, metrics files, straggler report: all off by default (observe/observer.hpp).
  observe::ObserveOptions observe{};
  /// Save checkpoints while training and resume from them: off by default (fit_checkpoints.hpp).
  CheckpointOptions checkpoint{};
};

/// Cross-entropy over class indices: fit's default loss.
struct CrossEntropy {
  at::Tensor operator()(const at::Tensor& output, const at::Tensor& target) const {
    return torch::nn::functional::cross_entropy(output, target);
  }
};

namespace detail {

inline std::vector<double> base_learning_rates(torch::optim::Optimizer& o) {
  std::vector<double> lrs;
  for (auto& g : o.param_groups()) lrs.push_back(g.options().get_lr());
  return lrs;
}

inline void set_learning_rates(torch::optim::Optimizer& o, const std::vector<double>& base, double factor) {
  auto& groups = o.param_groups();
  for (std::size_t i = 0; i < groups.size(); ++i) groups[i].options().set_lr(base[i] * factor);
}

/// Evaluates on this rank's exact shard and reduces: loss, accuracy, sample count.
template <strategy S, loss_function Loss>
void evaluate(S& s, const data::TensorDataset& set, std::int64_t batch_size, Loss& loss, EpochInfo& info) {
  s.synchronize();  // every rank's replica evaluates alike (batch-norm statistics, ...)
  const data::ExactSampler shard(set.size(), {.num_replicas = s.world_size(), .rank = s.rank()});
  const auto indices = shard.indices();
  // Every rank makes as many predict() calls as the rank with the most batches: a
  // strategy may communicate inside predict (ZeRO-3 gathers parameters, a pipeline
  // passes activations), so a rank with fewer samples runs empty batches.
  std::vector<at::Tensor> chunks;
  for (auto&& chunk : data::batches(indices, batch_size)) chunks.push_back(data::to_tensor(chunk));
  auto rounds = at::full({1}, static_cast<double>(chunks.size()), at::kDouble);
  s.all_reduce(rounds, reduce_op::max);
  const auto empty = set.size() > 0 ? set.get(at::zeros({1}, at::kLong)).input.narrow(0, 0, 0) : at::Tensor();
  // [loss * n, correct, n]: sums, so ranks with fewer samples (or none) count exactly.
  auto sums = at::zeros({3}, at::kDouble);
  for (std::size_t k = 0; k < static_cast<std::size_t>(rounds.template item<double>()); ++k) {
    if (k >= chunks.size()) {
      s.predict(empty);
      continue;
    }
    const auto batch = set.get(chunks[k]);
    const auto out = s.predict(batch.input);
    const auto target = batch.target.to(out.device());  // a GPU replica answers on its device
    const auto n = static_cast<double>(batch.size());
    sums[0] += loss(out, target).template item<double>() * n;
    if (out.dim() == 2 && !at::isFloatingType(target.scalar_type()))
      sums[1] += out.argmax(1).eq(target).sum().template item<double>();
    sums[2] += n;
  }
  s.all_reduce(sums, reduce_op::sum);
  const auto n = sums[2].template item<double>();
  info.eval_samples = static_cast<std::int64_t>(n);
  info.eval_loss = n > 0 ? sums[0].template item<double>() / n : 0;
  info.eval_accuracy = n > 0 ? sums[1].template item<double>() / n : 0;
}

inline std::string format(const char* fmt, auto... args) {
  char buf[256];
  std::snprintf(buf, sizeof buf, fmt, args...);
  return buf;
}

}  // namespace detail

/// Trains `s` on `train` for `options.epochs` epochs: the same loop for every strategy.
///
/// Each rank visits its DistributedSampler shard (PyTorch's sharding, so results match
/// a PyTorch run with the same seed), `options.accumulation` micro-batches of
/// `options.batch_size` per optimizer step; ranks that run out of batches join the
/// others. After each epoch the evaluation set, if any, is sharded exactly (every
/// sample once) and loss and accuracy are reduced over all ranks.
///
/// Collective: every rank calls fit with the same options.
///
/// \code
///   auto result = paratrain::fit(strategy, train, {.epochs = 5, .batch_size = 64, .eval = &test});
/// \endcode
template <strategy S, loss_function Loss = CrossEntropy>
FitResult fit(S& s, const data::TensorDataset& train, const FitOptions& options, Loss loss = {}) {
  if (options.epochs < 0 || options.batch_size < 1 || options.accumulation < 1 || options.log_every < 1 ||
      options.eval_batch_size < 1)
    throw error("fit", s.rank(),
                "epochs must be >= 0 and batch_size, accumulation, log_every and eval_batch_size >= 1");
  using clock = std::chrono::steady_clock;
  detail::Progress progress(options.progress && s.rank() == 0, stdout);
  data::DistributedSampler sampler(train.size(), {.num_replicas = s.world_size(),
                                                  .rank = s.rank(),
                                                  .shuffle = options.shuffle,
                                                  .seed = options.seed,
                                                  .drop_last = options.drop_last});
  auto base_lrs = detail::base_learning_rates(s.optimizer());
  const double global_batch = double(options.batch_size) * options.accumulation * s.world_size();
  const auto& scaling = options.lr_scaling;
  const double target_factor = scaling.reference_batch > 0 ? global_batch / double(scaling.reference_batch) : 1.0;

  observe::Observer<S> observer(s, options.observe);
  // A batch of `train`; its gathering is the trace's "data" phase.
  const auto get = [&](const at::Tensor& batch_indices) {
    observe::PhaseTimer timer(observer.timeline(), observe::Phase::data);
    return train.get(batch_indices);
  };
  FitResult result;
  Metrics metrics;  // the epoch's: reduced at its end into EpochInfo::metrics
  Metrics window;   // fit's loss since the last progress line
  std::int64_t step = 0;
  double total_samples = 0;
  detail::FitCheckpoints<S> checkpoints(s, options.checkpoint);
  detail::FitPosition start{.dataset_size = train.size(),
                            .seed = static_cast<std::int64_t>(options.seed),
                            .shuffle = options.shuffle,
                            .drop_last = options.drop_last};
  if (const auto resumed = checkpoints.resume(metrics)) {
    if (resumed->dataset_size != start.dataset_size || resumed->seed != start.seed ||
        resumed->shuffle != start.shuffle || resumed->drop_last != start.drop_last)
      throw error("fit", s.rank(),
                  "the checkpoint " + checkpoints.resumed_from()->string() +
                      " was saved with another data set size, seed, shuffle or drop_last, so its place in the sample "
                      "order means nothing here; resume with the options it was saved with");
    start = *resumed;
    base_lrs = start.base_lrs;  // the loaded optimizer holds the scheduled rates of its step
    step = start.step;
    result.resumed_from = checkpoints.resumed_from();
  }
  // The loop's position for a checkpoint: `steps_done` optimizer steps in all, `epoch_step`
  // of them in `epoch`, which visited `position` places of the epoch's sample order.
  const auto position = [&](std::int64_t steps_done, int epoch, std::int64_t epoch_step, std::int64_t visited) {
    detail::FitPosition p = start;
    p.step = steps_done, p.epoch = epoch, p.epoch_step = epoch_step, p.position = visited, p.base_lrs = base_lrs;
    return p;
  };
  for (int epoch = static_cast<int>(start.epoch); epoch < options.epochs; ++epoch) {
    const bool resumed_epoch = epoch == start.epoch;
    sampler.set_epoch(epoch, resumed_epoch ? start.position : 0);
    const auto indices = sampler.indices();
    std::vector<at::Tensor> micro;
    for (auto&& chunk : data::batches(indices, options.batch_size)) micro.push_back(data::to_tensor(chunk));
    // Steps of this epoch: those done before the resume, then those left.
    const std::int64_t done = resumed_epoch ? start.epoch_step : 0;
    const auto steps = done + static_cast<std::int64_t>((micro.size() + options.accumulation - 1) / options.accumulation);
    bool save_at_end = options.checkpoint.every_epoch;
    EpochInfo info{.epoch = epoch};
    double epoch_samples = 0;
    const auto epoch_start = clock::now();
    for (std::int64_t k = done;; ++k, ++step) {
      if (scaling.reference_batch > 0 || options.lr_schedule) {
        const double warm = scaling.warmup_epochs * double(std::max<std::int64_t>(steps, 1));
        const double warmed = warm > 0 ? std::min(1.0, double(step) / warm) : 1.0;
        const double epoch_position = epoch + double(k) / double(std::max<std::int64_t>(steps, 1));
        detail::set_learning_rates(s.optimizer(), base_lrs,
                                   (1.0 + (target_factor - 1.0) * warmed) *
                                       (options.lr_schedule ? options.lr_schedule(epoch_position) : 1.0));
      }
      const auto step_start = clock::now();
      StepResult r;
      if (k < steps) {
        const auto first = static_cast<std::size_t>((k - done) * options.accumulation);
        const auto last = std::min(micro.size(), first + static_cast<std::size_t>(options.accumulation)) - 1;
        double loss_sum = 0, samples = 0;
        for (auto m = first; m < last; ++m) {
          const auto b = get(micro[m]);
          loss_sum += s.accumulate(b, loss) * double(b.size());
          samples += double(b.size());
        }
        r = s.step(get(micro[last]), loss, k + 1 < steps);
        r.loss = (loss_sum + r.loss * double(r.samples)) / (samples + double(r.samples));
        r.samples += static_cast<std::int64_t>(samples);
        metrics.log("loss", r.loss, double(r.samples));
        window.log("loss", r.loss, double(r.samples));
      } else {
        r = s.join(false);
      }
      const auto step_end = clock::now();
      epoch_samples += r.global_samples;
      const StepInfo si{.epoch = epoch,
                        .step = step,
                        .loss = r.loss,
                        .lr = s.optimizer().param_groups().front().options().get_lr(),
                        .global_samples = r.global_samples,
                        .seconds = std::chrono::duration<double>(step_end - step_start).count(),
                        .metrics = &metrics};
      observer.step(step, step_start, step_end, r.loss, r.samples);
      if (options.on_step) options.on_step(si);
      const bool last_step = r.ranks_with_next == 0;
      checkpoints.poll();
      if (options.checkpoint.every_steps > 0 && (step + 1) % options.checkpoint.every_steps == 0) {
        if (last_step) {
          save_at_end = true;  // after the epoch's evaluation, as the next epoch's start
        } else {
          const auto visited = std::min<std::int64_t>(
              sampler.size(), (k + 1 - done) * options.accumulation * options.batch_size);
          checkpoints.save(position(step + 1, epoch, k + 1, sampler.start() + visited * s.world_size()), metrics);
        }
      }
      if ((k + 1) % options.log_every == 0 && !last_step) {
        const auto m = window.sync(s);  // Note [Safe metric reduction]: every rank is here
        const double secs = std::chrono::duration<double>(clock::now() - epoch_start).count();
        observer.log(step + 1, epoch, m, si.lr, epoch_samples / secs);
        progress.step(epoch + 1, options.epochs, k + 1, steps,
                      detail::format("loss %.4f lr %.3g %.0f samples/s", m.count("loss") ? m.at("loss") : 0.0, si.lr,
                                     epoch_samples / secs),
                      true);
      } else {
        progress.step(epoch + 1, options.epochs, k + 1, steps, detail::format("loss %.4f", r.loss), false);
      }
      if (last_step) {
        ++step;  // the next epoch's first step is a new one
        break;
      }
    }
    info.seconds = std::chrono::duration<double>(clock::now() - epoch_start).count();
    info.samples_per_second = epoch_samples / info.seconds;
    window = Metrics{};
    info.metrics = metrics.sync(s);
    info.train_loss = info.metrics.count("loss") ? info.metrics.at("loss") : 0.0;
    if (options.eval) detail::evaluate(s, *options.eval, options.eval_batch_size, loss, info);
    observer.epoch(info, step, options.eval != nullptr);
    progress.line(detail::format("epoch %d/%d: train loss %.4f, %s%.0f samples/s, %.1f s", epoch + 1, options.epochs,
                                 info.train_loss,
                                 options.eval ? detail::format("test loss %.4f, test accuracy %.2f%%, ", info.eval_loss,
                                                               100 * info.eval_accuracy)
                                                    .c_str()
                                              : "",
                                 info.samples_per_second, info.seconds));
    if (save_at_end && checkpoints.saving())
      checkpoints.save(position(step, epoch + 1, 0, 0), Metrics{});  // `step` counts the epoch's last step
    if (options.on_epoch) options.on_epoch(info);
    result.train_seconds += info.seconds;
    total_samples += epoch_samples;
    result.epochs.push_back(std::move(info));
  }
  checkpoints.wait();
  result.step_times = observer.finish();
  result.samples_per_second = result.train_seconds > 0 ? total_samples / result.train_seconds : 0;
  if (scaling.reference_batch > 0 || options.lr_schedule)
    detail::set_learning_rates(s.optimizer(), base_lrs, 1.0);  // as we found them: a second fit starts alike
  return result;
}

}  // namespace paratrain
