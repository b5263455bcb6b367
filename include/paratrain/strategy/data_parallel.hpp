#pragma once
/// \file
/// paratrain::DataParallel — distributed data parallelism (PyTorch's DDP) for LibTorch.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <concepts>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "paratrain/comm/single_device.hpp"
#include "paratrain/concepts/checkpointable.hpp"
#include "paratrain/concepts/communicator.hpp"
#include "paratrain/concepts/module.hpp"
#include "paratrain/concepts/optimizer.hpp"
#include "paratrain/concepts/strategy.hpp"
#include "paratrain/core/batch.hpp"
#include "paratrain/collectives/agree.hpp"
#include "paratrain/collectives/all_reduce_on.hpp"
#include "paratrain/strategy/detail/allocator.hpp"
#include "paratrain/collectives/coalesce.hpp"
#include "paratrain/collectives/model_device.hpp"
#include "paratrain/collectives/same_model.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/core/timeline.hpp"
#include "paratrain/strategy/bucket_layout.hpp"
#include "paratrain/strategy/deterministic.hpp"
#include "paratrain/strategy/gradient_buckets.hpp"
#include "paratrain/strategy/memory_check.hpp"
#include "paratrain/strategy/parameter_store.hpp"
#include "paratrain/strategy/precision.hpp"
#include "paratrain/strategy/replicated_parameters.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "paratrain/strategy/sharded_parameters.hpp"

namespace paratrain {

/// What a step does when an averaged gradient holds NaN or Inf (DataParallelOptions).
enum class NonFinite {
  apply,  ///< nothing: the optimizer applies it, as PyTorch does
  skip,   ///< every rank skips the optimizer step alike (StepResult::skipped), as AMP's scaler does
  stop,   ///< every rank throws paratrain::error naming the step and the parameter
};

/// How DataParallel buckets, overlaps and synchronises; the defaults are PyTorch DDP's.
struct DataParallelOptions {
  /// Gradients are all-reduced in buckets of about this size (the first one smaller,
  /// so that communication starts early in backward). Note [Bucket order].
  std::size_t bucket_cap_bytes = std::size_t{25} << 20;
  std::size_t first_bucket_cap_bytes = std::size_t{1} << 20;
  /// Allow parameters that receive no gradient in a step (a branch not taken, a frozen
  /// head). Off, such a parameter is an error that names it, on every rank.
  bool find_unused_parameters = false;
  /// Copy rank 0's buffers (batch-norm running statistics, ...) to every rank before
  /// each step, as PyTorch does, so that all replicas evaluate alike.
  bool broadcast_buffers = true;
  /// Let ranks with fewer batches keep matching the others' collectives (`join`)
  /// instead of hanging them. Off, differing batch counts are an error on every rank.
  bool join = true;
  /// Clip the gradients so that their global 2-norm is at most this before each
  /// optimizer step, exactly as torch::nn::utils::clip_grad_norm_ on the whole model
  /// (also when sharded); 0: off. StepResult::grad_norm reports the norm before clipping.
  double max_grad_norm = 0;
  /// NaN or Inf in the averaged gradients: apply, skip the step, or stop. Checking (skip,
  /// stop) reads every gradient once, and needs one 2-element all-reduce per step where the
  /// gradients are sharded (ZeRO 2, 3) or split into pipeline stages: the one clipping
  /// makes there, when max_grad_norm is set too.
  NonFinite nonfinite_gradients = NonFinite::apply;
  /// Mixed precision: forward under autocast (bf16), gradients summed in bf16; the
  /// parameters and the optimizer's state stay fp32. Note [Mixed precision].
  Precision precision{};
  /// ZeRO: shard over groups of this many consecutive ranks and replicate across the
  /// world size / shard_group groups (hybrid sharding: FSDP2's HSDP, ZeRO++'s hpZ), so that
  /// the sharding traffic stays inside a group; it must divide the world size. 0: shard
  /// over every rank. Note [Hybrid sharding].
  int shard_group = 0;
  /// ZeRO-3: how many units are gathered ahead of the one computing, in forward and in
  /// backward (FSDP's limit_all_gathers with a depth): more hides more of the gathers'
  /// time behind compute, and holds that many more units whole (Note [Pooled transients]).
  int prefetch = 1;
  /// Where and in which type a model the strategy builds (the constructors that take a
  /// build function) is placed, unit by unit at ZeRO stage 3: Note [Sharded construction].
  /// A model built already must be there (or these be unset).
  BuildOptions build{};
  /// Check at construction that paratrain::plan::peak fits the memory this process may
  /// still use (Note [Checking the plan]); off by default.
  MemoryCheck memory{};
  /// The same bits at every world size and stage: each global batch cut into this many
  /// virtual shards, their gradients summed in shard order (Note [Deterministic training]).
  /// Off by default; `{.shards = 12}` covers 1-4 ranks.
  Deterministic deterministic{};
};

template <class Model, class Comm, class Update>
class DataParallel;

/// A function that builds a `Model` (not a model itself: a module holder is callable too,
/// so that is ruled out first). Note [Sharded construction].
template <class F, class Model>
concept model_builder = !std::is_base_of_v<torch::detail::ModuleHolderIndicator, std::remove_cvref_t<F>> &&
                        std::invocable<F&> && std::same_as<std::invoke_result_t<F&>, Model>;

/// The key to DataParallel's driver hooks (Note [Steps driven from outside]): only a
/// DataParallel can make one, and only the pipeline's (`DataParallel<Pipeline<...>>`, which
/// drives one DataParallel per stage) does, so user code cannot call the hooks.
class PipelineDriver {
  template <class, class, class>
  friend class DataParallel;
  PipelineDriver() = default;  // a pipeline's key: train with step() and join() instead
};

/// Data parallelism across the ranks of `Comm`: every rank holds a replica of `Model`,
/// trains it on its own samples, and gradients are averaged so that the replicas stay
/// identical and equal to single-device training on all ranks' samples together
/// (Note [Exact averaging]).
///
/// - `DataParallel<Net, comm::Mpi>` is DDP across processes (mpirun, srun, ...);
/// - `DataParallel<Net, comm::Nccl>` is DDP across GPUs;
/// - `DataParallel<Net>` (comm::SingleDevice) is plain single-device training.
///
/// At construction rank 0's parameters and buffers are broadcast to every rank. During
/// backward each bucket of gradients is all-reduced as soon as it is complete, while
/// backward goes on with the earlier layers.
///
/// \code
///   paratrain::comm::Mpi::Environment env(argc, argv);
///   using Strategy = paratrain::DataParallel<Net, paratrain::comm::Mpi, torch::optim::Adam>;
///   Strategy ddp(Net(), paratrain::comm::Mpi(), torch::optim::AdamOptions(1e-3));
///   auto r = ddp.step({x, y}, paratrain::CrossEntropy{});
/// \endcode
template <class Model, class Comm = comm::SingleDevice, class Update = torch::optim::SGD>
class DataParallel {
  static_assert(explain_module<Model>());  // its forward: explain_model where it is called
  static_assert(explain_communicator<Comm>());
  static_assert(async_communicator<Comm>,
                "paratrain: DataParallel overlaps communication with backward and needs a communicator with "
                "`iall_reduce(at::Tensor&, reduce_op)` returning a request; see docs/communicators.md");
  static_assert(update_policy<Update>,
                "paratrain: DataParallel's third argument is an optimizer type (torch::optim::Adam, ...) or "
                "paratrain::Sharded<Optimizer, paratrain::zero::stageN>");
  static_assert(explain_optimizer<typename detail::optimizer_of<Update>::type>());

  static_assert(detail::zero_stage_of<Update> == 0 || explain_async_sharding_communicator<Comm>());
  static_assert(detail::zero_stage_of<Update> < 3 || requires(const Comm& c) { { c.split(0, 0) } -> std::same_as<Comm>; },
                "paratrain: ZeRO stage 3 gathers parameters on a communicator of its own and needs `Comm split(int "
                "color, int key) const`; see docs/communicators.md (or use stage 2)");
  // Note [Parameter stores]: who holds the parameters and who steps them.
  using Store = std::conditional_t<(detail::zero_stage_of<Update> > 0),
                                   ShardedParameters<Comm, typename detail::optimizer_of<Update>::type,
                                                     detail::zero_stage_of<Update>>,
                                   ReplicatedParameters<Comm, typename detail::optimizer_of<Update>::type>>;
  static_assert(parameter_store<Store, Comm>);
  using Grads = GradientBuckets<Comm, typename Store::gradient_hook>;

 public:
  using model_type = Model;
  /// What the model's forward returns: a tensor, or a tuple of them (a batch_loss reads it).
  using output_type = detail::model_output_t<Model>;
  using communicator_type = Comm;
  using update_type = Update;
  using optimizer_type = typename detail::optimizer_of<Update>::type;
  using Options = DataParallelOptions;
  /// 0 for DDP, else the ZeRO stage.
  static constexpr int stage = detail::zero_stage_of<Update>;

  /// Collective: every rank of `comm` constructs its replica together.
  template <class OptimOptions>
    requires optimizer_from<optimizer_type, OptimOptions>
  DataParallel(Model model, Comm comm, OptimOptions optimizer_options, Options options = {})
      : DataParallel(Built{}, [&](Comm&) { return std::move(model); }, std::move(comm), all_parameters,
                     std::move(optimizer_options), options) {}

  /// With parameter groups of different options (weight decay on weights only, say):
  /// every parameter that requires a gradient in exactly one group; `defaults` for the
  /// groups that have no options of their own. Collective.
  template <class OptimOptions>
    requires optimizer_from<optimizer_type, OptimOptions>
  DataParallel(Model model, Comm comm, ParamGroups groups, OptimOptions defaults, Options options = {})
      : DataParallel(Built{}, [&](Comm&) { return std::move(model); }, std::move(comm),
                     [&](Model&) { return std::move(groups); }, std::move(defaults), options) {}

  /// Builds the model by calling `build()`: at ZeRO stage 3 inside a ShardedConstruction,
  /// so that each Unit keeps only this rank's shard from the moment it is built and no
  /// rank ever holds the whole model (Note [Sharded construction]); every rank must then
  /// draw the same initial values (seed them alike: checked). Under every other strategy,
  /// as passing `build()`'s model. The model is placed as `options.build` says. Collective.
  ///
  /// \code
  ///   torch::manual_seed(0);  // the same on every rank
  ///   Strategy s([] { return Net(); }, comm::Mpi(), torch::optim::AdamOptions(1e-3));
  /// \endcode
  template <model_builder<Model> Build, class OptimOptions>
    requires optimizer_from<optimizer_type, OptimOptions>
  DataParallel(Build build, Comm comm, OptimOptions optimizer_options, Options options = {})
      : DataParallel(Built{}, sharded_build(build, options), std::move(comm), all_parameters,
                     std::move(optimizer_options), options) {}

  /// Builds the model as above, then asks `groups(model)` for its parameter groups. Collective.
  template <model_builder<Model> Build, std::invocable<Model&> Groups, class OptimOptions>
    requires std::same_as<std::invoke_result_t<Groups&, Model&>, ParamGroups> &&
             optimizer_from<optimizer_type, OptimOptions>
  DataParallel(Build build, Comm comm, Groups groups, OptimOptions defaults, Options options = {})
      : DataParallel(Built{}, sharded_build(build, options), std::move(comm), groups, std::move(defaults), options) {}

  /// With a default-constructed communicator (comm::Mpi: the world; comm::SingleDevice),
  /// so that every strategy is made alike: `Strategy s(Net(), torch::optim::AdamOptions(1e-3));`.
  template <class OptimOptions>
    requires optimizer_from<optimizer_type, OptimOptions> && std::default_initializable<Comm>
  DataParallel(Model model, OptimOptions optimizer_options, Options options = {})
      : DataParallel(std::move(model), Comm{}, std::move(optimizer_options), options) {}

  /// Built by `build()` (above), with a default-constructed communicator.
  template <model_builder<Model> Build, class OptimOptions>
    requires optimizer_from<optimizer_type, OptimOptions> && std::default_initializable<Comm>
  DataParallel(Build build, OptimOptions optimizer_options, Options options = {})
      : DataParallel(std::move(build), Comm{}, std::move(optimizer_options), options) {}

  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  /// One training step over this rank's micro-batches (each a Batch; none for a rank
  /// that has no samples this step) and those of all other ranks: forward and backward
  /// of each, the last backward overlapped with the all-reduce, one optimizer step;
  /// equal to single-device training on all ranks' samples together. `loss` returns the
  /// *mean* loss of a batch. `has_next` says whether this rank has another step's
  /// batches after these (it lets `join` end every rank's loop together).
  template <loss_for<output_type> Loss>
  StepResult step(std::span<const Batch> micro_batches, Loss&& loss, bool has_next = true) {
    if (micro_batches.empty()) return join(has_next);
    if (options_.deterministic.on()) {
      if (micro_batches.size() != 1) refuse_in_deterministic_mode("DataParallel::step", "micro-batches");
      return step(micro_batches.front(), loss, has_next);
    }
    std::string problem;
    for (std::size_t i = 0; i < micro_batches.size() && problem.empty(); ++i)
      problem = detail::batch_problem(micro_batches[i]);
    agree_before_forward(problem);
    if (!problem.empty()) {  // joins, then every rank throws
      begin_step();
      grads_->prepare(/*sync=*/true);
      return end_step(0, 0.0, has_next, /*joined=*/true, problem);
    }
    double loss_sum = 0, samples = 0;
    for (const auto& b : micro_batches.first(micro_batches.size() - 1)) {
      loss_sum += accumulate(b, loss) * static_cast<double>(b.size());
      samples += static_cast<double>(b.size());
    }
    auto r = step_agreed(micro_batches.back(), loss, has_next);
    samples += static_cast<double>(r.samples);
    r.loss = samples > 0 ? (loss_sum + r.loss * static_cast<double>(r.samples)) / samples : 0.0;
    r.samples = static_cast<std::int64_t>(samples);
    r.has_loss = samples > 0;
    return r;
  }

  /// One training step over `batch` on this rank and the batches of all other ranks:
  /// the step above with one micro-batch.
  /// A batch the step cannot use (targets for fewer samples than the inputs, say) is an
  /// error on every rank, named by the rank that has it (Note [Unusable batches]).
  template <loss_for<output_type> Loss>
  StepResult step(const Batch& batch, Loss&& loss, bool has_next = true) {
    if (options_.deterministic.on()) return step_deterministic(batch, loss, has_next);
    agree_before_forward(detail::batch_problem(batch));
    return step_agreed(batch, loss, has_next);
  }

  /// Forward and backward over `batch` without communicating: gradients accumulate
  /// until the next `step`, which then averages over all their samples. Returns the mean loss.
  /// A batch it cannot use is left out and makes that next step an error on every rank; at
  /// ZeRO stage 3, where forward gathers units, it throws here, on this rank only (give
  /// stage 3 its micro-batches through step(span), which checks them all first).
  template <loss_for<output_type> Loss>
  double accumulate(const Batch& batch, Loss&& loss) {
    if (options_.deterministic.on()) refuse_in_deterministic_mode("DataParallel::accumulate", "accumulate()");
    if (!accumulating_) new_step();
    accumulating_ = true;
    if (auto problem = detail::batch_problem(batch); !problem.empty()) {
      if constexpr (Store::gathers_in_forward) throw error("DataParallel::accumulate", rank(), problem);
      if (pending_problem_.empty()) pending_problem_ = std::move(problem);
      return 0.0;
    }
    grads_->prepare(/*sync=*/false);
    if (batch.size() == 0) return 0.0;
    pending_samples_ += static_cast<double>(batch.size());
    return forward_backward(batch, loss);
  }

  /// For a rank that has no batch this step while others do: takes part in their
  /// collectives with no samples, and applies the same update, so replicas stay equal.
  StepResult join(bool has_next = false) {
    if (options_.deterministic.on()) {  // every shard has samples: a rank without any is an error everywhere
      static_cast<void>(agree_on_shards(0, {}));
      throw error("DataParallel::join", rank(), "deterministic mode gives every rank samples in every step");
    }
    agree_before_forward({});
    begin_step();
    grads_->prepare(/*sync=*/true);
    return end_step(0, 0.0, has_next, /*joined=*/true);
  }

  // Note [Steps driven from outside]
  // A pipeline runs its stages' forward and backward passes itself, in the order of its
  // schedule, and uses DataParallel for everything around them: the gradient buckets
  // (averaged over the stage's replicas, overlapped with the last backward), ZeRO's
  // sharding and the optimizer step. It calls begin_external_step() once, before_backward()
  // before each backward pass (true before the rank's last one, whose gradients complete
  // the buckets), and end_external_step() with the samples of the passes. The hooks take a
  // PipelineDriver, which only the pipeline makes: called otherwise, they would break the
  // step protocol (a step begun twice, buckets never launched).

  /// Note [Steps driven from outside]: clipping (max_grad_norm) then takes the norm over
  /// this model's gradients and those `reduce` adds (a pipeline's other stages).
  void set_norm_elsewhere(PipelineDriver, std::function<void(at::Tensor&)> reduce) {
    norm_elsewhere_ = std::move(reduce);
  }
  /// Note [Steps driven from outside]: before the step's first forward.
  void begin_external_step(PipelineDriver) { begin_step(); }
  /// Note [Steps driven from outside]: before each backward pass over model()'s parameters.
  void before_backward(PipelineDriver, bool last) { grads_->prepare(/*sync=*/last); }
  /// Note [Steps driven from outside]: after the last backward; `samples` were this rank's.
  /// The result's loss is the caller's to fill in.
  StepResult end_external_step(PipelineDriver, std::int64_t samples, bool has_next) {
    if (samples == 0) grads_->prepare(/*sync=*/true);  // no backward ran: nothing is pending
    return end_step(samples, 0.0, has_next, /*joined=*/samples == 0);
  }

  /// The model's output for the batch's inputs, in evaluation mode and without gradients
  /// (under autocast with Precision::autocast, as training's forward: then often bf16).
  output_type predict(const Batch& batch) {
    static_assert(explain_model<Model>());
    const detail::AutocastScope autocast(options_.precision.autocast, device_);
    return detail::predict(model_, Batch(batch.inputs, at::Tensor()).to(device_).inputs);  // Note [One move per batch]
  }
  /// The output of a one-input model for `input`, in evaluation mode and without gradients.
  output_type predict(const at::Tensor& input) { return predict(Batch{input, at::Tensor()}); }

  /// Every parameter of the model, whole, as a copy (model()->parameters() order).
  /// Collective: at ZeRO stage 3 the parameters are gathered for it, so every rank calls it.
  std::vector<at::Tensor> full_parameters() {
    std::vector<at::Tensor> out;
    const auto copy = [&] {
      for (const auto& p : model_->parameters()) out.push_back(p.detach().clone());
    };
    store_->with_gathered(copy);
    return out;
  }

  /// Reduces `t` in place over the ranks (for metrics), on the model's device, where
  /// the communicator works (comm::Nccl reduces CUDA tensors only).
  void all_reduce(at::Tensor& t, reduce_op op) {
    detail::all_reduce_on(comm_, t, device_, op);
  }

  /// Makes every replica evaluate alike: copies rank 0's buffers (batch-norm running
  /// statistics, ...) to every rank, when broadcast_buffers is on. Collective.
  void synchronize() {
    if (options_.broadcast_buffers) detail::broadcast_coalesced(comm_, model_->buffers(), 0);
  }

  [[nodiscard]] int rank() const { return comm_.rank(); }
  [[nodiscard]] int world_size() const { return comm_.size(); }
  /// Every rank is a replica of its own.
  [[nodiscard]] DataShard data_shard() const { return {.index = comm_.rank(), .count = comm_.size()}; }
  [[nodiscard]] Model& model() noexcept { return model_; }
  /// Where the model's parameters are, as they were at construction: batches move there
  /// (Note [One move per batch]), and the communicator reduces there.
  [[nodiscard]] at::Device device() const noexcept { return device_; }
  /// The optimizer; when sharded, the one over this rank's pieces (Note [Optimizer on
  /// pieces]), with the same parameter groups as given, so schedules work alike.
  [[nodiscard]] optimizer_type& optimizer() noexcept { return store_->optimizer(); }
  [[nodiscard]] Comm& communicator() noexcept { return comm_; }
  [[nodiscard]] const Options& options() const noexcept { return options_; }
  [[nodiscard]] std::size_t bucket_count() const noexcept { return grads_->bucket_count(); }
  /// The parameter names of bucket `i`, in the order they are laid out.
  [[nodiscard]] std::vector<std::string> bucket_names(std::size_t i) const { return store_->layout().names(i); }
  /// Seconds the last step blocked on communication that compute did not hide: the wait
  /// for the gradients after backward, and (ZeRO) the parameter gathers it waited for.
  [[nodiscard]] double exposed_communication_seconds() const noexcept {
    return grads_->exposed_seconds() + store_->exposed_seconds();
  }
  /// Bytes of gradients this rank handed to the last step's collectives: the padded
  /// buckets, in the type they were summed in (half of fp32's with Precision::reduce =
  /// at::kBFloat16). paratrain::plan::gradient_traffic predicts it.
  [[nodiscard]] std::int64_t gradient_bytes_sent() const noexcept { return grads_->sent_bytes(); }
  /// Bytes this rank holds for parameters, gradients and optimizer state between steps:
  /// what paratrain::plan predicts (docs/sharding.md).
  [[nodiscard]] ModelStateBytes model_state_bytes() const {
    ModelStateBytes out = store_->bytes();
    out.gradients = grads_->bytes();
    return out;
  }
  /// The memory plan of this model, stage and world size (sizes read off the model at
  /// construction): `plan::peak(s.memory_plan(), stage)` is what a rank should hold at most
  /// (Note [Peak memory model]); planned_peak() is that figure for this strategy.
  [[nodiscard]] const plan::Model& memory_plan() const noexcept { return plan_; }
  /// At stage 3 under autocast, from the step on which the ranks agreed which units are
  /// gathered in bf16 (Note [Gathers in the compute type]), the plan counts them so;
  /// before, and at construction's memory check, fp32 gathers and every autocast copy.
  [[nodiscard]] plan::Peak planned_peak() const {
    auto m = plan_;
    if constexpr (stage == 3) {
      const auto [narrow, all] = store_->narrow_parameters();
      m.narrow_parameters = narrow;
      if (all) m.gather_bytes = 2.0;
    }
    return plan::peak(m, planned_stage());
  }
  /// This strategy's stage in paratrain::plan's terms.
  [[nodiscard]] static constexpr plan::stage planned_stage() noexcept { return plan::stage(stage); }
  /// Where this rank keeps the model's and optimizer's state (paratrain::checkpointable):
  /// DDP holds everything whole; ZeRO's optimizer steps pieces of the parameters, and
  /// at stage 3 the unit parameters at rest are this rank's pieces too.
  [[nodiscard]] CheckpointLayout checkpoint_layout() { return store_->checkpoint_layout(*model_); }
  /// Dynamic loss scaling's state (Note [Loss scaling]): inactive, at scale 1, unless
  /// Precision::loss_scale or fp16 autocast asks for it. fit keeps it in its checkpoints.
  [[nodiscard]] LossScaler& loss_scaler() noexcept { return scaler_; }
  [[nodiscard]] const LossScaler& loss_scaler() const noexcept { return scaler_; }
  /// After a checkpoint was loaded into checkpoint_layout()'s slices: nothing derives
  /// from them here (every rank loaded its own). Collective, by the concept.
  void loaded() noexcept {}
  /// The optimizer steps taken (or skipped) so far; deterministic mode keys each shard's
  /// random draws on it (deterministic::shard_seed). checkpoint::load sets it to the
  /// checkpoint's step, so that a resumed run draws what the uninterrupted one drew.
  [[nodiscard]] std::int64_t step_count() const noexcept { return steps_; }
  void set_step_count(std::int64_t steps) noexcept { steps_ = steps; }

  /// Reports each step's phases and each bucket's all-reduce into `timeline` (fit's
  /// trace does this); null, the default, times nothing. Note [Zero-cost timeline].
  void set_timeline(observe::StepTimeline* timeline) noexcept {
    timeline_ = timeline;
    grads_->set_timeline(timeline);
  }

 private:
  struct Built {};  // the tag of the constructor every public one delegates to
  static ParamGroups all_parameters(Model& model) { return {torch::optim::OptimizerParamGroup(model->parameters())}; }

  /// `make(comm)` as the model: `build()` inside a ShardedConstruction at stage 3 (Note
  /// [Sharded construction]), placed as options.build says (default: the communicator's device).
  template <class Build>
  static auto sharded_build(Build& build, const Options& options) {
    return [&build, &options](Comm& comm) -> Model {
      const auto device = options.build.device ? *options.build.device : detail::communicator_device(comm);
      std::optional<ShardedConstruction> scope;
      if constexpr (stage == 3) {
        // Over this rank's sharding group: Note [Hybrid sharding] (its groups are consecutive ranks).
        const int g = detail::sharding_group_size(comm.size(), options.shard_group, comm.rank());
        scope.emplace(comm.rank() % g, g, options.bucket_cap_bytes, device, options.build.dtype);
      }
      Model model = build();
      scope.reset();
      detail::move_whole_parameters(*model, device, options.build.dtype);
      return model;
    };
  }

  /// The ranks a shard is cut for: a hybrid sharding group's, else every rank.
  std::int64_t sharding_ranks(const Options& options) const {
    return stage > 0 ? detail::sharding_group_size(comm_.size(), options.shard_group, comm_.rank()) : comm_.size();
  }

  /// The elements of the largest bucket the store will lay out (padded): the plan's.
  double largest_bucket(const Options& options) {
    detail::UnitMap units;
    if constexpr (stage == 3) units = detail::find_units(*model_);
    const BucketLayout probe(
        *model_,
        {.cap_bytes = options.bucket_cap_bytes, .first_cap_bytes = options.first_bucket_cap_bytes,
         .pad_to = stage > 0 ? sharding_ranks(options) : 1},
        [&](auto&, const at::Tensor& p) {
          const auto it = units.owner.find(p.unsafeGetTensorImpl());
          return it != units.owner.end() ? it->second : -1;
        },
        comm_.rank());
    double largest = 0;
    for (const auto& b : probe.buckets()) largest = std::max(largest, static_cast<double>(b.padded));
    return largest;
  }

  template <class Make, class Groups, class OptimOptions>
  DataParallel(Built, Make&& make, Comm comm, Groups&& groups, OptimOptions defaults, Options options)
      : comm_(std::move(comm)),
        model_((static_cast<void>(detail::tune_allocator()), make(comm_))),
        options_(options),
        device_(detail::device_of(*model_)) {
    if (options.build.device && *options.build.device != device_)
      throw error("DataParallel", comm_.rank(),
                  "DataParallelOptions::build.device is " + options.build.device->str() + " but the model is on " +
                      device_.str() +
                      "; it places a model the strategy builds (give a build function), and a model built already "
                      "must be there");
    detail::check_precision(options.precision, device_, "DataParallel", comm_.rank());
    if (const auto scaling = detail::loss_scaling(options.precision)) scaler_ = LossScaler(*scaling);
    detail::check_model_device(comm_, device_, "DataParallel");
    detail::check_same_model(*this, *model_, "DataParallel");  // Note [Same model]
    check_deterministic(options);
    // Replicas start from rank 0's values; what units built sharded hold, no rank has
    // whole: their ranks checked instead that they drew the same (Note [Sharded construction]).
    const auto sharded = detail::sharded_at_construction(*model_);
    std::vector<at::Tensor> whole;
    for (const auto& p : model_->parameters())
      if (!sharded.count(p.unsafeGetTensorImpl())) whole.push_back(p);
    // Note [Checking the plan]: before the strategy allocates anything of its own.
    if (options.prefetch < 0)
      throw error("DataParallel", comm_.rank(),
                  "DataParallelOptions::prefetch is " + std::to_string(options.prefetch) +
                      "; it is how many units ZeRO-3 gathers ahead, 0 or more");
    plan_ = detail::plan_of(*model_, sharding_ranks(options), largest_bucket(options), options.prefetch, defaults,
                            options.precision.autocast.has_value(), options.precision.reduce.has_value(),
                            options.memory.activation_bytes);
    if (options.memory.check) {
      double held = 0;  // what the model holds on this rank now: whole parameters, or shards
      for (const auto& p : whole) held += static_cast<double>(detail::bytes_of(p));
      held += detail::constructed_shard_bytes(*model_);
      detail::agree(*this, "DataParallel", detail::plan_problem(plan_, planned_stage(), held, options.memory));
    }
    detail::broadcast_coalesced(comm_, whole, 0);
    detail::broadcast_coalesced(comm_, model_->buffers(), 0);
    const StoreOptions store{
        .bucketing = {.cap_bytes = options.bucket_cap_bytes, .first_cap_bytes = options.first_bucket_cap_bytes},
        .shard_group = options.shard_group,
        .prefetch = options.prefetch,
        .gather = detail::gather_type(options.precision)};
    store_ = std::make_unique<Store>(*model_, comm_, store, groups(model_), std::move(defaults));
    grads_ = std::make_unique<Grads>(store_->layout(), comm_, options.find_unused_parameters,
                                     [s = store_.get()](std::size_t b) { s->on_gradients_complete(b); },
                                     options.precision.reduce, &store_->group(), store_->replicas());
  }

  /// Note [Deterministic training]: every rank checks alike, turns on LibTorch's
  /// deterministic algorithms, or every rank throws the first rank's reason.
  void check_deterministic(const Options& options) {
    std::string buffer;
    for (const auto& b : model_->named_buffers()) {
      buffer = b.key();
      break;
    }
    auto problem = detail::deterministic_problem<optimizer_type>(
        options.deterministic, comm_.size(), device_, buffer, options.precision.reduce.has_value(),
        sharding_communicator<Comm>);
    if (options.deterministic.on() && problem.empty()) {
      try {
        at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
      } catch (const std::exception& e) {
        problem = detail::message_of(e);
      }
    }
    if (options.deterministic.shards != 0) detail::agree(*this, "DataParallel", problem);
  }

  [[noreturn]] void refuse_in_deterministic_mode(const char* operation, const char* what) const {
    throw error(operation, comm_.rank(),
                std::string("deterministic mode computes one batch per step in its virtual shards; ") + what +
                    " would cut it otherwise: give step() each step's whole batch (Note [Deterministic training])");
  }

  /// Every rank's sample count and whether its batch is usable (`problem`), in one
  /// all-reduce of integers (exact in any order): the global batch's shard plan, known and
  /// checked alike on every rank, which all throw when one rank's samples do not fit it.
  deterministic::ShardPlan agree_on_shards(std::int64_t samples, const std::string& problem) {
    const int ranks = comm_.size(), me = comm_.rank();
    const auto shards = options_.deterministic.shards;
    auto counts = at::zeros({ranks + 1}, at::kDouble);
    counts[me] = static_cast<double>(samples);
    counts[ranks] = problem.empty() ? 0.0 : 1.0;
    detail::all_reduce_on(comm_, counts, device_, reduce_op::sum);
    const auto c = counts.cpu();
    if (c[ranks].item<double>() > 0) detail::raise_everywhere(*this, "DataParallel::step", problem);
    std::int64_t total = 0;
    for (int r = 0; r < ranks; ++r) total += static_cast<std::int64_t>(c[r].item<double>());
    const deterministic::ShardPlan plan(total, shards);
    std::string mismatch;
    for (int r = 0; r < ranks && mismatch.empty(); ++r) {
      const auto got = static_cast<std::int64_t>(c[r].item<double>()), want = plan.rank_samples(r, ranks);
      if (total < shards)
        mismatch = "a global batch of " + std::to_string(total) + " samples cannot fill " + std::to_string(shards) +
                   " virtual shards (DataParallelOptions::deterministic.shards): each needs at least one";
      else if (got != want)
        mismatch = "rank " + std::to_string(r) + " was given " + std::to_string(got) + " samples, but its shards of " +
                   "the global batch of " + std::to_string(total) + " hold " + std::to_string(want) +
                   " (shards " + std::to_string(r) + ", " + std::to_string(r + ranks) + ", ... of " +
                   std::to_string(shards) + "); feed the steps from data::DeterministicSampler";
    }
    if (!mismatch.empty()) throw error("DataParallel::step", me, mismatch);
    return plan;
  }

  /// Note [Deterministic training]: this rank's shards of the global batch, round by round,
  /// each gradient gathered and summed in shard order; then the step as always.
  template <class Loss>
  StepResult step_deterministic(const Batch& batch, Loss& loss, bool has_next) {
    const int ranks = comm_.size(), me = comm_.rank();
    const auto shards = options_.deterministic.shards;
    const auto plan = agree_on_shards(batch.size(), detail::batch_problem(batch));
    begin_step();
    double loss_sum = 0;
    std::int64_t offset = 0;
    for (std::int64_t round = 0; round < shards / ranks; ++round) {
      const auto k = round * ranks + me;
      const auto n = plan.size(k);
      grads_->prepare(/*sync=*/false);
      {
        const detail::ShardRandomness rng(device_, deterministic::shard_seed(options_.deterministic.seed, steps_, k));
        loss_sum += forward_backward(batch.narrow(offset, n), loss) * static_cast<double>(n);
      }
      offset += n;
      if constexpr (sharding_communicator<Comm>)
        grads_->add_round(/*first=*/round == 0, /*last=*/round + 1 == shards / ranks,
                          /*whole=*/options_.max_grad_norm > 0);
    }
    grads_->end_rounds();
    const auto local = batch.size();
    return end_step(local, local > 0 ? loss_sum / static_cast<double>(local) : 0.0, has_next, /*joined=*/false);
  }

  template <class Loss>
  StepResult step_agreed(const Batch& batch, Loss& loss, bool has_next) {
    begin_step();
    grads_->prepare(/*sync=*/true);
    auto problem = detail::batch_problem(batch);
    const bool usable = batch.size() > 0 && problem.empty();
    const double l = usable ? forward_backward(batch, loss) : 0.0;
    if (problem.empty()) problem = std::exchange(pending_problem_, {});  // from accumulate
    return end_step(usable ? batch.size() : 0, l, has_next, /*joined=*/!usable, problem);
  }

  void new_step() {
    pending_problem_.clear();
    grads_->zero_grad();
    store_->begin_step();
  }

  void begin_step() {
    if (!accumulating_) new_step();
    accumulating_ = false;
    if (options_.broadcast_buffers) detail::broadcast_coalesced(comm_, model_->buffers(), 0);
  }

  template <class Loss>
  double forward_backward(const Batch& host, Loss& loss) {
    static_assert(explain_model<Model>());
    model_->train();
    observe::PhaseTimer forward(timeline_, observe::Phase::forward);
    const Batch batch = host.to(device_);  // Note [One move per batch]
    at::Tensor l;
    {
      const detail::AutocastScope autocast(options_.precision.autocast, device_);  // Note [Mixed precision]
      l = detail::compute_loss<output_type>(loss, detail::forward(model_, batch.inputs), batch);
    }
    forward.stop();
    observe::PhaseTimer backward(timeline_, observe::Phase::backward);
    // Note [Exact averaging]: the gradient of the sum over this rank's samples; times the
    // loss scale (Note [Loss scaling]), which the buckets' division takes out again.
    (l * (static_cast<double>(batch.size()) * scaler_.scale())).backward();
    return l.item<double>();
  }

  /// `failure`: why this rank could not take part; every rank throws then, after the
  /// step's collectives (the failing rank joins them).
  StepResult end_step(std::int64_t samples, double loss, bool has_next, bool joined, const std::string& failure = {}) {
    const double local = std::exchange(pending_samples_, 0.0) + static_cast<double>(samples);
    // A step with no forward on this rank (join(), or step() with an empty batch) still
    // takes part in the others' unit gathers: Note [Joining at stage 3].
    if (local == 0) store_->replay_gathers(rank());
    observe::PhaseTimer sync(timeline_, observe::Phase::sync);
    const auto status = grads_->finish(local, has_next, joined, !failure.empty(), scaler_.scale());
    sync.stop();
    if (status.ranks_failed > 0) {
      if (!joined) store_->end_step();
      throw error("DataParallel::step", rank(),
                  !failure.empty() ? failure
                                   : std::to_string(status.ranks_failed) +
                                         " other rank(s) were given a batch they cannot use (see their message)");
    }
    if (!options_.join && status.ranks_with_next != 0 && status.ranks_with_next != world_size())
      throw error("DataParallel::step", rank(),
                  std::to_string(status.ranks_with_next) + " of " + std::to_string(world_size()) +
                      " ranks have another batch; give every rank the same number of batches (DistributedSampler "
                      "does), or keep DataParallelOptions::join on (the default)");
    ++steps_;
    double norm = 0;
    // Loss scaling checks every step: an overflow is how its scale learns it is too large.
    const bool clip = options_.max_grad_norm > 0,
               check = options_.nonfinite_gradients != NonFinite::apply || scaler_.active();
    typename Grads::Totals totals;
    if (status.samples > 0 && (clip || check)) totals = grads_->totals(clip, check, norm_elsewhere_);
    const bool finite = totals.nonfinite == 0;
    const bool skipped = !finite && (options_.nonfinite_gradients == NonFinite::skip || scaler_.active());
    if (status.samples > 0) scaler_.update(!finite);  // the same on every rank: `finite` is agreed
    if (status.samples > 0 && finite) {
      if (clip) norm = grads_->clip_grad_norm(options_.max_grad_norm, totals.squares);
      observe::PhaseTimer step(timeline_, observe::Phase::optimizer);
      store_->step(*grads_);
    }
    if (!joined) store_->end_step();
    if (!finite && !skipped) stop_on_nonfinite();
    return {loss, samples, status.samples, status.ranks_with_next, norm, /*has_loss=*/samples > 0, skipped};
  }

  // Note [Unusable batches]
  // A rank given a batch it cannot use (detail::batch_problem) must not simply throw: the
  // others would wait for it in the step's collectives. Below ZeRO stage 3 it joins the step
  // without the batch (accumulate() leaves it out and remembers it for the step), and the
  // step's status all-reduce (GradientBuckets::finish) tells every rank to throw. At stage 3
  // forward itself gathers units, which a rank without a forward can only repeat from its
  // last step, so there the ranks agree on their batches before the step: one scalar
  // all-reduce in every step(), and in join().

  /// Note [Unusable batches]: where forward gathers parameters (stage 3), throws on every
  /// rank when one has a `problem`.
  void agree_before_forward(const std::string& problem) {
    if constexpr (Store::gathers_in_forward) detail::agree(*this, "DataParallel::step", problem);
  }

  /// NonFinite::stop: the error every rank throws (all_finite's answer is global).
  [[noreturn]] void stop_on_nonfinite() {
    const auto name = grads_->first_nonfinite();
    throw error("DataParallel::step", rank(),
                "the averaged gradients of step " + std::to_string(steps_) + " (counted from 1) hold NaN or Inf" +
                    (name.empty() ? std::string(", in a part of the model another rank holds")
                                  : ", first in parameter '" + name + "'") +
                    "; stopped, as DataParallelOptions::nonfinite_gradients asks (NonFinite::skip skips such "
                    "steps instead)");
  }

  Comm comm_;  // before model_, which sharded construction builds with it
  Model model_;
  Options options_;
  LossScaler scaler_;  // Note [Loss scaling]: off unless Precision asks for it
  at::Device device_;  // the model's, where the communicator reduces (comm::Nccl: CUDA only)
  std::unique_ptr<Store> store_;  // before grads_, which points at its layout
  std::unique_ptr<Grads> grads_;  // its hooks point at it: a stable address
  bool accumulating_ = false;
  double pending_samples_ = 0;
  std::int64_t steps_ = 0;  // optimizer steps taken or skipped, for messages
  std::string pending_problem_;  // a batch accumulate() could not use: Note [Unusable batches]
  observe::StepTimeline* timeline_ = nullptr;
  std::function<void(at::Tensor&)> norm_elsewhere_;  // Note [Steps driven from outside]
  plan::Model plan_;  // Note [Checking the plan]
};

}  // namespace paratrain
