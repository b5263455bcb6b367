#pragma once
/// \file
/// What fit is told and what it reports: FitOptions, LrScaling, StepInfo, EpochInfo,
/// FitResult, and CrossEntropy, its default loss.

#include <ATen/ATen.h>
#include <torch/nn/functional/loss.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "paratrain/concepts/loss.hpp"
#include "paratrain/core/batch.hpp"
#include "paratrain/data/dataset_ref.hpp"
#include "paratrain/data/loader.hpp"
#include "paratrain/fit/callback.hpp"
#include "paratrain/fit/checkpoints.hpp"
#include "paratrain/fit/eval_metrics.hpp"
#include "paratrain/fit/lr_schedule.hpp"
#include "paratrain/fit/metrics.hpp"
#include "paratrain/fit/monitor.hpp"
#include "paratrain/observe/observer.hpp"
#include "paratrain/observe/step_times.hpp"

namespace paratrain {

/// Stop when the monitored value has not improved by more than `min_delta` for `patience`
/// epochs in a row (Lightning's EarlyStopping).
struct EarlyStopping {
  Monitor monitor{};      ///< empty name: off
  int patience = 3;       ///< epochs without improvement that stop training
  double min_delta = 0;   ///< an improvement must exceed this
};

/// A wall-clock budget: fit stops before it runs out, saves a checkpoint (with
/// CheckpointOptions::directory) and returns, so the job ends cleanly and the next one
/// resumes (Note [Ending before the time limit]).
struct TimeLimit {
  double seconds = 0;  ///< from fit's start; 0: no limit of its own
  /// Also end before the SLURM job's end: SLURM_JOB_END_TIME (Unix seconds; set by Slurm >= 23.02).
  bool slurm = true;
  double reserve_seconds = 0;  ///< kept free beyond the predicted step, evaluation and save
};

/// A callback's way to end training: `info.stop->request("diverged")`. The ranks agree after
/// each step (and each epoch) on whether any asked, so all stop together.
class Stop {
 public:
  void request(std::string why = "a callback asked") {
    if (why_.empty()) why_ = why.empty() ? std::string("a callback asked") : std::move(why);
  }
  [[nodiscard]] bool requested() const noexcept { return !why_.empty(); }
  [[nodiscard]] const std::string& why() const noexcept { return why_; }

 private:
  std::string why_;
};

/// What a sample costs, for throughput in the units people compare: tokens/s, TFLOP/s and
/// the model FLOPs utilisation (MFU: the model's FLOP/s over the hardware's peak).
struct Throughput {
  double tokens_per_sample = 0;  ///< tokens in a sample (a sequence's length); 0: no tokens/s
  /// Training FLOPs of one sample, forward and backward (a Transformer's: 6 × parameters ×
  /// tokens, plus attention); or give flops_per_token. 0: neither TFLOP/s nor MFU.
  double flops_per_sample = 0;
  double flops_per_token = 0;    ///< used when flops_per_sample is 0: times tokens_per_sample
  /// The peak FLOP/s of one rank's device for the training's precision, as the user states
  /// it or plan::peak_flops knows it ("H100-SXM", "bf16"); 0: no MFU.
  double peak_flops_per_rank = 0;

  /// FLOPs of one sample: flops_per_sample, or flops_per_token × tokens_per_sample.
  [[nodiscard]] double sample_flops() const {
    return flops_per_sample > 0 ? flops_per_sample : flops_per_token * tokens_per_sample;
  }
};

/// Rates at `samples_per_second` over all ranks (`ranks` of them), by Throughput's
/// definitions: tokens/s, TFLOP/s, and MFU = model FLOP/s / (peak per rank × ranks).
struct Rates {
  double samples_per_second = 0;
  double tokens_per_second = 0;  ///< with Throughput::tokens_per_sample
  double tflops = 0;             ///< model TFLOP/s over all ranks, with the FLOPs per sample
  double mfu = 0;                ///< a fraction, with the FLOPs and the peak
  static Rates of(const Throughput& t, double samples_per_second, int ranks) {
    const double flops = t.sample_flops() * samples_per_second;
    return {.samples_per_second = samples_per_second,
            .tokens_per_second = t.tokens_per_sample * samples_per_second,
            .tflops = flops / 1e12,
            .mfu = t.peak_flops_per_rank > 0 && ranks > 0 ? flops / (t.peak_flops_per_rank * ranks) : 0.0};
  }
};

/// After each optimizer step.
struct StepInfo {
  int epoch = 0;                 ///< from 0
  std::int64_t step = 0;         ///< optimizer steps since fit began
  double loss = 0;               ///< this rank's mean loss in this step (0 without has_loss)
  double lr = 0;                 ///< of the first parameter group
  double global_samples = 0;     ///< the step's effective batch
  double seconds = 0;            ///< this step's wall time on this rank
  /// Of `seconds`, the time this rank waited for the step's batches: what of reading and
  /// collating them the loader's workers did not hide (the trace's "data" phase).
  double data_seconds = 0;
  Metrics* metrics = nullptr;    ///< log your own values here; fit reduces them safely
  bool has_loss = true;          ///< false where this rank computes no loss (a pipeline's earlier stages, a skipped step)
  Stop* stop = nullptr;          ///< stop->request(why) ends training after this step, on every rank
};

/// After each epoch; the losses, accuracy and metrics are reduced over all ranks.
struct EpochInfo {
  int epoch = 0;
  double train_loss = 0;         ///< mean over the epoch's samples (of steps not skipped)
  double eval_loss = 0;          ///< when an evaluation set was given
  double eval_accuracy = 0;      ///< when targets are class indices
  std::int64_t eval_samples = 0; ///< evaluated once each, never duplicated
  double seconds = 0;            ///< training time of the epoch on this rank (evaluation excluded)
  double samples_per_second = 0; ///< over all ranks
  Rates rates;                   ///< samples/s as tokens/s, TFLOP/s and MFU (FitOptions::throughput)
  std::map<std::string, double> metrics;  ///< everything logged, reduced (Note [Safe metric reduction])
  /// FitOptions::metrics over the evaluation set, by name (Note [Metrics as sums]).
  std::map<std::string, double> eval_metrics;
  /// Steps whose optimizer step was skipped for NaN or Inf gradients (NonFinite::skip).
  std::int64_t skipped_steps = 0;
  /// false for an epoch that training left part-way (max_steps, a time limit, a request).
  bool complete = true;
  /// true where an evaluation set was given but not evaluated (stopping for time skips it):
  /// the eval_ values are then not this epoch's.
  bool evaluation_skipped = false;
  /// In on_epoch: stop->request(why) ends training after this epoch. Null in FitResult.
  Stop* stop = nullptr;
};

struct FitResult {
  std::vector<EpochInfo> epochs;
  double train_seconds = 0;       ///< all epochs' training time
  double samples_per_second = 0;  ///< over all ranks and epochs
  Rates rates;                     ///< the same as tokens/s, TFLOP/s and MFU (FitOptions::throughput)
  /// Every rank's step-time statistics and the stragglers, with ObserveOptions::straggler_report.
  std::optional<observe::StepTimeReport> step_times;
  /// The checkpoint this run resumed from (FitOptions::checkpoint); `epochs` then holds
  /// only the epochs it finished, the first of them possibly begun before.
  std::optional<std::filesystem::path> resumed_from;
  /// Why training ended before FitOptions::epochs ("max_steps", "time limit", "early
  /// stopping: ...", a callback's reason); empty when it trained them all.
  std::string stopped;
  std::int64_t steps = 0;  ///< optimizer steps since the run began (with those before a resume)
};

struct FitOptions {
  int epochs = 1;
  /// Samples per data-parallel replica per micro-batch; with a global batch (below), the
  /// largest micro-batch a replica's share of a step is cut into.
  std::int64_t batch_size = 32;
  /// Samples of each optimizer step over all replicas, the same at any world size: each of R
  /// replicas takes global_batch_size / R (R must divide it) in the fewest micro-batches of at
  /// most batch_size. 0: batch_size x accumulation x replicas. A resumed run keeps the global
  /// batch its checkpoint was saved with, at any number of replicas (Note [The global batch]).
  std::int64_t global_batch_size = 0;
  /// Micro-batches per optimizer step (a pipeline's M); 0: 1, but 2K for a pipeline of K
  /// ranks, enough to fill it (Note [fit's defaults]).
  int accumulation = 0;
  bool shuffle = true;  ///< the sampler's shuffle, seed and drop_last (data::SamplerOptions)
  /// The sample order's seed; unset: paratrain::seed() (paratrain::main's, else 0).
  std::optional<std::uint64_t> seed{};
  bool drop_last = false;
  /// Any paratrain::dataset (`.eval = &test`), evaluated after each epoch, exactly sharded.
  data::DatasetRef eval{};
  std::int64_t eval_batch_size = 1000;
  /// Computed over the evaluation set beside its loss, exactly: `{metrics::TopK{5}}` (fit/eval_metrics.hpp).
  std::vector<AnyMetric> metrics{};
  /// Worker threads reading the next batches while a step computes, training and evaluation.
  data::LoaderOptions loader{};
  LrScaling lr_scaling{};
  /// A multiplier of the learning rate before each step, on top of lr_scaling: a function
  /// of lr::Clock (step, total steps, fractional epoch) such as lr::warmup_cosine(500), or
  /// of the fractional epoch alone. Empty: constant.
  lr::Schedule lr_schedule{};
  /// Cuts the rate when a monitored value stops improving (after each epoch).
  lr::ReduceOnPlateau reduce_on_plateau{};
  /// Stop after this many optimizer steps since the run began (a resumed run counts those
  /// before it); 0: `epochs` alone decides.
  std::int64_t max_steps = 0;
  /// A wall-clock budget that ends training cleanly, with a checkpoint, before it runs out.
  TimeLimit time_limit{};
  /// Stop when a monitored value stops improving.
  EarlyStopping early_stopping{};
  /// Tokens and FLOPs per sample and the device's peak: tokens/s, TFLOP/s and MFU in the
  /// progress lines, the logs and the result.
  Throughput throughput{};
  std::int64_t log_every = 100;  ///< steps between progress lines and metric reductions
  bool progress = true;          ///< rank 0 reports progress on stdout
  std::function<void(const StepInfo&)> on_step{};
  std::function<void(const EpochInfo&)> on_epoch{};
  /// One's own loop callbacks, after fit's own (Note [Loop callbacks]): any value with
  /// after_step(const StepInfo&, LoopControl&), after_epoch(const EpochInfo&, LoopControl&),
  /// learning_rate_factor() and save / load (fit/callback.hpp).
  std::vector<AnyCallback> callbacks{};
  /// TensorBoard, trace, metrics files, straggler report: all off by default (observe/observer.hpp).
  observe::ObserveOptions observe{};
  /// Save checkpoints while training and resume from them: off by default (fit/checkpoints.hpp).
  CheckpointOptions checkpoint{};
};

/// Cross-entropy over class indices: fit's default loss.
struct CrossEntropy {
  at::Tensor operator()(const at::Tensor& output, const at::Tensor& target) const {
    return torch::nn::functional::cross_entropy(output, target);
  }
};

namespace detail {

/// Whether `Loss` trains strategy S's model: a loss_for what its model returns.
template <class Loss, class S>
concept loss_of_strategy = loss_for<Loss, typename S::output_type>;

/// Checks that Loss fits S's model, with a message that names both forms.
template <class S, class Loss>
consteval bool explain_loss() {
  static_assert(loss_of_strategy<Loss, S>,
                "paratrain::fit: the loss does not take what the model returns: give `at::Tensor loss(const "
                "at::Tensor& output, const at::Tensor& target)` for a model that returns a tensor, or `at::Tensor "
                "loss(const Output& output, const paratrain::Batch& batch)` with Output what the model (a pipeline's "
                "last stage) returns, e.g. std::tuple<at::Tensor, at::Tensor> (Note [Losses of a batch])");
  return true;
}

}  // namespace detail

}  // namespace paratrain
