#pragma once
/// \file
/// DataParallel<Pipeline<Stage...>, Comm, Update> — pipeline parallelism, and its
/// composition with data parallelism and ZeRO: the stages on consecutive ranks, the
/// pipelines replicated over the rest.

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <cstdio>
#include <tuple>
#include <utility>
#include <vector>

#include "paratrain/concepts/checkpointable.hpp"
#include "paratrain/concepts/communicator.hpp"
#include "paratrain/concepts/strategy.hpp"
#include "paratrain/collectives/model_device.hpp"
#include "paratrain/core/backward_scale.hpp"
#include "paratrain/core/batch.hpp"
#include "paratrain/util/fnv1a.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/core/timeline.hpp"
#include "paratrain/pipeline/link.hpp"
#include "paratrain/pipeline/micro_batches.hpp"
#include "paratrain/pipeline/options.hpp"
#include "paratrain/pipeline/schedule.hpp"
#include "paratrain/pipeline/schedule_check.hpp"
#include "paratrain/pipeline/split_backward.hpp"
#include "paratrain/pipeline/stages.hpp"
#include "paratrain/comm/mesh.hpp"
#include "paratrain/strategy/buckets/gradient_hook.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/strategy/replica_steps.hpp"

namespace paratrain {

/// Pipeline parallelism: `DataParallel<Pipeline<Embed, Blocks, Head>, comm::Mpi, Optimizer>`.
/// Each rank builds and trains only its stages, running the schedule's actions (forward,
/// backward, or backward split into input and weight halves) on the step's micro-batches;
/// the last stage computes the loss. Gradients equal single-device training on the whole
/// step's batch. With more ranks than pipeline ranks the pipeline is replicated (Note
/// [Pipeline layout]); `Update` may be `Sharded<Optimizer, zero::stageN>`.
template <class... Stage, class Comm, class Update>
class DataParallel<Pipeline<Stage...>, Comm, Update> {
  static_assert(explain_communicator<Comm>());
  static_assert(point_to_point_communicator<Comm> &&
                    requires(Comm& c, const at::Tensor& t) { c.isend(t, 0, 0); } &&
                    requires(const Comm& c) { { c.split(0, 0) } -> std::same_as<Comm>; },
                "paratrain: a Pipeline passes activations between ranks and needs a communicator with `send`, "
                "`recv`, `isend` (returning a request) and `Comm split(int color, int key) const`; comm::Mpi and "
                "comm::Gloo have them");
  static_assert(explain_update<Update, Comm>());
  using Steps = ReplicaSteps<Comm, Update>;  // Note [Steps of replicas]
  static constexpr int S = static_cast<int>(sizeof...(Stage));

 public:
  using model_type = Pipeline<Stage...>;
  /// What the last stage returns: a tensor, or a tuple of them (a batch_loss reads it).
  using output_type = detail::model_output_t<std::tuple_element_t<sizeof...(Stage) - 1, std::tuple<Stage...>>>;
  using communicator_type = Comm;
  using update_type = Update;
  using optimizer_type = typename Steps::optimizer_type;
  using Options = PipelineOptions;
  /// 0 for DDP, else the ZeRO stage.
  static constexpr int stage = detail::zero_stage_of<Update>;

  /// Collective: every rank of `comm` constructs it together, each building its stages.
  template <class OptimOptions>
    requires optimizer_from<optimizer_type, OptimOptions>
  DataParallel(Pipeline<Stage...> stages, Comm comm, OptimOptions optimizer_options, Options options = {})
      : mesh_(mesh_of(std::move(comm), options)),
        options_(typed(options, mesh_.rank())),
        K_(mesh_.size(Dim::pipeline)),
        replicas_(mesh_.size(Dims::data())),
        p_(mesh_.index(Dim::pipeline)),
        replica_(mesh_.index(Dims::data())),
        pipe_(mesh_.group(Dim::pipeline)) {
    group_ = std::make_shared<detail::StageGroupImpl>();
    tensor_group_ = tp::Group(mesh_);
    context_group_ = tp::Group(mesh_, Dim::context);
    expert_group_ = tp::Group(mesh_, Dim::expert);
    const auto build_stages = [&] {
      // Note [Building a tensor-parallel model]: the stages' layers join the tensor group,
      // their attention the context group, their mixtures of experts the expert group.
      const tp::Construction tensor_group({.group = tensor_group_,
                                           .sequence_parallel = options_.data_parallel.sequence_parallel,
                                           .context = context_group_,
                                           .expert = expert_group_});
      build(stages, std::index_sequence_for<Stage...>{});
      return group_;
    };
    // Each stage's replicas shard it as it is built where the store does: Note [Sharded construction].
    if (options.sharded_construction)
      Steps::Store::construct(build_stages, mesh_, Steps::store_options_of(options_.data_parallel));
    else
      build_stages();
    if (const auto params = group_->parameters(); !params.empty()) device_ = params.front().device();
    detail::check_model_device(mesh_.world(), device_, "Pipeline");  // every stage's rank, before any link
    steps_ = std::make_unique<Steps>(mesh_, *group_, device_,
                                     ParamGroups{torch::optim::OptimizerParamGroup(group_->parameters())},
                                     std::move(optimizer_options), options_.data_parallel, "DataParallel");
    // Two groups where sends are unbuffered: Note [One group per direction].
    if constexpr (pipeline::detail::unbuffered_sends<Comm>()) pipe_back_ = std::make_unique<Comm>(pipe_.split(0, p_));
    link_ = std::make_unique<pipeline::detail::Link<Comm>>(pipe_, pipe_back_ ? *pipe_back_ : pipe_, device_);
  }
  /// Each stage default-constructed on the rank that owns it, over a default-constructed
  /// communicator: `Strategy s(torch::optim::AdamOptions(1e-3));`, the same line as for
  /// every other strategy alias. Collective.
  template <class OptimOptions>
    requires optimizer_from<optimizer_type, OptimOptions> && std::default_initializable<Comm> &&
             std::default_initializable<Pipeline<Stage...>>
  explicit DataParallel(OptimOptions optimizer_options, Options options = {})
      : DataParallel(Pipeline<Stage...>(), Comm{}, std::move(optimizer_options), options) {}

  /// With a default-constructed communicator (comm::Mpi: the world).
  template <class OptimOptions>
    requires optimizer_from<optimizer_type, OptimOptions> && std::default_initializable<Comm>
  DataParallel(Pipeline<Stage...> stages, OptimOptions optimizer_options, Options options = {})
      : DataParallel(std::move(stages), Comm{}, std::move(optimizer_options), options) {}

  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  /// One optimizer step over this replica's micro-batches, pipelined by the schedule;
  /// every stage of one replica is given the same micro-batches.
  template <loss_for<output_type> Loss>
  StepResult step(std::span<const Batch> micro_batches, Loss&& loss, bool has_next = true) {
    check_same_micro_batches(micro_batches);
    if (micro_batches.empty()) return join_checked(has_next);
    steps_->begin_step();
    Run run{micro_batches};
    run_schedule(schedule_for(static_cast<int>(micro_batches.size())), run, loss);
    std::int64_t samples = 0;
    for (const auto& b : micro_batches) samples += b.size();
    if (samples == 0) steps_->before_backward(/*last=*/true);  // no backward ran: nothing is pending
    auto r = steps_->end_step(samples, 0.0, has_next, /*joined=*/samples == 0);
    r.has_loss = r.has_loss && owns(S - 1);  // the loss is the last stage's
    if (r.has_loss) r.loss = run.loss_sum.template item<double>() / static_cast<double>(samples);
    return r;
  }

  /// For a replica without micro-batches this step while others have some.
  StepResult join(bool has_next = false) {
    check_same_micro_batches({});
    return join_checked(has_next);
  }

  /// The model's output, through the stages: the last stage's rank has it, the others
  /// return an undefined tensor. Collective over the ranks of one replica, and over the
  /// stage's replicas at ZeRO stage 3 (which gather parameters): an empty batch, too,
  /// runs through the stages.
  output_type predict(const Batch& batch) {
    detail::EvalMode eval(*group_);
    output_type out;
    for (int s = p_; s < S; s += K_) {
      auto in = s == 0 ? detail::to_device(batch.inputs, device_)
                       : receive(pipeline::detail::Message::evaluation, s, 0).first;
      Tensors y;
      {
        const detail::AutocastScope autocast(options_.data_parallel.precision.autocast, device_);
        y = forward(s, std::move(in));
      }
      if (s == S - 1) out = detail::output_of<output_type>(std::move(y));
      else deliver(pipeline::detail::Message::evaluation, s + 1, 0, y, std::vector<bool>(y.size(), false));
    }
    link_->flush();
    return out;
  }

  /// Reduces `t` over every rank of the world (for metrics).
  void all_reduce(at::Tensor& t, reduce_op op) { detail::all_reduce_on(mesh_.world(), t, device_, op); }
  /// Makes every replica of each stage evaluate alike (buffers). Collective.
  void synchronize() { steps_->synchronize(); }

  [[nodiscard]] int rank() const { return mesh_.rank(); }
  [[nodiscard]] int world_size() const { return mesh_.size(Dims::all()); }
  /// The replica this rank's pipeline is: every stage of it sees the same samples.
  [[nodiscard]] DataShard data_shard() const { return mesh_.data_shard(); }
  /// The rank layout: the pipeline dimension and the data dimensions of the stages' replicas.
  [[nodiscard]] Mesh<Comm>& mesh() noexcept { return mesh_; }
  /// Where this rank's stages live: the first stage's inputs and the last stage's targets
  /// move there (Note [One move per batch]), received activations arrive there.
  [[nodiscard]] at::Device device() const noexcept { return device_; }
  /// This rank's place: pipeline rank (0 .. K-1), pipeline ranks K, replica, replicas.
  [[nodiscard]] int pipeline_rank() const noexcept { return p_; }
  [[nodiscard]] int pipeline_size() const noexcept { return K_; }
  [[nodiscard]] int replica() const noexcept { return replica_; }
  [[nodiscard]] int replicas() const noexcept { return replicas_; }
  /// Whether this rank owns stage `s`.
  [[nodiscard]] bool owns(int s) const noexcept { return s % K_ == p_; }
  /// This rank's stages, as one module whose submodules carry the stages' names.
  [[nodiscard]] const detail::StageGroup& stages() const noexcept { return group_; }
  /// Stage I, on the rank that owns it (a null handle elsewhere).
  template <std::size_t I>
  [[nodiscard]] auto& stage_at() noexcept {
    return std::get<I>(stages_);
  }
  [[nodiscard]] optimizer_type& optimizer() noexcept { return steps_->optimizer(); }
  /// This rank's stages' parameters, whole, as copies (stages() order). Collective over
  /// the stage's replicas: at ZeRO stage 3 they are gathered for it.
  [[nodiscard]] std::vector<at::Tensor> full_parameters() { return steps_->full_parameters(); }
  /// The ranks this rank's stages cut their tensor-parallel layers over (one rank without
  /// tensor parallelism): what tp::CrossEntropy reduces over in the last stage.
  [[nodiscard]] const tp::Group& tensor_group() const noexcept { return tensor_group_; }
  /// The group the stages' sequences are cut over (data_parallel.context_parallel): the last
  /// stage's loss cuts the targets over it alike (cp::shard).
  [[nodiscard]] const tp::Group& context_group() const noexcept { return context_group_; }
  /// The group the stages' mixtures of experts cut their experts over
  /// (data_parallel.expert_parallel), with its traffic.
  [[nodiscard]] const tp::Group& expert_group() const noexcept { return expert_group_; }
  /// Dynamic loss scaling's state, the same on every stage (Note [Loss scaling]).
  [[nodiscard]] LossScaler& loss_scaler() noexcept { return steps_->loss_scaler(); }
  [[nodiscard]] const LossScaler& loss_scaler() const noexcept { return steps_->loss_scaler(); }
  /// What each complete bucket of a stage's gradients does (Note [Gradient hooks]).
  template <gradient_hook<Comm> H>
  void register_gradient_hook(H hook) {
    steps_->register_gradient_hook(std::move(hook));
  }
  [[nodiscard]] const Options& options() const noexcept { return options_; }
  [[nodiscard]] const PipelineStepStats& last_step_stats() const noexcept { return stats_; }
  /// The schedule run for `micro_batches` micro-batches (checked before it is first run).
  /// Interleaved 1F1B needs M to be a multiple of K; a step with another M (fit's last
  /// of an epoch) runs the stages chunk by chunk, GPipe-fashion, with the same result, and
  /// rank 0 says so in one line, once per such M (no silent downgrade).
  [[nodiscard]] const pipeline::Schedule& schedule_for(int micro_batches) {
    auto it = schedules_.find(micro_batches);
    if (it == schedules_.end()) {
      const int v = options_.virtual_stages;
      const bool fallback = v > 1 && micro_batches % K_ != 0;
      if (fallback && rank() == 0)
        std::fprintf(stderr,
                     "paratrain: note: Pipeline: interleaved 1F1B needs a multiple of %d micro-batches; a step of %d "
                     "runs its stages chunk by chunk in GPipe order (the same gradients, a longer bubble)\n",
                     K_, micro_batches);
      auto s = fallback ? pipeline::gpipe(K_, micro_batches, v)
                        : pipeline::make_schedule(options_.schedule, K_, micro_batches, v);
      pipeline::check(s);
      it = schedules_.emplace(micro_batches, std::move(s)).first;
    }
    return it->second;
  }
  /// Where this rank keeps its stages' state (paratrain::checkpointable), under the whole
  /// model's names (Note [Stage names]): a part of the model (CheckpointLayout::whole is
  /// false), each replicated tensor written by one of the stage's replicas.
  [[nodiscard]] CheckpointLayout checkpoint_layout() {
    auto layout = steps_->checkpoint_layout();
    layout.whole = false;
    // A tensor every replica of the stage holds alike goes to one of them, by turns; of a
    // tensor group, which holds it alike too where no tp layer cuts it, the first rank (the
    // tensor dimension is innermost: Note [Tensor-parallel checkpoints]).
    int turn = 0;
    const int tensor = mesh_.size(Dim::tensor);
    const auto writer = [&](TensorSlice& sl) {
      if (sl.replicated && sl.writer < 0)
        sl.writer = mesh_.world_rank(Dims::data() | Dim::tensor, (turn++ % replicas_) * tensor);
    };
    for (auto& sl : layout.model) writer(sl);
    for (auto& sl : layout.optimized) writer(sl);
    return layout;
  }
  /// After a checkpoint was loaded into checkpoint_layout()'s slices: nothing derives from
  /// them (every rank loaded its own). Collective, by the concept.
  void loaded() noexcept {}

  /// Bytes this rank holds for its stages' parameters, gradients and optimizer state.
  [[nodiscard]] ModelStateBytes model_state_bytes() const { return steps_->model_state_bytes(); }
  /// Bytes of gradients this rank handed to the last step's collectives among its stages'
  /// replicas (DataParallel::gradient_bytes_sent).
  [[nodiscard]] std::int64_t gradient_bytes_sent() const noexcept { return steps_->gradient_bytes_sent(); }
  /// Seconds the last step blocked on its stages' gradients and gathers.
  [[nodiscard]] double exposed_communication_seconds() const noexcept {
    return steps_->exposed_communication_seconds();
  }
  [[nodiscard]] std::int64_t step_count() const noexcept { return steps_->step_count(); }
  void set_step_count(std::int64_t steps) noexcept { steps_->set_step_count(steps); }

  /// fit's trace (Note [Zero-cost timeline]): each stage pass as a forward or backward span,
  /// the replicas' reductions and the optimizer step.
  void set_timeline(StepTimeline* timeline) noexcept {
    timeline_ = timeline;
    steps_->set_timeline(timeline);
  }

 private:
  using Tensors = std::vector<at::Tensor>;
  using Flags = std::vector<bool>;

  /// One micro-batch on one stage, from its forward to its backward: only what backward
  /// uses (the graph keeps what autograd needs).
  struct Stash {
    Tensors leaves;  // the received activations that need a gradient: theirs go back
    Tensors roots;   // the outputs that need a gradient; on the last stage, loss * samples
    std::optional<pipeline::detail::SplitBackward> split;
  };

  /// One step's state.
  struct Run {
    std::span<const Batch> micro;
    at::Tensor loss_sum = at::zeros({}, at::kDouble);  // summed on the loss's device: read once, after the step
    std::map<std::pair<int, int>, Stash> stash;     // (stage, micro)
  };

  StepResult join_checked(bool has_next) {
    steps_->begin_step();
    steps_->before_backward(/*last=*/true);
    return steps_->end_step(0, 0.0, has_next, /*joined=*/true);
  }

  /// Note [Same micro-batches]: throws on every rank when a replica's ranks were given
  /// different micro-batches, or one a micro-batch it cannot use.
  void check_same_micro_batches(std::span<const Batch> micro) {
    pipeline::detail::check_same_micro_batches(mesh_.world(), micro, replica_, replicas_, device_,
                                               mesh_.size(Dim::expert), mesh_.size(Dim::context) > 1);
  }

  /// `options` with the shard group the update's type names (Sharded<Optim, Stage, G>), as
  /// DataParallel takes it.
  static Options typed(Options options, int rank) {
    options.data_parallel = detail::typed_options<Update>(options.data_parallel, rank);
    return options;
  }

  /// The mesh this pipeline runs on (Note [Pipeline layout]): K pipeline ranks, the stages'
  /// replicas in the data dimensions as data_parallel.shard_group says. Collective.
  static Mesh<Comm> mesh_of(Comm comm, const Options& given) {
    const Options options = typed(given, comm.rank());
    const int K = pipeline::detail::pipeline_ranks<Comm>(S, comm, options, Steps::gathers_in_forward);
    const int t = options.data_parallel.tensor_parallel, W = comm.size();
    // Note [Pipeline layout]: each tensor and context rank runs the pipeline on its slice;
    // each expert rank is a replica of its own, whose stages route tokens to the other expert
    // ranks' stages of the same index.
    const int c = options.data_parallel.context_parallel, e = options.data_parallel.expert_parallel;
    if (t < 1 || c < 1 || e < 1 || W % (K * t * c * e) != 0)
      throw error("Pipeline", comm.rank(),
                  "a pipeline of " + std::to_string(K) + " ranks, its stages cut over tensor groups of " +
                      std::to_string(t) + " (data_parallel.tensor_parallel)" +
                      (e == 1 ? std::string(" and ")
                              : ", their experts over expert groups of " + std::to_string(e) +
                                    " (data_parallel.expert_parallel) and ") +
                      "their sequences over context groups of " + std::to_string(c) +
                      " (data_parallel.context_parallel), runs on a multiple of " + std::to_string(K * t * c * e) +
                      " ranks; this run has " + std::to_string(W));
    auto shape = data_mesh(options.data_parallel.shard_group, W / (K * t * c * e), comm.rank());
    shape.pipeline = K;
    shape.tensor = t;
    shape.context = c;
    shape.expert = e;
    return Mesh<Comm>(std::move(comm), shape);
  }

  template <std::size_t... I>
  void build(const Pipeline<Stage...>& stages, std::index_sequence<I...>) {
    // Module::register_module takes a TORCH_MODULE holder or a std::shared_ptr alike.
    ((owns(static_cast<int>(I)) ? (void)(std::get<I>(stages_) = stages.template make<I>(),
                                         group_->register_module(stages.names()[I], std::get<I>(stages_)))
                                : void()),
     ...);
  }

  /// Stage s's forward on `in`, as a list of tensors.
  Tensors forward(int s, const Tensors& in) {
    Tensors out;
    [&]<std::size_t... I>(std::index_sequence<I...>) {
      ((s == static_cast<int>(I) ? (void)(out = as_tensors(detail::forward(std::get<I>(stages_), in))) : void()), ...);
    }(std::index_sequence_for<Stage...>{});
    return out;
  }

  static Tensors as_tensors(at::Tensor t) { return {std::move(t)}; }
  template <class... T>
  static Tensors as_tensors(std::tuple<T...> t) {
    return std::apply([](auto&&... x) { return Tensors{std::move(x)...}; }, std::move(t));
  }


  /// Sends to the rank of stage `to` (or keeps it, when that is this rank). A gradient goes
  /// without a header: its receiver holds the outputs it is shaped like (Note [Stage messages]).
  void deliver(pipeline::detail::Message kind, int to, int micro, const Tensors& t, const Flags& needs) {
    if (owns(to)) {
      Tensors copy;
      for (const auto& x : t) copy.push_back(x.detach());
      local_[{static_cast<int>(kind), to, micro}] = {std::move(copy), needs};
      return;
    }
    const int peer = to % K_, tag = pipeline::detail::tag_of(kind, to, micro, S);
    if (kind == pipeline::detail::Message::gradient) link_->send_known(t, peer, tag);
    else link_->send(t, needs, peer, tag);
  }

  /// The gradients stage `at + 1` sent back for stage `at`'s `outputs` of `micro`.
  Tensors receive_gradients(int at, int micro, const Tensors& outputs) {
    if (owns(at + 1)) return receive(pipeline::detail::Message::gradient, at, micro).first;
    return link_->recv_like(outputs, (at + 1) % K_, pipeline::detail::tag_of(pipeline::detail::Message::gradient, at, micro, S));
  }

  /// What stage `at`'s neighbour sent it for `micro`.
  std::pair<Tensors, Flags> receive(pipeline::detail::Message kind, int at, int micro) {
    const int from = kind == pipeline::detail::Message::gradient ? at + 1 : at - 1;
    if (owns(from)) {
      auto node = local_.extract({static_cast<int>(kind), at, micro});
      if (node.empty())
        throw error("Pipeline", rank(), "internal: a message to this rank itself is missing");
      return std::move(node.mapped());
    }
    return link_->recv(from % K_, pipeline::detail::tag_of(kind, at, micro, S), device_);
  }

  template <class Loss>
  void run_forward(const pipeline::Action& a, Run& run, Loss& loss) {
    const auto& batch = run.micro[static_cast<std::size_t>(a.micro)];
    Stash st;
    Tensors inputs;
    if (a.stage == 0) {
      inputs = detail::to_device(batch.inputs, device_);
    } else {
      auto [in, needs] = receive(pipeline::detail::Message::activation, a.stage, a.micro);
      for (std::size_t i = 0; i < in.size(); ++i)
        if (needs[i]) st.leaves.push_back(in[i].requires_grad_(true));
      inputs = std::move(in);
    }
    const auto begin = clock::now();
    PhaseTimer timer(timeline_, Phase::forward);
    // Note [Mixed precision]: the stage's forward, and the loss, under autocast.
    std::optional<detail::AutocastScope> autocast(std::in_place, options_.data_parallel.precision.autocast, device_);
    // Note [Exact averaging]: the loss's gradient is the sum over the micro-batch's samples,
    // times the loss scale over the step's unit (Note [Loss scaling]: every stage has the
    // same micro-batches, so the same unit), which every stage's buckets take out again; a
    // layer that adds a loss of its own in backward, in any stage, scales it alike
    // (Note [Auxiliary loss in backward]).
    const auto n = static_cast<double>(batch.size());
    const double scale = steps_->backward_factor(batch.size());
    std::optional<BackwardScale> backward_scale(std::in_place, scale);
    const auto outputs = forward(a.stage, inputs);
    Flags needs;
    if (a.stage == S - 1) {
      // Note [Losses of a batch]: of what the last stage returns and the batch (the targets
      // alone, for a loss of them), on the output's device.
      const auto device = outputs.front().device();
      const Batch on_device = detail::reads_batch<Loss, output_type>
                                  ? batch.to(device)
                                  : Batch(std::vector<at::Tensor>{}, detail::move_to(batch.target, device));
      at::Tensor l = detail::compute_loss<output_type>(loss, detail::output_of<output_type>(outputs), on_device);
      st.roots = {l * scale};
      run.loss_sum = run.loss_sum.to(l.device()) + l.detach().to(at::kDouble) * n;
    } else {
      for (const auto& y : outputs) {
        needs.push_back(y.requires_grad());
        if (y.requires_grad()) st.roots.push_back(y);
      }
    }
    backward_scale.reset();
    autocast.reset();
    timer.stop();
    record(a, begin);
    if (a.stage != S - 1) deliver(pipeline::detail::Message::activation, a.stage + 1, a.micro, outputs, needs);
    run.stash.emplace(std::pair{a.stage, a.micro}, std::move(st));
    stats_.peak_stashed = std::max(stats_.peak_stashed, static_cast<int>(run.stash.size()));
  }

  /// The gradients of the stage's roots: none for the loss, else what the next stage sent
  /// (nothing when no output needs one: a frozen stage).
  Tensors root_gradients(const pipeline::Action& a, const Stash& st) {
    if (a.stage == S - 1) return {at::Tensor()};
    if (st.roots.empty()) return {};
    auto grads = receive_gradients(a.stage, a.micro, st.roots);
    if (grads.size() != st.roots.size())
      throw error("Pipeline", rank(), "stage " + std::to_string(a.stage + 1) + " sent " +
                                                 std::to_string(grads.size()) + " gradients; stage " +
                                                 std::to_string(a.stage) + " has " + std::to_string(st.roots.size()) +
                                                 " outputs that need one");
    return grads;
  }

  void send_input_grads(const pipeline::Action& a, Tensors grads) {
    if (a.stage == 0 || grads.empty()) return;
    deliver(pipeline::detail::Message::gradient, a.stage - 1, a.micro, grads, Flags(grads.size(), false));
  }

  void run_backward(const pipeline::Action& a, Run& run, bool last) {
    auto node = run.stash.extract({a.stage, a.micro});
    auto& st = node.mapped();
    const auto grads = root_gradients(a, st);
    const auto begin = clock::now();
    PhaseTimer timer(timeline_, Phase::backward);
    steps_->before_backward(last);
    if (!st.roots.empty()) torch::autograd::backward(st.roots, grads);
    Tensors in_grads;
    for (auto& x : st.leaves) in_grads.push_back(x.grad().defined() ? x.grad() : at::zeros_like(x));
    timer.stop();
    record(a, begin);
    send_input_grads(a, std::move(in_grads));
  }

  void run_backward_input(const pipeline::Action& a, Run& run) {
    auto& st = run.stash.at({a.stage, a.micro});
    auto grads = root_gradients(a, st);
    const auto begin = clock::now();
    PhaseTimer timer(timeline_, Phase::backward);
    st.split.emplace(std::exchange(st.roots, {}), std::move(grads), std::exchange(st.leaves, {}));
    auto in_grads = st.split->input_gradients();
    timer.stop();
    record(a, begin);
    send_input_grads(a, std::move(in_grads));
  }

  void run_backward_weight(const pipeline::Action& a, Run& run, bool last) {
    auto node = run.stash.extract({a.stage, a.micro});
    const auto begin = clock::now();
    PhaseTimer timer(timeline_, Phase::backward);
    steps_->before_backward(last);
    node.mapped().split->weight_gradients();
    timer.stop();
    record(a, begin);
  }

  template <class Loss>
  void run_schedule(const pipeline::Schedule& schedule, Run& run, Loss& loss) {
    const auto& actions = schedule.actions[static_cast<std::size_t>(p_)];
    // The last pass over the parameters completes the gradient buckets: it is the one
    // whose backward DataParallel overlaps with the replicas' reduction.
    std::size_t last = actions.size();
    for (std::size_t i = 0; i < actions.size(); ++i)
      if (actions[i].op == pipeline::Op::backward || actions[i].op == pipeline::Op::backward_weight) last = i;
    stats_ = {};
    const auto begin = clock::now();
    group_->train();
    for (std::size_t i = 0; i < actions.size(); ++i) {
      const auto& a = actions[i];
      switch (a.op) {
        case pipeline::Op::forward: run_forward(a, run, loss); break;
        case pipeline::Op::backward: run_backward(a, run, i == last); break;
        case pipeline::Op::backward_input: run_backward_input(a, run); break;
        case pipeline::Op::backward_weight: run_backward_weight(a, run, i == last); break;
      }
    }
    link_->flush();
    stats_.span_seconds = seconds_since(begin);
    if (!run.stash.empty() || !local_.empty())
      throw error("Pipeline", rank(), "internal: the schedule left activations behind");
  }

  using clock = std::chrono::steady_clock;
  static double seconds_since(clock::time_point t) {
    return std::chrono::duration<double>(clock::now() - t).count();
  }
  void record(const pipeline::Action& a, clock::time_point begin) {
    const double t = seconds_since(begin);
    const auto op = static_cast<std::size_t>(a.op);
    stats_.seconds[op] += t;
    ++stats_.count[op];
  }

  Mesh<Comm> mesh_;
  Options options_;
  int K_ = 1, replicas_ = 1, p_ = 0, replica_ = 0;  // the mesh's pipeline and data sizes and this rank's places
  Comm pipe_;  // this replica's pipeline ranks
  std::unique_ptr<Comm> pipe_back_;  // the same, for gradients, where sends are unbuffered: Note [One group per direction]
  std::tuple<Stage...> stages_{Stage(nullptr)...};
  detail::StageGroup group_;
  tp::Group tensor_group_;   // the one the stages' layers joined
  tp::Group context_group_;  // the one their attention runs over (tp::Context::context)
  tp::Group expert_group_;   // the one their mixtures of experts cut their experts over (tp::Context::expert)
  at::Device device_{at::kCPU};  // where this rank's stages live: received tensors go there
  std::unique_ptr<Steps> steps_;
  std::unique_ptr<pipeline::detail::Link<Comm>> link_;
  std::map<int, pipeline::Schedule> schedules_;
  std::map<std::tuple<int, int, int>, std::pair<Tensors, Flags>> local_;  // messages to this rank itself
  PipelineStepStats stats_;
  StepTimeline* timeline_ = nullptr;  // Note [Zero-cost timeline]
};

/// A pipeline without DataParallel's third argument: the same compile-time error as a model's.
template <class... Stage, class Comm>
class DataParallel<Pipeline<Stage...>, Comm, update_not_named> {
  static_assert(sizeof...(Stage) == 0,
                "paratrain: name the update as DataParallel's third argument: an optimizer "
                "(DataParallel<Pipeline<...>, Comm, torch::optim::Adam>, torch::optim::SGD, ...) or a sharded one "
                "(Sharded<torch::optim::Adam, zero::stage1>); DataParallel<Pipeline<...>> no longer means SGD");
};

}  // namespace paratrain
