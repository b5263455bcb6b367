#pragma once
/// \file
/// paratrain::detail::Trainer — fit's loop, in named steps: epochs, an epoch's steps, a
/// step, what follows a step (evaluation, metrics, checkpoints, progress).

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "paratrain/collectives/agree.hpp"
#include "paratrain/collectives/gather_strings.hpp"
#include "paratrain/concepts/dataset.hpp"
#include "paratrain/concepts/sampler.hpp"
#include "paratrain/concepts/strategy.hpp"
#include "paratrain/core/batch.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/data/batches.hpp"
#include "paratrain/data/loader.hpp"
#include "paratrain/data/sampler_options.hpp"
#include "paratrain/fit/callback.hpp"
#include "paratrain/fit/callbacks.hpp"
#include "paratrain/fit/checkpoints.hpp"
#include "paratrain/fit/evaluate.hpp"
#include "paratrain/fit/lr_schedule.hpp"
#include "paratrain/fit/metrics.hpp"
#include "paratrain/fit/options.hpp"
#include "paratrain/fit/progress.hpp"
#include "paratrain/fit/sampling.hpp"
#include "paratrain/observe/observer.hpp"

namespace paratrain::detail {

// Note [One loop for every strategy]
// fit knows three things of a strategy: which replica's samples a rank trains on
// (data_shard: all stages of one pipeline are one replica), that a step takes the step's
// micro-batches at once (a pipeline schedules them; DDP accumulates them), and that a
// rank may have no loss (a pipeline's earlier stages) or no output (evaluation). Losses
// are logged only where there is one, weighted by their samples, so the reduced mean is
// over real samples; nothing is averaged in as 0.

/// fit, in named steps: the loop over epochs, an epoch's steps, a step, what follows a step.
template <strategy S, dataset D, class Loss>
class Trainer {
  using clock = std::chrono::steady_clock;

 public:
  /// `options` as fit resolved and dealt them (global_batch_size set); `from`: the checkpoint
  /// to resume from (resume_point's), if any; `journal`, where kept, the position after each
  /// step (elastic::fit's).
  Trainer(S& s, const D& train, AnySampler sampler, const FitOptions& options, Loss& loss,
          std::optional<ResumePoint> from, Journal* journal = nullptr)
      : s_(s),
        train_(train),
        options_(validated(options, s.rank())),
        loss_(loss),
        progress_(options.progress && s.rank() == 0, stdout),
        shard_(s.data_shard()),
        sampler_(std::move(sampler)),
        base_lrs_(LrSchedule::rates(s.optimizer())),
        observer_(s, options.observe),
        checkpoints_(s, options.checkpoint),
        lr_(options.lr_scaling, options.lr_schedule, double(options.global_batch_size)),
        from_(std::move(from)),
        journal_(journal),
        callbacks_(loop_callbacks(options, checkpoints_.saving(), s.rank())) {
    // Whether to agree after every step, agreed itself: a rank given on_step where another
    // is not must still take part.
    at::Tensor watches = at::full({1}, std::ranges::any_of(callbacks_, [](const AnyCallback& c) { return c.watches_steps(); })
                                     ? 1.0 : 0.0, at::kDouble);
    s.all_reduce(watches, reduce_op::max);
    watches_steps_ = watches.item<double>() != 0;
    start_ = {.dataset_size = static_cast<std::int64_t>(train.size()),
              .seed = static_cast<std::int64_t>(options.seed.value_or(0)),
              .shuffle = options.shuffle,
              .drop_last = options.drop_last,
              .replicas = shard_.count,
              .global_batch = options.global_batch_size};
  }

  FitResult run() {
    resume();
    // The state just loaded is the checkpoint's step's, before any step of this run.
    if (journal_ != nullptr && from_) keep(start_, metrics_);
    if (lr_.active()) total_steps_ = total_steps();
    if (options_.max_steps > 0 && step_ >= options_.max_steps) stopped_ = "max_steps";
    for (int epoch = static_cast<int>(start_.epoch); epoch < options_.epochs && stopped_.empty(); ++epoch)
      train_epoch(epoch);
    checkpoints_.wait();
    result_.stopped = stopped_;
    result_.steps = step_;
    if (!stopped_.empty())
      progress_.line("stopped after step " + std::to_string(step_) + ": " + stopped_ +
                     (stopped_ == time_limit_reason && !checkpoints_.saving()
                          ? " (no checkpoint.directory: nothing was saved to resume from)"
                          : ""));
    result_.step_times = observer_.finish();
    result_.samples_per_second = result_.train_seconds > 0 ? total_samples_ / result_.train_seconds : 0;
    result_.rates = Rates::of(options_.throughput, result_.samples_per_second, s_.world_size());
    if (lr_.active() || learning_rate_factor() != 1.0)
      LrSchedule::apply(s_.optimizer(), base_lrs_, 1.0);  // as found: a second fit starts alike
    return std::move(result_);
  }

 private:
  static const FitOptions& validated(const FitOptions& o, int rank) {
    if (o.epochs < 0 || o.batch_size < 1 || o.accumulation < 1 || o.log_every < 1 || o.eval_batch_size < 1)
      throw error("fit", rank,
                  "epochs must be >= 0, accumulation >= 0 (0: automatic) and batch_size, log_every and "
                  "eval_batch_size >= 1");
    if (o.max_steps < 0) throw error("fit", rank, "max_steps must be >= 0 (0: no limit)");
    return o;
  }

  /// The callbacks fit's options make, in the order they run (Note [Loop callbacks]):
  /// on_step, early stopping, reduce-on-plateau, the best checkpoint, the time limit,
  /// on_epoch, then FitOptions::callbacks.
  static std::vector<AnyCallback> loop_callbacks(const FitOptions& o, bool saving, int rank) {
    std::vector<AnyCallback> out;
    const bool has_eval = static_cast<bool>(o.eval);
    if (o.on_step) out.emplace_back(callbacks::OnStep(o.on_step));
    if (!o.early_stopping.monitor.name.empty()) out.emplace_back(callbacks::EarlyStopping(o.early_stopping, has_eval, rank));
    if (!o.reduce_on_plateau.monitor.name.empty())
      out.emplace_back(callbacks::ReduceOnPlateau(o.reduce_on_plateau, has_eval, rank));
    if (!o.checkpoint.best.name.empty()) {
      if (saving) out.emplace_back(callbacks::KeepBest(o.checkpoint.best, has_eval, rank));
      else check_monitor(o.checkpoint.best, has_eval, rank);
    }
    if (const auto deadline = deadline_of(o.time_limit, clock::now(), rank))
      out.emplace_back(callbacks::TimeLimit(*deadline, o.time_limit.reserve_seconds));
    if (o.on_epoch) out.emplace_back(callbacks::OnEpoch(o.on_epoch));
    out.insert(out.end(), o.callbacks.begin(), o.callbacks.end());
    return out;
  }

  /// What the callbacks multiply the learning rate by (reduce-on-plateau's cut).
  double learning_rate_factor() const {
    double factor = 1;
    for (const auto& c : callbacks_) factor *= c.learning_rate_factor();
    return factor;
  }

  /// What one epoch's loop keeps.
  struct Epoch {
    int index = 0;
    std::int64_t begin = 0;         ///< places of the epoch's order visited before a resume, over all replicas
    std::int64_t visiting = 0;      ///< this replica's indices in what remains of the epoch
    std::size_t micro = 0;          ///< the micro-batches they make
    std::int64_t done = 0;          ///< steps of the epoch done before a resume
    std::int64_t steps = 0;         ///< steps of the epoch in all, on this rank
    std::int64_t longest = 0;       ///< on the rank with the most: the epoch's length for the schedule
    double samples = 0;             ///< trained on, over all replicas
    std::int64_t skipped = 0;       ///< steps skipped for non-finite gradients
    clock::time_point start;
    bool save_at_end = false;
    bool complete = true;           ///< false when training stopped within the epoch
  };

  void resume() {
    if (!from_) return;
    checkpoints_.load(*from_, metrics_);
    const auto* resumed = &from_->position;
    if (resumed->dataset_size != start_.dataset_size || resumed->seed != start_.seed ||
        resumed->shuffle != start_.shuffle || resumed->drop_last != start_.drop_last)
      throw error("fit", s_.rank(),
                  "the checkpoint " + checkpoints_.resumed_from()->string() +
                      " was saved with another data set size, seed, shuffle or drop_last, so its place in the sample "
                      "order means nothing here; resume with the options it was saved with");
    if (!sampler_.resumable()) {
      if (resumed->epoch_step > 0 && resumed->replicas != shard_.count)
        throw error("fit", s_.rank(),
                    "the checkpoint " + checkpoints_.resumed_from()->string() + " was saved mid-epoch by " +
                        (resumed->replicas > 0 ? std::to_string(resumed->replicas) : std::string("another number of")) +
                        " data-parallel replicas, and this sampler can only resume an epoch where each replica left "
                        "it, so resume with as many replicas (or from a checkpoint saved at an epoch's end, or with a "
                        "sampler that has set_epoch(epoch, start), as DistributedSampler does)");
    }
    start_ = *resumed;
    start_.replicas = shard_.count;
    start_.global_batch = options_.global_batch_size;  // the checkpoint's, or its first record (dealt())
    base_lrs_ = start_.base_lrs;  // the loaded optimizer holds the scheduled rates of its step
    step_ = start_.step;
    result_.resumed_from = checkpoints_.resumed_from();
    for (auto& c : callbacks_) c.load(start_.callbacks);
    if constexpr (loss_scaled_strategy<S>)  // Note [Loss scaling]: resumed where it was
      if (start_.loss_scale > 0) s_.loss_scaler().restore(start_.loss_scale, start_.loss_scale_tracker);
  }

  // Note [Resuming mid-epoch]
  // A checkpoint records how many places of the epoch's order all replicas together had
  // visited (FitPosition::position: steps x the global batch). A sampler that can start
  // part-way (set_epoch(epoch, start): DistributedSampler, WeightedSampler,
  // DeterministicSampler) deals out only what remains, so the next global batches are the
  // same samples at any number of replicas: the order is the same, and so is the cut into
  // global batches, which a resume keeps (Note [The global batch]). Any other sampler gives
  // each replica its whole share again, and fit skips the first position / replicas indices of it:
  // position then counts steps x accumulation x batch_size per replica, unclipped, since
  // shares may differ in length (SequentialSampler's blocks) and each replica took that
  // many or all of its share. They are the indices that replica visited only when the
  // number of replicas is the same; resume() checks that it is.
  void train_epoch(int index) {
    const bool resumed = index == start_.epoch;
    Epoch e{.index = index,
            .begin = resumed ? start_.position : 0,
            .done = resumed ? start_.epoch_step : 0,
            .save_at_end = options_.checkpoint.every_epoch};
    // Where it can, the sampler starts part-way; otherwise this replica skips what it visited.
    sampler_.set_epoch(index, sampler_.resumable() ? e.begin : 0);
    const std::int64_t skip = sampler_.resumable() ? 0 : e.begin / shard_.count;
    std::vector<at::Tensor> micro;
    {
      const auto indices = sampler_.indices(skip);
      e.visiting = static_cast<std::int64_t>(indices.size());
      for (auto&& chunk : data::batches(indices, options_.batch_size)) micro.push_back(data::to_tensor(chunk));
    }
    e.micro = micro.size();
    const auto per_step = static_cast<std::size_t>(options_.accumulation);
    e.steps = e.done + static_cast<std::int64_t>((e.micro + per_step - 1) / per_step);
    // A sampler may give replicas shares of different lengths (SequentialSampler's blocks):
    // the learning-rate schedule must follow one clock on every rank, the longest epoch's,
    // or replicas that step together would step with different rates.
    auto longest = at::full({1}, static_cast<double>(e.steps), at::kDouble);
    s_.all_reduce(longest, reduce_op::max);
    e.longest = static_cast<std::int64_t>(longest.item<double>());
    data::Loader<D> loader(train_, std::move(micro), data::for_device(options_.loader, s_.device()));
    e.start = clock::now();
    for (std::int64_t k = e.done;; ++k, ++step_) {
      schedule_learning_rate(e, k);
      const auto begin = clock::now();
      double data_seconds = 0;
      const auto r = k < e.steps ? train_step(e, k, loader, data_seconds) : s_.join(false);
      if (after_step(e, k, r, begin, clock::now(), data_seconds) || !stopped_.empty()) {
        ++step_;  // the next epoch's first step is a new one
        break;
      }
    }
    end_epoch(e);
  }

  /// Step k of the epoch: its micro-batches, from the loader (the data phase: what of
  /// loading the workers did not hide), to the strategy.
  StepResult train_step(const Epoch& e, std::int64_t k, data::Loader<D>& loader, double& data_seconds) {
    const auto per_step = static_cast<std::size_t>(options_.accumulation);
    const auto first = static_cast<std::size_t>(k - e.done) * per_step;
    const auto last = std::min(e.micro, first + per_step);
    std::vector<Batch> batches;
    std::string failed;  // why this rank could not load a micro-batch
    const auto begin = clock::now();
    for (auto m = first; m < last; ++m) {
      try {
        batches.push_back(*loader.next());
      } catch (const std::exception& e) {
        if (failed.empty()) failed = inner_message(e);
        batches.push_back(paratrain::detail::unusable_batch());
      }
    }
    const auto end = clock::now();
    // One interval for both: StepInfo::data_seconds and the trace's data phase.
    data_seconds = std::chrono::duration<double>(end - begin).count();
    if (auto* timeline = observer_.timeline()) timeline->add(Phase::data, begin, end);
    if (!failed.empty()) {
      // The step refuses the unusable batch on every rank (Note [Unusable batches]), so no
      // rank waits for this one; this rank then says why.
      try {
        s_.step(std::span<const Batch>(batches), loss_, k + 1 < e.steps);
      } catch (const error&) {
      }
      throw error("fit", s_.rank(), failed);
    }
    auto r = s_.step(std::span<const Batch>(batches), loss_, k + 1 < e.steps);
    if (r.has_loss && !r.skipped) {  // a skipped step's loss is usually NaN too
      metrics_.log("loss", r.loss, double(r.samples));
      window_.log("loss", r.loss, double(r.samples));
    }
    return r;
  }

  /// Reports the step, saves a checkpoint when one is due, logs; true after the epoch's last step.
  bool after_step(Epoch& e, std::int64_t k, const StepResult& r, clock::time_point begin, clock::time_point end,
                  double data_seconds) {
    const bool last = r.ranks_with_next == 0;
    if (journal_ != nullptr) record(e, k, last);  // before any collective that could fail
    e.samples += r.global_samples;
    e.skipped += r.skipped ? 1 : 0;
    const bool has_loss = r.has_loss && !r.skipped;  // a skipped step's loss is usually NaN
    const StepInfo info{.epoch = e.index,
                        .step = step_,
                        .loss = has_loss ? r.loss : 0.0,
                        .lr = s_.optimizer().param_groups().front().options().get_lr(),
                        .global_samples = r.global_samples,
                        .seconds = std::chrono::duration<double>(end - begin).count(),
                        .data_seconds = data_seconds,
                        .metrics = &metrics_,
                        .has_loss = has_loss,
                        .stop = &stop_request_};
    observer_.step(step_, begin, end, info.loss, has_loss ? r.samples : 0);
    longest_step_ = std::max(longest_step_, info.seconds);
    checkpoints_.poll();
    stopped_ = stop_after_step(info, e, k, last);
    const bool due = !stopped_.empty() ||
                     (options_.checkpoint.every_steps > 0 && (step_ + 1) % options_.checkpoint.every_steps == 0);
    if (due && last) {
      e.save_at_end = true;  // after the epoch's evaluation, as the next epoch's start
    } else if (due && checkpoints_.saving()) {
      // Mid-epoch, with the epoch's running metrics and the places its steps visited.
      save(position(step_ + 1, e.index, k + 1, visited(e, k)), metrics_);
      if (stopped_.empty() && joiners_wait()) stopped_ = joining_reason;
    }
    if (!stopped_.empty() && !last) e.complete = false;
    const auto loss_text = [&](double loss) {
      return r.skipped ? std::string("skipped: NaN or Inf gradients") : has_loss ? format("loss %.4f", loss) : std::string();
    };
    if ((k + 1) % options_.log_every == 0 && !last) {
      auto m = window_.sync(s_);  // Note [Safe metric reduction]: every rank is here
      const double seconds = std::chrono::duration<double>(clock::now() - e.start).count();
      const auto rates = Rates::of(options_.throughput, e.samples / seconds, s_.world_size());
      const double loss = m.count("loss") ? m.at("loss") : 0.0;
      add_rates(m, options_.throughput, rates);
      observer_.log(step_ + 1, e.index, m, info.lr, rates.samples_per_second);
      progress_.step(e.index + 1, options_.epochs, k + 1, e.longest,
                     format("loss %.4f lr %.3g ", loss, info.lr) + rates_text(options_.throughput, rates), true);
    } else {
      progress_.step(e.index + 1, options_.epochs, k + 1, e.longest, loss_text(r.loss), false);
    }
    return last;
  }

  /// Reduces the epoch's metrics, evaluates, reports and saves.
  void end_epoch(Epoch& e) {
    EpochInfo info{.epoch = e.index, .skipped_steps = e.skipped, .complete = e.complete};
    info.seconds = std::chrono::duration<double>(clock::now() - e.start).count();
    info.samples_per_second = e.samples / info.seconds;
    info.rates = Rates::of(options_.throughput, info.samples_per_second, s_.world_size());
    window_ = Metrics{};
    info.metrics = metrics_.sync(s_);
    metrics_ = Metrics{};
    info.train_loss = info.metrics.count("loss") ? info.metrics.at("loss") : 0.0;
    // Note [Ending before the time limit]; ranks waiting to join: the run goes on at once.
    const bool evaluated = options_.eval && stopped_ != time_limit_reason && stopped_ != joining_reason;
    info.evaluation_skipped = options_.eval && !evaluated;
    if (evaluated) {
      const auto begin = clock::now();
      auto result = detail::evaluate(s_, options_.eval, {options_.eval_batch_size, options_.loader, options_.metrics},
                                     loss_, "fit");
      info.eval_loss = result.loss, info.eval_accuracy = result.accuracy, info.eval_samples = result.samples;
      info.eval_metrics = std::move(result.metrics);
      last_eval_ = std::chrono::duration<double>(clock::now() - begin).count();
    }
    observer_.epoch(info, step_, evaluated);
    std::string tested;
    if (info.eval_samples > 0) {
      tested = format("test loss %.4f, test accuracy %.2f%%, ", info.eval_loss, 100 * info.eval_accuracy);
      for (const auto& [name, value] : info.eval_metrics) tested += format("test %s %.4g, ", name.c_str(), value);
    }
    progress_.line(format("epoch %d/%d: train loss %.4f, %s", e.index + 1, options_.epochs, info.train_loss,
                          tested.c_str()) +
                   rates_text(options_.throughput, info.rates) + format(", %.1f s", info.seconds));
    LoopControl control;
    info.stop = &stop_request_;
    for (auto& c : callbacks_) c.after_epoch(info, control);
    info.stop = nullptr;
    if (stop_request_.requested()) control.stop(stop_request_.why());
    const auto [why, best] = agreed(control);  // on every rank, whatever callbacks each has
    if (stopped_.empty()) stopped_ = why;
    // As the next epoch's start, with what the callbacks now keep.
    if (best && checkpoints_.saving()) checkpoints_.save_best(position(step_, e.index + 1, 0, 0));
    // As the next epoch's start; step_ counts the epoch's last step.
    if (e.complete && (e.save_at_end || !stopped_.empty()) && checkpoints_.saving())
      save(position(step_, e.index + 1, 0, 0), Metrics{});
    result_.train_seconds += info.seconds;
    total_samples_ += e.samples;
    result_.epochs.push_back(std::move(info));
  }

  /// The linear scaling rule's warm-up, the user's schedule and ReduceOnPlateau's cut, at
  /// step k of the epoch.
  void schedule_learning_rate(const Epoch& e, std::int64_t k) {
    const double cut = learning_rate_factor();
    if (!lr_.active() && cut == 1.0) return;
    const double steps = double(std::max<std::int64_t>(e.longest, 1));
    const lr::Clock clock{.step = step_, .total_steps = total_steps_, .epoch = e.index + double(k) / steps};
    LrSchedule::apply(s_.optimizer(), base_lrs_, lr_.factor(clock, steps) * cut);
  }

  /// The run's optimizer steps for lr::Clock: max_steps, or epochs of the longest epoch's
  /// steps (over the ranks: a sampler may give replicas shares of different lengths).
  std::int64_t total_steps() {
    const auto share = static_cast<double>(sampler_.size());
    auto per_epoch = at::full({1}, std::ceil(std::ceil(share / double(options_.batch_size)) / options_.accumulation),
                              at::kDouble);
    s_.all_reduce(per_epoch, reduce_op::max);
    const auto all = static_cast<std::int64_t>(per_epoch.item<double>()) * options_.epochs;
    return options_.max_steps > 0 ? std::min(all, options_.max_steps) : all;
  }

  static constexpr const char* time_limit_reason = detail::time_limit_reason;
  static constexpr const char* joining_reason = detail::joining_reason;

  /// Whether ranks wait to join (the journal's count, agreed): at a mid-epoch checkpoint.
  bool joiners_wait() {
    if (journal_ == nullptr || !journal_->waiting) return false;
    auto waiting = at::full({1}, journal_->waiting(), at::kLong);
    s_.all_reduce(waiting, reduce_op::max);
    return waiting.template item<std::int64_t>() > 0;
  }

  /// Why training stops after step k of `e` (the same on every rank), or "": a callback's
  /// request on any rank (the time limit's among them), or max_steps.
  std::string stop_after_step(const StepInfo& info, const Epoch& e, std::int64_t k, bool last) {
    LoopControl control(LoopControl::Times{.longest_step = longest_step_,
                                           .longest_save = longest_save_,
                                           .last_eval = last_eval_,
                                           .epoch_ends = last,
                                           .next_ends_epoch = k + 2 >= e.longest});
    for (auto& c : callbacks_) c.after_step(info, control);
    if (stop_request_.requested()) control.stop(stop_request_.why());
    std::string why = watches_steps_ ? agreed(control).first : std::string();
    if (why.empty() && options_.max_steps > 0 && step_ + 1 >= options_.max_steps) why = "max_steps";
    return why;
  }

  /// The ranks' joint answer to their callbacks: the first rank's reason to stop where any
  /// rank has one ("" where none has), and whether any keeps this epoch as the best.
  /// Collective: one all-reduce of two scalars, and a gather of the reasons when one stops.
  std::pair<std::string, bool> agreed(const LoopControl& control) {
    const auto& why = control.stop_reason();
    auto any = at::tensor({why.empty() ? 0.0 : 1.0, control.best() ? 1.0 : 0.0}, at::kDouble);
    s_.all_reduce(any, reduce_op::max);
    const bool best = any[1].item<double>() != 0;
    if (any[0].item<double>() == 0) return {std::string(), best};
    for (auto& of_rank : all_gather_strings(s_, why.empty() ? std::vector<std::string>{} : std::vector<std::string>{why}))
      if (!of_rank.empty()) return {of_rank.front(), best};
    return {"another rank asked", best};
  }

  /// The places of the epoch's order visited after step k of `e`: whole global batches of them
  /// (Note [The global batch]); for a sampler that cannot start part-way, what each replica
  /// took (Note [Resuming mid-epoch]).
  std::int64_t visited(const Epoch& e, std::int64_t k) const {
    const auto steps = k + 1 - e.done;
    return e.begin + (sampler_.resumable() ? steps * options_.global_batch_size
                                           : steps * options_.accumulation * options_.batch_size * shard_.count);
  }

  /// The journal's entry after step k of `e`: the position a checkpoint saved now would
  /// hold. After an epoch's last step, the next epoch's start: a resume from it does not
  /// evaluate the epoch again (its evaluation is lost with the rank, its training is not).
  void record(const Epoch& e, std::int64_t k, bool last) {
    if (last) keep(position(step_ + 1, e.index + 1, 0, 0), Metrics{});
    else keep(position(step_ + 1, e.index, k + 1, visited(e, k)), metrics_);
  }

  /// The journal's entry for a state at `p`: what a checkpoint of it would record.
  void keep(const FitPosition& p, const Metrics& metrics) {
    journal_->keep(p.step, FitCheckpoints<S>::extra_of(p), FitCheckpoints<S>::rank_extra_of(metrics));
  }

  /// Saves a checkpoint of the loop at `p`, timing it for the time limit.
  void save(const FitPosition& p, const Metrics& metrics) {
    const auto begin = clock::now();
    checkpoints_.save(p, metrics);
    longest_save_ = std::max(longest_save_, std::chrono::duration<double>(clock::now() - begin).count());
  }

  /// The loop's position for a checkpoint: `steps_done` optimizer steps in all, `epoch_step`
  /// of them in `epoch`, which visited `visited` places of the epoch's sample order.
  FitPosition position(std::int64_t steps_done, int epoch, std::int64_t epoch_step, std::int64_t visited) const {
    FitPosition p = start_;
    p.step = steps_done, p.epoch = epoch, p.epoch_step = epoch_step, p.position = visited, p.base_lrs = base_lrs_;
    for (const auto& c : callbacks_) c.save(p.callbacks);
    if constexpr (loss_scaled_strategy<S>)
      if (s_.loss_scaler().active())
        p.loss_scale = s_.loss_scaler().scale(), p.loss_scale_tracker = s_.loss_scaler().growth_tracker();
    return p;
  }

  S& s_;
  const D& train_;
  const FitOptions& options_;
  Loss& loss_;
  Progress progress_;
  DataShard shard_;
  AnySampler sampler_;
  std::vector<double> base_lrs_;
  observe::Observer<S> observer_;
  FitCheckpoints<S> checkpoints_;
  LrSchedule lr_;
  std::optional<ResumePoint> from_;
  Journal* journal_;  // kept by elastic::fit: the position after each step
  FitPosition start_;
  FitResult result_;
  Metrics metrics_;  // the epoch's: reduced at its end into EpochInfo::metrics
  Metrics window_;   // fit's loss since the last progress line
  std::int64_t step_ = 0;
  double total_samples_ = 0;
  std::vector<AnyCallback> callbacks_;  // Note [Loop callbacks]
  bool watches_steps_ = false;          // some callback has after_step: agree after each step
  double longest_step_ = 0, longest_save_ = 0, last_eval_ = 0;  // seconds, for LoopControl::Times
  Stop stop_request_;    // what on_step / on_epoch asked on this rank
  std::string stopped_;  // why training stops, agreed: "" while it goes on
  std::int64_t total_steps_ = 0;  // for lr::Clock
};

}  // namespace paratrain::detail
