#pragma once
/// \file
/// paratrain::ReplicaSteps — the step protocol of a module's data-parallel replicas: its
/// parameter store, its gradient buckets and hook, the step agreement, clipping, the NaN
/// check and loss scaling. What DataParallel runs around its model's forward and backward,
/// and a Pipeline around its stages' (Note [Steps of replicas]).

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "paratrain/collectives/agree.hpp"
#include "paratrain/collectives/all_reduce_on.hpp"
#include "paratrain/collectives/coalesce.hpp"
#include "paratrain/collectives/model_device.hpp"
#include "paratrain/collectives/same_model.hpp"
#include "paratrain/comm/mesh.hpp"
#include "paratrain/concepts/checkpointable.hpp"
#include "paratrain/concepts/communicator.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/core/step_result.hpp"
#include "paratrain/core/timeline.hpp"
#include "paratrain/strategy/buckets/gradient_buckets.hpp"
#include "paratrain/strategy/buckets/gradient_hook.hpp"
#include "paratrain/strategy/buckets/hooks.hpp"
#include "paratrain/strategy/buckets/ordered_sum.hpp"
#include "paratrain/strategy/data_parallel_options.hpp"
#include "paratrain/strategy/deterministic.hpp"
#include "paratrain/strategy/loss_scale.hpp"
#include "paratrain/strategy/memory_check.hpp"
#include "paratrain/strategy/precision.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "paratrain/strategy/step_agreement.hpp"
#include "paratrain/strategy/stores/parameter_store.hpp"
#include "paratrain/strategy/stores/replicated_parameters.hpp"
#include "paratrain/strategy/stores/sharded_parameters.hpp"
#include "paratrain/tensor_parallel/sharding.hpp"

namespace paratrain {

// Note [Steps of replicas]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Whatever computes a step's forward and backward passes (DataParallel: the model, once or
// per micro-batch or per virtual shard; a Pipeline: its stages, in its schedule's order),
// what happens around them is the same, and is ReplicaSteps': begin_step() before the
// step's first forward, before_backward(last) before each backward pass over the module's
// parameters (`last` for the pass whose gradients complete the buckets: its backward
// overlaps their reduction), and end_step() with this rank's samples, which waits for the
// buckets, agrees on the step (Note [Step agreement]), averages exactly (Note [Exact
// averaging]), clips and checks over the ranks whose gradients together make the model's
// (the store's partition and a pipeline's stages: the mesh's groups), and steps the store.
// The module's replicas are the ranks of the mesh's replicas role; its parameters are cut
// along the pipeline dimension where there is one. Under expert parallelism the step is
// taken by the replicas and the expert dimension together (Dims::batch()): each bucket is
// summed over the ranks that hold its parameters, the experts' over their replicas and the
// dense parameters' over the expert group too (Note [Expert buckets]).

/// The parameter store an update policy asks for: Note [Parameter stores].
template <class Comm, class Update>
using store_for = std::conditional_t<(detail::zero_stage_of<Update> > 0),
                                     ShardedParameters<Comm, typename detail::optimizer_of<Update>::type,
                                                       detail::zero_stage_of<Update>>,
                                     ReplicatedParameters<Comm, typename detail::optimizer_of<Update>::type>>;

/// The step protocol of one module's replicas over the data dimensions of a mesh (Note
/// [Steps of replicas]): `Comm` is the communicator, `Update` an optimizer or a Sharded one.
template <class Comm, class Update>
class ReplicaSteps {
 public:
  using Store = store_for<Comm, Update>;
  static_assert(parameter_store<Store, Comm>);
  using optimizer_type = typename Store::optimizer_type;
  using Storage = typename Store::gradient_storage;
  using Grads = GradientBuckets<Comm, Storage>;
  using Options = DataParallelOptions;

  /// Collective over the mesh: every rank makes its replica together. `module` is this
  /// rank's model (or stages), on `device`; `groups` its optimizer's parameter groups.
  template <class OptimOptions>
  ReplicaSteps(Mesh<Comm> mesh, torch::nn::Module& module, const at::Device& device, ParamGroups groups,
               OptimOptions defaults, const Options& options, const char* owner)
      : mesh_(std::move(mesh)),
        module_(&module),
        data_(&mesh_.group(Dims::batch())),
        replicas_(&mesh_.group(Dims::replicas())),
        options_(options),
        device_(device) {
    if (options.build.device && *options.build.device != device_)
      throw error(owner, rank(),
                  "DataParallelOptions::build.device is " + options.build.device->str() + " but the model is on " +
                      device_.str() +
                      "; it places a model the strategy builds (give a build function), and a model built already "
                      "must be there");
    detail::check_precision(options.precision, device_, owner, rank());
    if (const auto scaling = detail::loss_scaling(options.precision)) scaler_ = LossScaler(*scaling);
    detail::check_model_device(*data_, device_, owner);
    auto data = on_device();
    detail::check_same_model(data, module, owner);  // Note [Same model]
    check_deterministic(options, owner);
    // Replicas start from rank 0's values; what units built sharded hold, no rank has
    // whole: their ranks checked instead that they drew the same (Note [Sharded construction]).
    // Experts start from their replicas' first rank's: the expert group's ranks hold others.
    const auto sharded = detail::sharded_at_construction(module);
    const auto sliced = tp::sliced_parameters_of(module);
    std::set<const void*> experts;
    for (const auto& [name, shard] : sliced)
      if (shard.over == Dim::expert) {
        experts.insert(shard.impl);
        if (shard.degree != mesh_.size(Dim::expert))
          throw error(owner, rank(),
                      "the model's parameter '" + name + "' is cut over an expert group of " +
                          std::to_string(shard.degree) + " ranks, and this strategy's expert dimension has " +
                          std::to_string(mesh_.size(Dim::expert)) +
                          " (the mesh " + mesh_.shape().str() +
                          "); build its moe::MixtureOfExperts layers inside the strategy (they join "
                          "tp::expert_group()), with DataParallelOptions::expert_parallel the degree");
      }
    std::vector<at::Tensor> whole, whole_experts;
    for (const auto& p : module.parameters())
      if (!sharded.count(p.unsafeGetTensorImpl()))
        (experts.count(p.unsafeGetTensorImpl()) ? whole_experts : whole).push_back(p);
    // Note [Checking the plan]: before the strategy allocates anything of its own.
    if (options.prefetch < 0)
      throw error(owner, rank(),
                  "DataParallelOptions::prefetch is " + std::to_string(options.prefetch) +
                      "; it is how many units ZeRO-3 gathers ahead, 0 or more");
    const auto store_options = store_options_of(options);
    plan_ = Store::plan(module, mesh_, store_options, defaults,
                        {.autocast = options.precision.autocast.has_value(),
                         .narrow_reduce = options.precision.reduce.has_value(),
                         .activation_bytes = options.memory.activation_bytes});
    if (options.memory.check) {
      double held = 0;  // what the model holds on this rank now: whole parameters, or shards
      for (const auto& p : whole) held += static_cast<double>(detail::bytes_of(p));
      for (const auto& p : whole_experts) held += static_cast<double>(detail::bytes_of(p));
      held += detail::constructed_shard_bytes(module);
      detail::agree(data, owner, detail::plan_problem(plan_, Store::planned_stage, held, options.memory));
    }
    detail::broadcast_coalesced(*data_, whole, 0);
    detail::broadcast_coalesced(*replicas_, whole_experts, 0);
    detail::broadcast_coalesced(*data_, module.buffers(), 0);
    store_ = std::make_unique<Store>(module, mesh_, store_options, groups, std::move(defaults));
    std::vector<SumRanks<Comm>> sums;
    for (std::size_t b = 0; b < store_->layout().buckets().size(); ++b) sums.push_back(store_->gradient_ranks(b));
    grads_ = std::make_unique<Grads>(store_->layout(), store_->gradients(), std::move(sums), default_hook(),
                                     [s = store_.get()](std::size_t b) { s->on_gradients_complete(b); });
    // The ranks whose parts make up the model's gradients (the store's partition, the
    // pipeline's stages): split now, while every rank constructs, for clipping and NaN checks.
    if (const Dims parts = store_->partitions() | Dim::pipeline | Dim::tensor | Dim::expert; mesh_.size(parts) > 1)
      parts_ = &mesh_.group(parts);
    count_once_over_slice_groups(sliced);
    if (mesh_.size(Dim::expert) > 1) experts_ = &mesh_.group(Dim::expert);
  }

  ReplicaSteps(const ReplicaSteps&) = delete;
  ReplicaSteps& operator=(const ReplicaSteps&) = delete;

  /// The store's options as DataParallelOptions spell them.
  [[nodiscard]] static StoreOptions store_options_of(const Options& options) {
    return {.bucketing = {.cap_bytes = options.bucket_cap_bytes, .first_cap_bytes = options.first_bucket_cap_bytes},
            .shard_group = options.shard_group,
            .prefetch = options.prefetch,
            .gather = detail::gather_type(options.precision),
            .build = options.build};
  }

  // ---- the step (Note [Steps of replicas]) ----------------------------------------
  /// A new step's gradients start (gradient accumulation: only before its first micro-batch).
  void new_step() {
    pending_problem_.clear();
    loss_unit_ = 0;
    grads_->set_input_factor(1.0);
    grads_->zero_grad();
    store_->begin_step();
  }
  /// Before the step's first forward: a new step unless accumulating; rank 0's buffers.
  void begin_step() {
    if (!accumulating_) new_step();
    accumulating_ = false;
    if (options_.broadcast_buffers) detail::broadcast_coalesced(*data_, module_->buffers(), 0);
  }
  /// Gradients accumulate into the next step: begin_step() will not start a new one.
  void accumulate(std::int64_t samples) {
    if (!accumulating_) new_step();
    accumulating_ = true;
    pending_samples_ += static_cast<double>(samples);
  }
  /// A batch accumulate() could not use: the next end_step() fails on every rank.
  void fail_later(std::string problem) {
    if (pending_problem_.empty()) pending_problem_ = std::move(problem);
  }
  /// What a backward pass over `samples` of this rank's samples multiplies their mean loss
  /// by: `samples` (Note [Exact averaging]), and under loss scaling the scale over this
  /// step's loss unit (Note [Loss scaling]), which the buckets multiply back before they are
  /// summed. Before the pass, also for what a layer adds in backward (BackwardScale).
  [[nodiscard]] double backward_factor(std::int64_t samples) {
    const auto n = static_cast<double>(samples);
    if (!scaler_.active()) return n;
    // Deterministic mode: each shard's pass is a round of its own, launched alone, so each
    // takes its own unit (a shard's computation must not depend on which rank runs it). An
    // expert group: its ranks' token gradients meet inside backward, and their batches may
    // differ, so the unit is 1 there (the samples' sum scaled: Note [Loss scaling]).
    if (loss_unit_ == 0 || options_.deterministic.on()) {
      loss_unit_ = experts_ != nullptr ? 1.0 : detail::loss_unit(samples);
      grads_->set_input_factor(loss_unit_);
    }
    return n * scaler_.scale() / loss_unit_;
  }

  /// Before each backward pass over the module's parameters: `last` for the pass whose
  /// gradients complete the buckets (they are summed as they fill), else they accumulate.
  void before_backward(bool last) { grads_->prepare(/*sync=*/last); }

  /// After the step's backward passes: `samples` were this rank's, `loss` their mean;
  /// `joined` when it ran none; `failure`: why this rank could not take part (every rank
  /// throws then, after the step's collectives, which the failing rank joins).
  StepResult end_step(std::int64_t samples, double loss, bool has_next, bool joined, std::string failure = {}) {
    if (failure.empty()) failure = std::exchange(pending_problem_, {});
    const double local = std::exchange(pending_samples_, 0.0) + static_cast<double>(samples);
    // A step with no forward on this rank (join(), or step() with an empty batch) still
    // takes part in the others' unit gathers: Note [Joining at stage 3].
    if (local == 0) store_->replay_gathers(rank());
    PhaseTimer sync(timeline_, Phase::sync);
    const auto start = std::chrono::steady_clock::now();
    grads_->flush();
    const auto& layout = store_->layout();
    const auto agreement = agree_on_step(
        *data_, device_, layout.params().size(),
        {.samples = local, .has_next = has_next, .joined = joined, .failed = !failure.empty(),
         .find_unused_parameters = options_.find_unused_parameters},
        [&](std::size_t i) { return grads_->used(i); }, [&](std::size_t i) { return layout.params()[i].name; });
    exposed_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    sync.stop();
    const auto status = agreement.status();
    if (status.ranks_failed > 0) {
      if (!joined) store_->end_step();
      throw error("DataParallel::step", rank(),
                  !failure.empty() ? failure
                                   : std::to_string(status.ranks_failed) +
                                         " other rank(s) were given a batch they cannot use (see their message)");
    }
    if (status.samples > 0) {
      grads_->settle([&](std::size_t i) { return agreement.used_anywhere(i); });
      grads_->divide(status.samples * scaler_.scale());
      if (ordered_ != nullptr) ordered_->divide(status.samples * scaler_.scale());
    }
    if (!options_.join && status.ranks_with_next != 0 && status.ranks_with_next != data_->size())
      throw error("DataParallel::step", rank(),
                  std::to_string(status.ranks_with_next) + " of " + std::to_string(data_->size()) +
                      " ranks have another batch; give every rank the same number of batches (DistributedSampler "
                      "does), or keep DataParallelOptions::join on (the default)");
    ++steps_;
    double norm = 0;
    // Loss scaling checks every step: an overflow is how its scale learns it is too large.
    const bool clip = options_.max_grad_norm > 0,
               check = options_.nonfinite_gradients != NonFinite::apply || scaler_.active();
    std::pair<double, double> totals{0, 0};  // squares, non-finite elements
    if (status.samples > 0 && (clip || check)) totals = totals_of(clip, check);
    const bool finite = totals.second == 0;
    const bool skipped = !finite && (options_.nonfinite_gradients == NonFinite::skip || scaler_.active());
    if (status.samples > 0) scaler_.update(!finite);  // the same on every rank: `finite` is agreed
    if (status.samples > 0 && finite) {
      if (clip) {
        norm = std::sqrt(totals.first);
        grads_->scale(std::min(options_.max_grad_norm / (norm + 1e-6), 1.0));  // as clip_grad_norm_
      }
      PhaseTimer step(timeline_, Phase::optimizer);
      // Until the update and what follows it (ZeRO's gathers of the new shards) are done,
      // this rank's state is neither the last step's nor this one's: Note [A snapshot of the survivors].
      updating_ = true;
      store_->step(*grads_);
    }
    if (!joined) store_->end_step();
    updating_ = false;
    if (!finite && !skipped) stop_on_nonfinite();
    // The context ranks of a replica counted its samples once each (Note [Process mesh]):
    // the gradients are averaged over them, the samples are the replica's once.
    const double global = status.samples / static_cast<double>(mesh_.size(Dim::context));
    return {loss, samples, global, status.ranks_with_next, norm, /*has_loss=*/samples > 0, skipped};
  }

  // ---- deterministic mode (Note [Deterministic training]) ------------------------
  /// The ordered sum, in deterministic mode; null otherwise.
  [[nodiscard]] OrderedSum<Comm>* ordered() noexcept { return ordered_; }
  /// Every gradient of the buckets zero again between two rounds of one step.
  void clear_gradients() { grads_->clear(); }
  /// After a round's backward: waits for its sums.
  void end_round() { grads_->flush(); }

  // ---- hooks (Note [Gradient hooks]) -----------------------------------------------
  /// What each complete bucket does from the next step on (before the first step, or
  /// between steps). Deterministic mode and Precision::reduce are hooks of their own.
  template <gradient_hook<Comm> H>
  void register_gradient_hook(H hook) {
    if constexpr (requires { H::whole_gradients_only; }) {
      static_assert(!H::whole_gradients_only || std::is_same_v<Storage, WholeGradients>,
                    "paratrain: this gradient hook sums whole buckets, and this strategy keeps a shard of each "
                    "(ZeRO stages 2 and 3): use it with DDP or zero::stage1");
    }
    if (options_.deterministic.on())
      throw error("DataParallel::register_gradient_hook", rank(),
                  "deterministic mode sums gradients with a hook of its own (the ordered sum: Note "
                  "[Deterministic training]); a strategy in that mode takes no other");
    if (options_.precision.reduce)
      throw error("DataParallel::register_gradient_hook", rank(),
                  "Precision::reduce is a gradient hook already (NarrowGradients around the exact sum); leave it unset "
                  "and register NarrowGradients(type, your hook) to narrow yours");
    grads_->set_hook(AnyGradientHook<Comm>(std::move(hook)));
  }

  // ---- what the strategies report ------------------------------------------------
  [[nodiscard]] Mesh<Comm>& mesh() noexcept { return mesh_; }
  [[nodiscard]] int rank() const { return mesh_.rank(); }
  [[nodiscard]] const Options& options() const noexcept { return options_; }
  [[nodiscard]] optimizer_type& optimizer() noexcept { return store_->optimizer(); }
  [[nodiscard]] Store& store() noexcept { return *store_; }
  [[nodiscard]] LossScaler& loss_scaler() noexcept { return scaler_; }
  [[nodiscard]] const LossScaler& loss_scaler() const noexcept { return scaler_; }
  [[nodiscard]] std::int64_t step_count() const noexcept { return steps_; }
  /// False while a step's update is under way, and after one failed part-way (a lost peer):
  /// this rank's state is then no step's.
  [[nodiscard]] bool settled() const noexcept { return !updating_; }
  void set_step_count(std::int64_t steps) noexcept { steps_ = steps; }
  [[nodiscard]] std::size_t bucket_count() const noexcept { return grads_->bucket_count(); }
  [[nodiscard]] std::vector<std::string> bucket_names(std::size_t i) const { return store_->layout().names(i); }
  [[nodiscard]] double exposed_communication_seconds() const noexcept {
    return exposed_seconds_ + store_->exposed_seconds();
  }
  /// This step's gradient bytes handed to collectives (the buckets': Note [Expert buckets]).
  [[nodiscard]] std::int64_t gradient_bytes_sent() const noexcept { return grads_->sent_bytes(); }
  [[nodiscard]] ModelStateBytes model_state_bytes() const {
    ModelStateBytes out = store_->bytes();
    out.gradients = grads_->bytes();
    return out;
  }
  [[nodiscard]] const plan::Model& memory_plan() const noexcept { return plan_; }
  [[nodiscard]] plan::Peak planned_peak() const { return plan::peak(store_->planned(plan_), Store::planned_stage); }

  /// Every parameter of the module, whole, as a copy (module parameters() order).
  /// Collective: at ZeRO stage 3 the parameters are gathered for it.
  std::vector<at::Tensor> full_parameters() {
    std::vector<at::Tensor> out;
    store_->with_gathered([&] {
      for (const auto& p : module_->parameters()) out.push_back(p.detach().clone());
    });
    return out;
  }
  /// Copies rank 0's buffers to every replica, when broadcast_buffers is on. Collective.
  void synchronize() {
    if (options_.broadcast_buffers) detail::broadcast_coalesced(*data_, module_->buffers(), 0);
  }
  /// Where this rank keeps the module's and optimizer's state, each slice a replica writes
  /// named by its world rank.
  [[nodiscard]] CheckpointLayout checkpoint_layout() const {
    auto layout = store_->checkpoint_layout(*module_);
    const auto world_writer = [&](TensorSlice& sl) {
      if (sl.writer >= 0) sl.writer = mesh_.world_rank(Dims::batch(), sl.writer);
    };
    for (auto& sl : layout.model) world_writer(sl);
    for (auto& sl : layout.optimized) world_writer(sl);
    if (mesh_.size(Dim::tensor) > 1 || mesh_.size(Dim::expert) > 1) place_slices(layout);
    return layout;
  }

  // Note [Tensor-parallel checkpoints]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // A parameter cut over the tensor group (or, a mixture's experts, over the expert group) is
  // saved as the box of the whole tensor this rank holds (TensorSlice::box_offset, box_shape),
  // the store's range (a ZeRO shard) counted in it: its runs of the whole are the chunks, so a
  // checkpoint holds whole tensors whatever the degree, and a load at another degree (or none)
  // reads its own box's runs. A box every replica holds whole is written by one of them, in
  // turn (the same choice on every rank: every rank lists the tensors in the same order), and
  // it leaves the byte balance of the replicated tensors alone, so every rank still picks their
  // writers alike. The ranks of the tensor and expert dimensions a tensor is not cut over hold
  // the same box: those at coordinate 0 of those dimensions write it. ZeRO's pieces of it are
  // cut over the expert dimension too (Dims::sharding()), so each expert rank writes its own,
  // and only the tensor dimension's ranks at coordinate 0 write a tensor it does not cut.
  void place_slices(CheckpointLayout& layout) const {
    const auto shards = tp::sliced_parameters_of(*module_);
    const int replicas = mesh_.size(Dims::replicas()), me = mesh_.index(Dims::replicas());
    const auto first_of = [&](Dims alike) {
      for (const auto d : {Dim::tensor, Dim::expert})
        if (alike.contains(d) && mesh_.index(d) != 0) return false;
      return true;
    };
    int turn = 0;
    const auto place = [&](TensorSlice& sl) {
      const auto it = shards.find(sl.name);
      if (it == shards.end()) {
        // Replicated over the tensor group: ZeRO's pieces of it are the same on every rank of
        // it (and differ over the expert group, which they are cut over too).
        if (!sl.replicated) sl.saved = sl.saved && first_of(Dims(Dim::tensor));
        return;
      }
      const auto& cut = it->second.slice;
      const Dims alike = it->second.over == Dim::tensor ? Dims(Dim::expert) : Dims(Dim::tensor);
      const auto d = static_cast<std::size_t>(cut.dim);
      sl.box_shape = sl.shape;
      sl.box_offset.assign(sl.shape.size(), 0);
      sl.box_offset[d] = cut.offset;
      sl.shape[d] = cut.whole;
      if (sl.replicated) {
        sl.replicated = false;
        sl.writer = -1;
        sl.saved = turn++ % replicas == me && first_of(alike);
      } else {
        sl.saved = sl.saved && first_of(alike & Dims(Dim::tensor));  // pieces: cut over the expert group
      }
    };
    for (auto& sl : layout.model) place(sl);
    for (auto& sl : layout.optimized) place(sl);
  }

  /// Reports the step's synchronisation and optimizer phases and each bucket's reduction
  /// into `timeline`; null: nothing. Note [Zero-cost timeline].
  void set_timeline(StepTimeline* timeline) noexcept {
    timeline_ = timeline;
    grads_->set_timeline(timeline);
  }

  // Note [Unusable batches]
  // A rank given a batch it cannot use (detail::batch_problem) must not simply throw: the
  // others would wait for it in the step's collectives. Below ZeRO stage 3 it joins the step
  // without the batch (accumulate() leaves it out and remembers it for the step), and the
  // step's agreement (Note [Step agreement]) tells every rank to throw. At stage 3 forward
  // itself gathers units, which a rank without a forward can only repeat from its last
  // step, so there the ranks agree on their batches before the step: one scalar all-reduce
  // in every step(), and in join(). Under expert parallelism forward exchanges tokens with
  // the expert group, whose every rank must take part: the ranks agree alike, and a rank
  // with no samples (join(), an empty batch) is a problem of its own. Under context
  // parallelism attention exchanges positions over the context group in every forward: the
  // ranks agree alike, and a context group whose ranks have different batches is a problem.
  // accumulate() agrees before each of its forwards where forward communicates; at stage 3
  // an empty micro-batch is a problem there, as the rank has no forward in which to take part
  // in the others' gathers (end_step's replay serves a whole step without samples only).

  /// Whether forward communicates: ZeRO-3's gathers, an expert or a context group's exchanges.
  [[nodiscard]] bool communicates_in_forward() const noexcept {
    return Store::gathers_in_forward || experts_ != nullptr || mesh_.size(Dim::context) > 1;
  }
  /// Note [Unusable batches]: where forward communicates, throws on every rank when one has
  /// a `problem`, as `operation`.
  void agree_before_forward(const std::string& problem, const char* operation = "DataParallel::step") {
    if (communicates_in_forward()) {
      auto data = on_device();
      detail::agree(data, operation, problem);
    }
  }
  /// Whether forward gathers parameters (Note [Unusable batches]).
  static constexpr bool gathers_in_forward = Store::gathers_in_forward;
  /// Whether forward exchanges tokens with an expert group (Note [Unusable batches]).
  [[nodiscard]] bool exchanges_in_forward() const noexcept { return experts_ != nullptr; }

  /// The data-parallel ranks, reducing on the model's device: what the strategies' own
  /// agreements (deterministic mode's sample counts) run over.
  [[nodiscard]] detail::ReducingOn<Comm> on_device() { return {*data_, device_}; }

 private:
  AnyGradientHook<Comm> default_hook() {
    if (options_.deterministic.on()) {
      if constexpr (sharding_communicator<Comm>) {
        // Over a communicator no layer uses: Note [Gradient communicators].
        AnyGradientHook<Comm> hook{OrderedSum<Comm>(mesh_.gradient_group(Dims::batch()))};
        ordered_ = hook.template target<OrderedSum<Comm>>();
        return hook;
      }
    }
    if (options_.precision.reduce) return NarrowGradients<SumGradients>(*options_.precision.reduce);
    return SumGradients{};
  }

  // The squares and non-finite elements of every gradient, over the ranks whose parts make
  // up the model's: this rank's, where it holds them all; else summed over the store's
  // partition and the pipeline's stages in one all-reduce. Deterministic mode's from the
  // whole sums every rank holds, in one order (Note [Deterministic training]).
  std::pair<double, double> totals_of(bool squares, bool nonfinite) {
    if (ordered_ != nullptr)
      if (auto t = ordered_->totals(squares, nonfinite)) return *t;
    auto total = grads_->local_totals(squares, nonfinite, counted_.empty() ? nullptr : &counted_);
    if (parts_ != nullptr) detail::all_reduce_on(*parts_, total, device_, reduce_op::sum);
    const auto t = total.cpu();
    return {t[0].template item<double>(), t[1].template item<double>()};
  }

  // Note [Norms over a tensor group]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // The global norm clipping uses is the norm of the model's gradient as one device would
  // hold it. A parameter cut over the tensor group holds a different slice on each of its
  // ranks: each slice counts, summed over the group. A parameter replicated over it (a layer
  // norm, a row-parallel bias, a plain layer) holds the same gradient on every rank: it
  // counts on the group's first rank only, or it would count t times. The expert group
  // alike: each rank's experts count, the dense parameters (summed over it by then) on its
  // first rank only, unless the store cuts their sums over it (ZeRO-2/3: Note [Expert
  // buckets]). The sum then runs over the store's partition, the pipeline's stages and the
  // tensor and expert groups together.
  void count_once_over_slice_groups(const std::map<std::string, tp::ModelShard>& sliced) {
    std::map<const void*, Dim> over;
    for (const auto& [name, shard] : sliced) over.emplace(shard.impl, shard.over);
    const auto& params = store_->layout().params();
    std::vector<char> counted(params.size(), 1);
    bool any = false;
    for (std::size_t i = 0; i < params.size(); ++i) {
      const auto it = over.find(params[i].tensor.unsafeGetTensorImpl());
      for (const auto d : {Dim::tensor, Dim::expert})
        if (mesh_.index(d) != 0 && (it == over.end() || it->second != d) && !store_->partitions().contains(d))
          counted[i] = 0;
      any = any || counted[i] == 0;
    }
    if (any) counted_ = std::move(counted);
  }

  /// Note [Deterministic training]: every rank checks alike, turns on LibTorch's
  /// deterministic algorithms, or every rank throws the first rank's reason.
  void check_deterministic(const Options& options, const char* owner) {
    std::string buffer;
    for (const auto& b : module_->named_buffers()) {
      buffer = b.key();
      break;
    }
    auto problem = detail::deterministic_problem<optimizer_type>(options.deterministic, data_->size(), device_, buffer,
                                                                 options.precision.reduce.has_value(),
                                                                 sharding_communicator<Comm>);
    if (problem.empty() && options.deterministic.on() && mesh_.size(Dim::tensor) > 1)
      problem = "deterministic mode does not take tensor parallelism (a tensor degree of " +
                std::to_string(mesh_.size(Dim::tensor)) +
                "): its order of addition is fixed for whole gradients, and the tensor group's all-reduces and "
                "reduce-scatters sum the activations' parts in an order of their own; train at tensor degree 1 "
                "or without deterministic mode";
    if (problem.empty() && options.deterministic.on() && mesh_.size(Dim::expert) > 1)
      problem = "deterministic mode does not take expert parallelism (an expert degree of " +
                std::to_string(mesh_.size(Dim::expert)) +
                "): its virtual shards deal each sample to one rank, and an expert group's all-to-alls send every "
                "rank's tokens to every other; train at expert degree 1 or without deterministic mode";
    if (options.deterministic.on() && problem.empty()) {
      try {
        at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
      } catch (const std::exception& e) {
        problem = detail::message_of(e);
      }
    }
    if (options.deterministic.shards != 0) {
      auto data = on_device();
      detail::agree(data, owner, problem);
    }
  }

  /// NonFinite::stop: the error every rank throws (the check's answer is global).
  [[noreturn]] void stop_on_nonfinite() {
    const auto name = grads_->first_nonfinite();
    throw error("DataParallel::step", rank(),
                "the averaged gradients of step " + std::to_string(steps_) + " (counted from 1) hold NaN or Inf" +
                    (name.empty() ? std::string(", in a part of the model another rank holds")
                                  : ", first in parameter '" + name + "'") +
                    "; stopped, as DataParallelOptions::nonfinite_gradients asks (NonFinite::skip skips such "
                    "steps instead)");
  }

  Mesh<Comm> mesh_;
  torch::nn::Module* module_;
  Comm* data_;      // the mesh's batch group: the ranks that take each step together
  Comm* replicas_;  // the mesh's replicas group: the ranks that hold every parameter alike
  Comm* parts_ = nullptr;    // the ranks whose gradients make up the model's, where more than this one
  Comm* experts_ = nullptr;  // the expert group, where more than this one: Note [Experts over a group]
  std::vector<char> counted_;  // per layout parameter, whether its squares count here: Note [Norms over a tensor group]
  Options options_;
  at::Device device_;  // the module's, where the communicator reduces (comm::Nccl: CUDA only)
  LossScaler scaler_;  // Note [Loss scaling]: off unless Precision asks for it
  plan::Model plan_;   // Note [Checking the plan]
  std::unique_ptr<Store> store_;  // before grads_, which points at its layout
  std::unique_ptr<Grads> grads_;  // its hooks point at it: a stable address
  OrderedSum<Comm>* ordered_ = nullptr;  // deterministic mode's hook, inside grads_
  bool accumulating_ = false;
  double loss_unit_ = 0;  // this step's, once its first backward_factor() set it: Note [Loss scaling]
  double pending_samples_ = 0;
  std::string pending_problem_;  // a batch accumulate() could not use: Note [Unusable batches]
  std::int64_t steps_ = 0;       // optimizer steps taken or skipped, for messages and shard seeds
  bool updating_ = false;        // between an update's start and its step's end: settled()
  double exposed_seconds_ = 0;
  StepTimeline* timeline_ = nullptr;
};

}  // namespace paratrain
