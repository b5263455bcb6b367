#pragma once
/// \file
/// paratrain::DataParallel — distributed data parallelism (PyTorch's DDP) for LibTorch.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/sgd.h>

#include <concepts>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>

#include "paratrain/collectives/agree.hpp"
#include "paratrain/collectives/all_reduce_on.hpp"
#include "paratrain/comm/mesh.hpp"
#include "paratrain/comm/single_device.hpp"
#include "paratrain/concepts/checkpointable.hpp"
#include "paratrain/concepts/communicator.hpp"
#include "paratrain/concepts/module.hpp"
#include "paratrain/concepts/optimizer.hpp"
#include "paratrain/concepts/strategy.hpp"
#include "paratrain/core/backward_scale.hpp"
#include "paratrain/core/batch.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/core/timeline.hpp"
#include "paratrain/experts/mixture_of_experts.hpp"
#include "paratrain/strategy/data_parallel_options.hpp"
#include "paratrain/strategy/deterministic.hpp"
#include "paratrain/memory/allocator.hpp"
#include "paratrain/strategy/precision.hpp"
#include "paratrain/strategy/replica_steps.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "paratrain/tensor_parallel/context.hpp"
#include "paratrain/tensor_parallel/group.hpp"
#include "paratrain/util/fnv1a.hpp"

namespace paratrain {

namespace detail {
/// `options` with the shard group the update's type names (Sharded<Optim, Stage, G>: hybrid
/// sharding as a type); an error where the options name another.
template <class Update>
DataParallelOptions typed_options(DataParallelOptions options, int rank) {
  constexpr int G = shard_group_of<Update>;
  if constexpr (G != 0) {
    if (options.shard_group != 0 && options.shard_group != G)
      throw error("DataParallel", rank,
                  "DataParallelOptions::shard_group is " + std::to_string(options.shard_group) +
                      " but the update's type, Sharded<..., " + std::to_string(G) + ">, shards over groups of " +
                      std::to_string(G) + "; name the group once");
    options.shard_group = G;
  }
  return options;
}
}  // namespace detail

/// Data parallelism across the ranks of `Comm`: every rank holds a replica of `Model`,
/// trains it on its own samples, and gradients are averaged so that the replicas stay
/// identical and equal to single-device training on all ranks' samples together
/// (Note [Exact averaging]).
///
/// - `DataParallel<Net, comm::Mpi, torch::optim::Adam>` is DDP across processes (mpirun, srun, ...);
/// - `DataParallel<Net, comm::Nccl, torch::optim::Adam>` is DDP across GPUs;
/// - `DataParallel<Net, comm::SingleDevice, torch::optim::Adam>` is plain single-device training;
/// - `DataParallel<Net, comm::Mpi, Sharded<torch::optim::Adam, zero::stage3>>` is ZeRO-3.
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
template <class Model, class Comm = comm::SingleDevice, class Update = update_not_named>
class DataParallel {
  static_assert(explain_module<Model>());  // its forward: explain_model where it is called
  static_assert(explain_communicator<Comm>());
  static_assert(async_communicator<Comm>,
                "paratrain: DataParallel overlaps communication with backward and needs a communicator with "
                "`iall_reduce(at::Tensor&, reduce_op)` returning a request; see docs/communicators.md");
  static_assert(explain_update<Update, Comm>());
  using Steps = ReplicaSteps<Comm, Update>;  // Note [Steps of replicas]

 public:
  using model_type = Model;
  /// What the model's forward returns: a tensor, or a tuple of them (a batch_loss reads it).
  using output_type = detail::model_output_t<Model>;
  using communicator_type = Comm;
  using update_type = Update;
  using optimizer_type = typename Steps::optimizer_type;
  using Options = DataParallelOptions;
  /// 0 for DDP, else the ZeRO stage.
  static constexpr int stage = detail::zero_stage_of<Update>;

  /// Collective: every rank of `comm` constructs its replica together.
  template <class OptimOptions>
    requires optimizer_from<optimizer_type, OptimOptions>
  DataParallel(Model model, Comm comm, OptimOptions optimizer_options, Options options = {})
      : DataParallel(Built{}, as_builder(model), mesh_of(std::move(comm), options), all_parameters,
                     std::move(optimizer_options), options) {}

  /// With parameter groups of different options (weight decay on weights only, say):
  /// every parameter that requires a gradient in exactly one group; `defaults` for the
  /// groups that have no options of their own. Collective.
  template <class OptimOptions>
    requires optimizer_from<optimizer_type, OptimOptions>
  DataParallel(Model model, Comm comm, ParamGroups groups, OptimOptions defaults, Options options = {})
      : DataParallel(Built{}, as_builder(model), mesh_of(std::move(comm), options),
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
      : DataParallel(Built{}, constructed(build), mesh_of(std::move(comm), options), all_parameters,
                     std::move(optimizer_options), options) {}

  /// Builds the model as above, then asks `groups(model)` for its parameter groups. Collective.
  template <model_builder<Model> Build, std::invocable<Model&> Groups, class OptimOptions>
    requires std::same_as<std::invoke_result_t<Groups&, Model&>, ParamGroups> &&
             optimizer_from<optimizer_type, OptimOptions>
  DataParallel(Build build, Comm comm, Groups groups, OptimOptions defaults, Options options = {})
      : DataParallel(Built{}, constructed(build), mesh_of(std::move(comm), options), groups,
                     std::move(defaults), options) {}

  /// Over a mesh of your own (Note [Process mesh]): its data dimensions are the replicas
  /// (ZeRO shards over its data-shard ranks and replicates across the data-replicate ones);
  /// every other dimension must have one rank. Collective.
  template <class OptimOptions>
    requires optimizer_from<optimizer_type, OptimOptions>
  DataParallel(Model model, Mesh<Comm> mesh, OptimOptions optimizer_options, Options options = {})
      : DataParallel(Built{}, as_builder(model), checked(std::move(mesh), options), all_parameters,
                     std::move(optimizer_options), options) {}

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

  /// The model default-constructed by the strategy, over a default-constructed
  /// communicator: `Strategy s(torch::optim::AdamOptions(1e-3));` is the same line under
  /// every strategy alias (comm::Mpi, Gloo and Nccl made from the launcher's environment).
  /// Built as by a build function (above): at ZeRO stage 3 sharded as it is built, and
  /// placed on the communicator's device (the local rank's GPU under comm::Nccl). Collective.
  template <class OptimOptions>
    requires optimizer_from<optimizer_type, OptimOptions> && std::default_initializable<Comm> &&
             std::default_initializable<Model>
  explicit DataParallel(OptimOptions optimizer_options, Options options = {})
      : DataParallel([] { return Model(); }, Comm{}, std::move(optimizer_options), options) {}

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
    if (deterministic()) {
      if (micro_batches.size() != 1) refuse_in_deterministic_mode("DataParallel::step", "micro-batches");
      return step(micro_batches.front(), loss, has_next);
    }
    const auto problem = forward_problem(micro_batches);
    steps_->agree_before_forward(problem);
    if (!problem.empty()) {  // joins, then every rank throws
      steps_->begin_step();
      steps_->before_backward(/*last=*/true);
      return steps_->end_step(0, 0.0, has_next, /*joined=*/true, problem);
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
    if (deterministic()) return step_deterministic(batch, loss, has_next);
    steps_->agree_before_forward(forward_problem(std::span<const Batch>(&batch, 1)));
    return step_agreed(batch, loss, has_next);
  }

  /// Forward and backward over `batch` without communicating: gradients accumulate
  /// until the next `step`, which then averages over all their samples. Returns the mean loss.
  /// A batch it cannot use is left out and makes that next step an error on every rank.
  /// Where forward communicates (ZeRO stage 3's gathers, an expert or context group's
  /// exchanges) the ranks agree on each micro-batch before its forward instead, and such a
  /// batch on any rank throws here on every rank (Note [Unusable batches]). At ZeRO stage 3
  /// an empty micro-batch is such a batch: the rank would have no forward in which to take
  /// part in the others' gathers (step() and join() take part without samples).
  template <loss_for<output_type> Loss>
  double accumulate(const Batch& batch, Loss&& loss) {
    if (deterministic()) refuse_in_deterministic_mode("DataParallel::accumulate", "accumulate()");
    if (steps_->communicates_in_forward()) {
      auto problem = forward_problem(std::span<const Batch>(&batch, 1));
      if (problem.empty() && Steps::gathers_in_forward && batch.size() == 0)
        problem =
            "an empty micro-batch: under ZeRO stage 3 accumulate() gathers each unit in forward with the other "
            "ranks, and a rank without samples has no forward to take part in; give every rank samples in every "
            "micro-batch, or this rank's samples in fewer micro-batches (step() and join() take part without any)";
      steps_->agree_before_forward(problem, "DataParallel::accumulate");
    }
    steps_->accumulate(0);  // a new step, unless accumulating already
    if (auto problem = detail::batch_problem(batch); !problem.empty()) {  // only where forward does not communicate
      steps_->fail_later(std::move(problem));
      return 0.0;
    }
    steps_->accumulate(batch.size());
    steps_->before_backward(/*last=*/false);
    if (batch.size() == 0) return 0.0;
    return forward_backward(batch, loss);
  }

  /// For a rank that has no batch this step while others do: takes part in their
  /// collectives with no samples, and applies the same update, so replicas stay equal.
  StepResult join(bool has_next = false) {
    if (deterministic()) {  // every shard has samples: a rank without any is an error everywhere
      static_cast<void>(agree_on_shards(0, {}));
      throw error("DataParallel::join", rank(), "deterministic mode gives every rank samples in every step");
    }
    steps_->agree_before_forward(forward_problem({}));
    steps_->begin_step();
    steps_->before_backward(/*last=*/true);
    return steps_->end_step(0, 0.0, has_next, /*joined=*/true);
  }

  /// What each complete bucket of gradients does from the next step on, instead of the
  /// exact sum (Note [Gradient hooks]): a compression such as `paratrain::PowerSgd` or
  /// `paratrain::NarrowGradients(at::kHalf)`, or a hook of your own. Between steps.
  template <gradient_hook<Comm> H>
  void register_gradient_hook(H hook) {
    steps_->register_gradient_hook(std::move(hook));
  }

  /// The model's output for the batch's inputs, in evaluation mode and without gradients
  /// (under autocast with Precision::autocast, as training's forward: then often bf16).
  output_type predict(const Batch& batch) {
    static_assert(explain_model<Model>());
    const detail::AutocastScope autocast(options().precision.autocast, device_);
    return detail::predict(model_, Batch(batch.inputs, at::Tensor()).to(device_).inputs);  // Note [One move per batch]
  }
  /// The output of a one-input model for `input`, in evaluation mode and without gradients.
  output_type predict(const at::Tensor& input) { return predict(Batch{input, at::Tensor()}); }

  /// Every parameter of the model, whole, as a copy (model()->parameters() order).
  /// Collective: at ZeRO stage 3 the parameters are gathered for it, so every rank calls it.
  std::vector<at::Tensor> full_parameters() { return steps_->full_parameters(); }

  /// Reduces `t` in place over the ranks (for metrics), on the model's device, where
  /// the communicator works (comm::Nccl reduces CUDA tensors only).
  void all_reduce(at::Tensor& t, reduce_op op) { detail::all_reduce_on(mesh_.world(), t, device_, op); }

  /// Makes every replica evaluate alike: copies rank 0's buffers (batch-norm running
  /// statistics, ...) to every rank, when broadcast_buffers is on. Collective.
  void synchronize() { steps_->synchronize(); }

  [[nodiscard]] int rank() const { return mesh_.rank(); }
  [[nodiscard]] int world_size() const { return mesh_.size(Dims::all()); }
  /// Which replica's samples this rank trains on: its place among the data ranks.
  [[nodiscard]] DataShard data_shard() const { return mesh_.data_shard(); }
  /// The rank layout: every group this strategy communicates over is one of its groups.
  [[nodiscard]] Mesh<Comm>& mesh() noexcept { return mesh_; }
  /// The ranks the model's tensor-parallel layers cut their matrices over (one rank
  /// without tensor parallelism): what tp::CrossEntropy reduces over.
  [[nodiscard]] const tp::Group& tensor_group() const noexcept { return tensor_group_; }
  /// The group the model's sequences are cut over (DataParallelOptions::context_parallel):
  /// what its attention ran over, with its traffic.
  [[nodiscard]] const tp::Group& context_group() const noexcept { return context_group_; }
  /// The group the model's experts are cut over (DataParallelOptions::expert_parallel): what
  /// its moe::MixtureOfExperts layers route tokens over, with its traffic.
  [[nodiscard]] const tp::Group& expert_group() const noexcept { return expert_group_; }
  [[nodiscard]] Model& model() noexcept { return model_; }
  /// Where the model's parameters are, as they were at construction: batches move there
  /// (Note [One move per batch]), and the communicator reduces there.
  [[nodiscard]] at::Device device() const noexcept { return device_; }
  /// The optimizer; when sharded, the one over this rank's pieces (Note [Optimizer on
  /// pieces]), with the same parameter groups as given, so schedules work alike.
  [[nodiscard]] optimizer_type& optimizer() noexcept { return steps_->optimizer(); }
  [[nodiscard]] Comm& communicator() noexcept { return mesh_.world(); }
  [[nodiscard]] const Options& options() const noexcept { return steps_->options(); }
  [[nodiscard]] std::size_t bucket_count() const noexcept { return steps_->bucket_count(); }
  /// The parameter names of bucket `i`, in the order they are laid out.
  [[nodiscard]] std::vector<std::string> bucket_names(std::size_t i) const { return steps_->bucket_names(i); }
  /// Seconds the last step blocked on communication that compute did not hide: the wait
  /// for the gradients after backward, and (ZeRO) the parameter gathers it waited for.
  [[nodiscard]] double exposed_communication_seconds() const noexcept {
    return steps_->exposed_communication_seconds();
  }
  /// Bytes of gradients this rank handed to the last step's collectives: what the
  /// gradient hook sent (the padded buckets, in the type they are summed in: half of fp32's
  /// with Precision::reduce = at::kBFloat16). paratrain::plan::gradient_traffic predicts
  /// the exact sum's.
  [[nodiscard]] std::int64_t gradient_bytes_sent() const noexcept { return steps_->gradient_bytes_sent(); }
  /// Bytes this rank holds for parameters, gradients and optimizer state between steps:
  /// what paratrain::plan predicts (docs/sharding.md).
  [[nodiscard]] ModelStateBytes model_state_bytes() const { return steps_->model_state_bytes(); }
  /// The memory plan of this model, stage and world size (sizes read off the model at
  /// construction): `plan::peak(s.memory_plan(), stage)` is what a rank should hold at most
  /// (Note [Peak memory model]); planned_peak() is that figure for this strategy as it runs.
  [[nodiscard]] const plan::Model& memory_plan() const noexcept { return steps_->memory_plan(); }
  [[nodiscard]] plan::Peak planned_peak() const { return steps_->planned_peak(); }
  /// This strategy's stage in paratrain::plan's terms.
  [[nodiscard]] static constexpr plan::stage planned_stage() noexcept { return Steps::Store::planned_stage; }
  /// Where this rank keeps the model's and optimizer's state (paratrain::checkpointable):
  /// DDP holds everything whole; ZeRO's optimizer steps pieces of the parameters, and
  /// at stage 3 the unit parameters at rest are this rank's pieces too.
  [[nodiscard]] CheckpointLayout checkpoint_layout() { return steps_->checkpoint_layout(); }
  /// Dynamic loss scaling's state (Note [Loss scaling]): inactive, at scale 1, unless
  /// Precision::loss_scale or fp16 autocast asks for it. fit keeps it in its checkpoints.
  [[nodiscard]] LossScaler& loss_scaler() noexcept { return steps_->loss_scaler(); }
  [[nodiscard]] const LossScaler& loss_scaler() const noexcept { return steps_->loss_scaler(); }
  /// After a checkpoint was loaded into checkpoint_layout()'s slices: nothing derives
  /// from them here (every rank loaded its own). Collective, by the concept.
  void loaded() noexcept {}
  /// The optimizer steps taken (or skipped) so far; deterministic mode keys each shard's
  /// random draws on it (shard_seed). checkpoint::load sets it to the
  /// checkpoint's step, so that a resumed run draws what the uninterrupted one drew.
  [[nodiscard]] std::int64_t step_count() const noexcept { return steps_->step_count(); }
  void set_step_count(std::int64_t steps) noexcept { steps_->set_step_count(steps); }
  /// Whether this rank's state is that of some step: false while an update is under way, and
  /// after a step failed part-way through one (a lost peer): Note [A snapshot of the survivors].
  [[nodiscard]] bool settled() const noexcept { return steps_->settled(); }

  /// Reports each step's phases and each bucket's all-reduce into `timeline` (fit's
  /// trace does this); null, the default, times nothing. Note [Zero-cost timeline].
  void set_timeline(StepTimeline* timeline) noexcept {
    timeline_ = timeline;
    steps_->set_timeline(timeline);
  }

 private:
  struct Built {};  // the tag of the constructor every public one delegates to
  static ParamGroups all_parameters(Model& model) { return {torch::optim::OptimizerParamGroup(model->parameters())}; }

  static Options typed(const Options& options, int rank) { return detail::typed_options<Update>(options, rank); }

  /// The mesh DataParallelOptions spell over `comm` (Note [Process mesh]).
  static Mesh<Comm> mesh_of(Comm comm, const Options& options) {
    const int ranks = comm.size(), me = comm.rank();
    const auto o = typed(options, me);
    return Mesh<Comm>(std::move(comm),
                      options_mesh(o.shard_group, o.tensor_parallel, o.context_parallel, o.expert_parallel, ranks, me));
  }
  /// A mesh of the user's: data, context, expert and tensor dimensions only, shard_group
  /// unset or its data-shard size, tensor_parallel, context_parallel and expert_parallel 1
  /// or their dimensions' sizes.
  static Mesh<Comm> checked(Mesh<Comm> mesh, const Options& given) {
    const Options options = typed(given, mesh.rank());
    if (mesh.size(~(Dims::batch() | Dim::tensor)) != 1)
      throw error("DataParallel", mesh.rank(),
                  "the mesh " + mesh.shape().str() +
                      " has dimensions besides the data, context, expert and tensor ones; DataParallel trains one "
                      "model on data-parallel ranks, its sequences cut over the context ones, its experts over the "
                      "expert ones and its layers over the tensor ones (a pipeline: DataParallel<Pipeline<...>>)");
    // A degree option is 1 (the mesh says it) or the mesh's size of its dimension.
    const auto degree = [&](const char* option, int given_degree, Dim d, const char* ranks) {
      if (given_degree != 1 && given_degree != mesh.size(d))
        throw error("DataParallel", mesh.rank(),
                    std::string("DataParallelOptions::") + option + " is " + std::to_string(given_degree) +
                        " but the mesh " + mesh.shape().str() + " has " + std::to_string(mesh.size(d)) + " " + ranks +
                        " ranks; leave " + option + " 1 where the mesh says it");
    };
    degree("expert_parallel", options.expert_parallel, Dim::expert, "expert");
    degree("context_parallel", options.context_parallel, Dim::context, "context");
    degree("tensor_parallel", options.tensor_parallel, Dim::tensor, "tensor");
    if (options.shard_group != 0 && options.shard_group != mesh.size(Dim::shard))
      throw error("DataParallel", mesh.rank(),
                  "DataParallelOptions::shard_group is " + std::to_string(options.shard_group) + " but the mesh " +
                      mesh.shape().str() + " shards over " + std::to_string(mesh.size(Dim::shard)) +
                      " ranks; leave shard_group 0 where the mesh says it");
    return mesh;
  }

  /// The model given, as what the store would build: on the CPU where the communicator
  /// works on a GPU (comm::Nccl), moved there first, as a build function's model is placed
  /// (a model on another GPU is refused, naming both devices: check_model_device).
  static auto as_builder(Model& model) {
    return [&model](Mesh<Comm>& mesh, const tp::Context&, const Options&) {
      const auto target = detail::communicator_device(mesh.world());
      if (target.is_cuda() && detail::device_of(*model).is_cpu()) model->to(target);
      return std::move(model);
    };
  }
  /// `build()`, as the store builds it (Note [Sharded construction]).
  template <class Build>
  static auto constructed(Build& build) {
    return [&build](Mesh<Comm>& mesh, const tp::Context& groups, const Options& options) -> Model {
      // Note [Building a tensor-parallel model]: the layers join the mesh's tensor group, the
      // model's attention its context group, its mixtures of experts its expert group.
      tp::Context context = groups;
      context.sequence_parallel = options.sequence_parallel;
      const tp::Construction scope(std::move(context));
      return Steps::Store::construct(build, mesh, Steps::store_options_of(options));
    };
  }

  template <class Make, class Groups, class OptimOptions>
  DataParallel(Built, Make&& make, Mesh<Comm> mesh, Groups&& groups, OptimOptions defaults, const Options& options)
      : mesh_(std::move(mesh)),
        tensor_group_(mesh_),
        context_group_(mesh_, Dim::context),
        expert_group_(mesh_, Dim::expert),
        model_((static_cast<void>(memory::install()), refuse_deterministic_context(options),
                make(mesh_, tp::Context{.group = tensor_group_, .context = context_group_, .expert = expert_group_},
                     typed(options, mesh_.rank())))),
        device_(detail::device_of(*model_)),
        steps_(std::make_unique<Steps>(mesh_, *model_, device_, groups(model_), std::move(defaults),
                                       typed(options, mesh_.rank()), "DataParallel")) {}

  // Note [Unusable batches]: under expert parallelism every rank of an expert group routes
  // tokens in every forward, the same number of forwards a step; a rank without samples, or
  // with another number of micro-batches than the rest of its group, cannot take part. Under
  // context parallelism the ranks of a context group hold the positions of the same samples
  // and attend over each other's in every forward: they have the same micro-batches, of the
  // same sizes and shapes (compared by a hash, as a pipeline replica's:
  // check_same_micro_batches, detail::mix_micro_batch), or
  // none alike (a data shard out of samples joins whole). The counts are compared (one
  // all-reduce over each such group) only where there is one, and whatever this rank found:
  // a context group with a problem still meets an expert group that spans others.

  /// The first micro-batch the step cannot use (detail::batch_problem), else what keeps this
  /// rank from the forwards its context and expert groups run together; empty where nothing
  /// does. Collective over each such group.
  [[nodiscard]] std::string forward_problem(std::span<const Batch> micro_batches) {
    std::string problem;  // first: Batch::size() itself throws on a scalar input
    for (std::size_t i = 0; i < micro_batches.size() && problem.empty(); ++i)
      problem = detail::batch_problem(micro_batches[i]);
    const bool context = mesh_.size(Dim::context) > 1, experts = steps_->exchanges_in_forward();
    if (!context && !experts) return problem;
    const auto n = static_cast<std::int64_t>(micro_batches.size());
    std::int64_t samples = 0;
    bool an_empty_one = false;
    detail::Fnv1a sizes;
    if (problem.empty())
      for (const auto& b : micro_batches) {
        samples += b.size();
        an_empty_one = an_empty_one || b.size() == 0;
        detail::mix_micro_batch(sizes, b, /*shapes=*/context);
      }
    if (context) {
      const auto hash = sizes.value62();
      auto counts = at::tensor(std::vector<std::int64_t>{n, -n, hash, -hash}, at::kLong);
      detail::all_reduce_on(mesh_.group(Dim::context), counts, device_, reduce_op::max);
      const auto* v = counts.data_ptr<std::int64_t>();
      if (problem.empty() && (v[0] != -v[1] || v[2] != -v[3]))
        problem = "the ranks of a context group have different micro-batches this step (" +
                  (v[0] != -v[1] ? "from " + std::to_string(-v[1]) + " to " + std::to_string(v[0]) + " of them"
                                 : std::string("as many, of different sizes or shapes")) +
                  "; this rank " + std::to_string(n) + ", " + std::to_string(samples) +
                  " samples); they hold the positions of the same samples, and attention exchanges them in every "
                  "forward: give the ranks of a context group the same batches (DataParallel::data_shard() names "
                  "their shard)";
    }
    if (!experts) return problem;
    auto counts = at::tensor(std::vector<std::int64_t>{n, -n}, at::kLong);
    detail::all_reduce_on(mesh_.group(Dim::expert), counts, device_, reduce_op::max);
    const auto most = counts[0].item<std::int64_t>(), least = -counts[1].item<std::int64_t>();
    if (!problem.empty()) return problem;
    if (least == 0 || samples == 0)
      return std::string(samples == 0 ? "this rank has" : "a rank of this rank's expert group has") +
             " no samples this step, and under expert parallelism every rank of an expert group routes tokens to the "
             "others' experts in every forward: give every rank samples in every step (a DistributedSampler with "
             "drop_last, or fit, does)";
    if (most != least)
      return "the ranks of an expert group have from " + std::to_string(least) + " to " + std::to_string(most) +
             " micro-batches this step (this rank " + std::to_string(n) +
             "); under expert parallelism each forward exchanges tokens with the whole group: give its ranks the "
             "same number";
    if (an_empty_one)
      return "an empty micro-batch: under expert parallelism every forward routes tokens over the expert group";
    return {};
  }

  // Deterministic mode cuts each global batch into virtual shards over the data ranks; the
  // context ranks' shares of a sample's positions are not among them yet.
  void refuse_deterministic_context(const Options& options) const {
    if (mesh_.size(Dim::context) > 1 && options.deterministic.on())
      throw error("DataParallel", mesh_.rank(),
                  "deterministic mode does not cut sequences over a context group yet (the mesh " +
                      mesh_.shape().str() + "): train with context_parallel 1 or without deterministic mode");
  }

  [[nodiscard]] bool deterministic() const noexcept { return steps_->options().deterministic.on(); }

  [[noreturn]] void refuse_in_deterministic_mode(const char* operation, const char* what) const {
    throw error(operation, rank(),
                std::string("deterministic mode computes one batch per step in its virtual shards; ") + what +
                    " would cut it otherwise: give step() each step's whole batch (Note [Deterministic training])");
  }

  /// Note [Deterministic training]: every rank's sample count, agreed and checked against
  /// the shard plan, or every rank throws.
  ShardPlan agree_on_shards(std::int64_t samples, const std::string& problem) {
    auto data = steps_->on_device();
    return detail::agree_on_shards(data, samples, problem, options().deterministic.shards);
  }

  /// Note [Deterministic training]: this rank's shards of the global batch, round by round,
  /// each round's gradients gathered as its buckets complete and summed in shard order;
  /// then the step as always.
  template <class Loss>
  StepResult step_deterministic(const Batch& batch, Loss& loss, bool has_next) {
    const auto data = mesh_.data_shard();
    const auto shards = options().deterministic.shards, rounds = shards / data.count;
    const auto plan = agree_on_shards(batch.size(), detail::batch_problem(batch));
    steps_->begin_step();
    double loss_sum = 0;
    std::int64_t offset = 0;
    for (std::int64_t round = 0; round < rounds; ++round) {
      const auto k = round * data.count + data.index;
      const auto n = plan.size(k);
      if (round > 0) steps_->clear_gradients();
      steps_->ordered()->begin_round(/*first=*/round == 0, /*last=*/round + 1 == rounds,
                                     /*keep_whole=*/options().max_grad_norm > 0);
      steps_->before_backward(/*last=*/true);
      {
        const detail::ShardRandomness rng(device_, shard_seed(options().deterministic.seed, steps_->step_count(), k));
        loss_sum += forward_backward(batch.narrow(offset, n), loss) * static_cast<double>(n);
      }
      offset += n;
      if (round + 1 < rounds) steps_->end_round();
    }
    const auto local = batch.size();
    return steps_->end_step(local, local > 0 ? loss_sum / static_cast<double>(local) : 0.0, has_next,
                            /*joined=*/false);
  }

  template <class Loss>
  StepResult step_agreed(const Batch& batch, Loss& loss, bool has_next) {
    steps_->begin_step();
    steps_->before_backward(/*last=*/true);
    auto problem = detail::batch_problem(batch);
    const bool usable = batch.size() > 0 && problem.empty();
    const double l = usable ? forward_backward(batch, loss) : 0.0;
    return steps_->end_step(usable ? batch.size() : 0, l, has_next, /*joined=*/!usable, problem);
  }

  template <class Loss>
  double forward_backward(const Batch& host, Loss& loss) {
    static_assert(explain_model<Model>());
    model_->train();
    PhaseTimer forward(timeline_, Phase::forward);
    const Batch batch = host.to(device_);  // Note [One move per batch]
    // Note [Exact averaging]: the gradient of the sum over this rank's samples; times the
    // loss scale over the step's unit (Note [Loss scaling]), which the buckets take out
    // again. A layer that adds a loss of its own in backward scales it alike (BackwardScale).
    const double scale = steps_->backward_factor(batch.size());
    const BackwardScale backward_scale(scale);
    at::Tensor l;
    {
      const detail::AutocastScope autocast(options().precision.autocast, device_);  // Note [Mixed precision]
      l = detail::compute_loss<output_type>(loss, detail::forward(model_, batch.inputs), batch);
    }
    forward.stop();
    PhaseTimer backward(timeline_, Phase::backward);
    (l * scale).backward();
    return l.item<double>();
  }

  Mesh<Comm> mesh_;  // before model_, which sharded construction builds with it
  tp::Group tensor_group_;  // the one its layers joined: they share its traffic counters
  tp::Group context_group_;  // the one its attention runs over (Context::context)
  tp::Group expert_group_;   // the one its mixtures of experts cut their experts over (Context::expert)
  Model model_;
  at::Device device_;  // the model's, where the communicator reduces (comm::Nccl: CUDA only)
  std::unique_ptr<Steps> steps_;
  StepTimeline* timeline_ = nullptr;
};

/// DataParallel without its third argument: a compile-time error that names the choice.
template <class Model, class Comm>
class DataParallel<Model, Comm, update_not_named> {
  static_assert(sizeof(Model) == 0,
                "paratrain: name the update as DataParallel's third argument: an optimizer "
                "(DataParallel<Net, Comm, torch::optim::Adam>, torch::optim::SGD, ...) or a sharded one "
                "(Sharded<torch::optim::Adam, zero::stage2>); DataParallel<Net> no longer means SGD");
};

}  // namespace paratrain
