#pragma once
/// \file
/// paratrain::observe::Observer — what fit() records besides its progress lines:
/// TensorBoard scalars, a cross-rank trace, metrics files and a straggler report.

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <system_error>
#include <utility>

#include "paratrain/core/reduce_op.hpp"
#include "paratrain/collectives/agree.hpp"
#include "paratrain/concepts/strategy.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/observe/metrics_log.hpp"
#include "paratrain/observe/step_times.hpp"
#include "paratrain/observe/tensorboard.hpp"
#include "paratrain/core/timeline.hpp"
#include "paratrain/observe/trace.hpp"

namespace paratrain::observe {

/// FitOptions::observe. Everything is off by default, and what is off costs nothing: no
/// clock is read beyond fit's own step timer, no file opened, no collective added.
/// Files are written by rank 0 unless said otherwise; docs/observability.md shows each.
///
/// \code
///   paratrain::fit(s, train, {.epochs = 5,
///                             .observe = {.tensorboard_dir = "runs/mlp",
///                                         .trace_file = "trace.json",
///                                         .metrics_jsonl = "metrics.jsonl",
///                                         .straggler_report = true}});
/// \endcode
struct ObserveOptions {
  /// Rank 0 writes the reduced metrics of every log point and epoch as TensorBoard
  /// scalars ("train/loss", "epoch/eval_accuracy", ...) into an event file here.
  std::string tensorboard_dir{};
  /// With tensorboard_dir: every rank also writes its own mean step time, communication
  /// wait and loss ("rank/step_seconds", ...) into `<tensorboard_dir>/rank<r>`.
  bool tensorboard_per_rank = false;
  /// A Chrome trace (ui.perfetto.dev, chrome://tracing) of every step's phases and
  /// bucket all-reduces on every rank, aligned to rank 0's clock; rank 0 writes it at
  /// the end. Costs a few clock reads per step and 32 bytes per event in memory.
  std::string trace_file{};
  /// One JSON object per log point and epoch (JSON Lines).
  std::string metrics_jsonl{};
  /// The same records as CSV, one column per metric.
  std::string metrics_csv{};
  /// At the end, every rank's step-time statistics are reduced; rank 0 prints them and
  /// names the ranks whose own work per step exceeds the median rank's by more than
  /// straggler_threshold (Note [Finding stragglers]). FitResult::step_times has them.
  bool straggler_report = false;
  double straggler_threshold = 0.2;

  [[nodiscard]] bool any_file() const {
    return !tensorboard_dir.empty() || !trace_file.empty() || !metrics_jsonl.empty() || !metrics_csv.empty();
  }
};

/// fit()'s side of ObserveOptions: fit calls step() after every step, log() at its log
/// points, epoch() after every epoch and finish() at the end; all else is in here.
/// Collective where fit is: every rank constructs it and calls finish() together.
template <class S>
class Observer {
 public:
  using clock = std::chrono::steady_clock;

  Observer(S& s, const ObserveOptions& options) : s_(s), options_(options), start_(clock::now()) {
    if (!options_.trace_file.empty()) {
      trace_.emplace(s_);  // collective: measures the clock offset
      if constexpr (traced_strategy<S>) {
        s_.set_timeline(&timeline_);
        attached_ = true;
      }
    }
    if (!options_.any_file()) return;
    // Rank 0 opens the files; if it cannot, every rank throws, rather than the others
    // waiting for it in the next collective.
    std::string failure;
    try {
      open_files();
    } catch (const std::exception& e) {
      failure = paratrain::detail::message_of(e);
    }
    try {
      paratrain::detail::agree(s_, "fit", failure);
    } catch (...) {
      detach();
      throw;
    }
  }

  Observer(const Observer&) = delete;
  Observer& operator=(const Observer&) = delete;
  ~Observer() { detach(); }

  /// Where fit times its data loading: null unless a trace is being recorded.
  [[nodiscard]] StepTimeline* timeline() noexcept { return trace_ ? &timeline_ : nullptr; }

  /// After each step; `begin` and `end` are fit's own step timer.
  void step(std::int64_t step, clock::time_point begin, clock::time_point end, double loss, std::int64_t samples) {
    if (trace_) {
      trace_->step(step, begin, end, timeline_);
      timeline_.clear();
    }
    if (!options_.straggler_report && !tb_rank_) return;
    const double wait = exposed_wait();
    if (pending_) times_.add(std::chrono::duration<double>(begin - pending_->begin).count(), pending_->wait);
    pending_ = Pending{begin, end, wait};
    local_.seconds += std::chrono::duration<double>(end - begin).count();
    local_.wait += wait;
    local_.loss += loss * static_cast<double>(samples);
    local_.samples += static_cast<double>(samples);
    ++local_.steps;
  }

  /// At fit's log points, with the metrics reduced over all ranks (collective: every rank calls it).
  void log(std::int64_t steps_done, int epoch, const std::map<std::string, double>& metrics, double lr,
           double samples_per_second) {
    Record r{"step", epoch, steps_done, seconds(), {}};
    for (const auto& [name, value] : metrics) r.values["train/" + name] = value;
    r.values["train/lr"] = lr;
    r.values["train/samples_per_second"] = samples_per_second;
    write(r);
    write_rank_scalars(steps_done);
  }

  /// After each epoch, with fit's EpochInfo (every value reduced over all ranks).
  template <class EpochInfo>
  void epoch(const EpochInfo& info, std::int64_t steps_done, bool evaluated) {
    // Note [Finding stragglers]: the last step of an epoch ends where it ends, not at
    // the next epoch's first step (evaluation is not the step's work).
    if (pending_) times_.add(std::chrono::duration<double>(pending_->end - pending_->begin).count(), pending_->wait);
    pending_.reset();
    Record r{"epoch", info.epoch, steps_done, seconds(), {}};
    r.values["epoch/train_loss"] = info.train_loss;
    r.values["epoch/samples_per_second"] = info.samples_per_second;
    r.values["epoch/seconds"] = info.seconds;
    if (info.rates.tokens_per_second > 0) r.values["epoch/tokens_per_second"] = info.rates.tokens_per_second;
    if (info.rates.tflops > 0) r.values["epoch/tflops"] = info.rates.tflops;
    if (info.rates.mfu > 0) r.values["epoch/mfu"] = info.rates.mfu;
    if (evaluated) {
      r.values["epoch/eval_loss"] = info.eval_loss;
      r.values["epoch/eval_accuracy"] = info.eval_accuracy;
      for (const auto& [name, value] : info.eval_metrics) r.values["epoch/eval_" + name] = value;
    }
    for (const auto& [name, value] : info.metrics)
      if (name != "loss") r.values["epoch/" + name] = value;
    write(r);
    write_rank_scalars(steps_done);
  }

  /// At the end of fit (collective): writes the trace and, if asked, reduces the step
  /// times and prints the straggler report on rank 0.
  std::optional<StepTimeReport> finish() {
    detach();
    if (trace_) trace_->write(s_, options_.trace_file);
    std::optional<StepTimeReport> report;
    if (options_.straggler_report) {
      report = times_.report(s_, options_.straggler_threshold);
      if (s_.rank() == 0) {
        std::fputs(report->text().c_str(), stdout);
        std::fflush(stdout);
      }
    }
    if (tb_) tb_->flush();
    if (tb_rank_) tb_rank_->flush();
    return report;
  }

 private:
  struct Pending {
    clock::time_point begin, end;
    double wait;
  };
  struct Local {  // this rank's sums since the last log point
    double seconds = 0, wait = 0, loss = 0, samples = 0;
    std::int64_t steps = 0;
  };

  void open_files() {
    const bool root = s_.rank() == 0;
    if (!options_.tensorboard_dir.empty()) {
      if (root) tb_.emplace(options_.tensorboard_dir, TensorBoardWriter::Options{.id = 0});
      if (options_.tensorboard_per_rank)
        tb_rank_.emplace(std::filesystem::path(options_.tensorboard_dir) / ("rank" + std::to_string(s_.rank())),
                         TensorBoardWriter::Options{.id = s_.rank()});
    }
    if (root && !options_.trace_file.empty()) {  // written at the end: fail now rather than after training
      std::error_code ec;
      const std::filesystem::path trace = options_.trace_file;
      if (trace.has_parent_path()) std::filesystem::create_directories(trace.parent_path(), ec);
      std::FILE* f = std::fopen(trace.c_str(), "w");
      if (f == nullptr) throw error("fit", 0, "cannot create the trace file '" + trace.string() + "'");
      std::fclose(f);
    }
    if (root && !options_.metrics_jsonl.empty()) jsonl_.emplace(options_.metrics_jsonl);
    if (root && !options_.metrics_csv.empty()) csv_.emplace(options_.metrics_csv);
  }

  void detach() noexcept {
    if constexpr (traced_strategy<S>)
      if (std::exchange(attached_, false)) s_.set_timeline(nullptr);
  }

  [[nodiscard]] double exposed_wait() const {
    if constexpr (communication_timed_strategy<S>) return s_.exposed_communication_seconds();
    else return 0.0;
  }

  [[nodiscard]] double seconds() const { return std::chrono::duration<double>(clock::now() - start_).count(); }

  void write(const Record& r) {
    if (tb_) tb_->scalars(r.values, r.step);
    if (jsonl_) jsonl_->write(r);
    if (csv_) csv_->write(r);
  }

  void write_rank_scalars(std::int64_t steps_done) {
    if (!tb_rank_ || local_.steps == 0) return;
    const auto n = static_cast<double>(local_.steps);
    std::map<std::string, double> v{{"rank/step_seconds", local_.seconds / n}, {"rank/wait_seconds", local_.wait / n}};
    if (local_.samples > 0) v["rank/loss"] = local_.loss / local_.samples;
    tb_rank_->scalars(v, steps_done);
    local_ = {};
  }

  S& s_;
  ObserveOptions options_;
  clock::time_point start_;
  std::optional<Trace> trace_;
  StepTimeline timeline_;
  bool attached_ = false;  // timeline_ is the strategy's
  std::optional<TensorBoardWriter> tb_, tb_rank_;
  std::optional<JsonlLog> jsonl_;
  std::optional<CsvLog> csv_;
  StepTimes times_;
  std::optional<Pending> pending_;
  Local local_;
};

}  // namespace paratrain::observe
