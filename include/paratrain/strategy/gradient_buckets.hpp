#pragma once
/// \file
/// paratrain::GradientBuckets — gradient-ready hooks over a BucketLayout, and the policy
/// for what a complete bucket does (all-reduce for DDP, reduce-scatter for ZeRO): the
/// one mechanism under DataParallel at every ZeRO stage.

#include <torch/csrc/autograd/function.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/variable.h>
#include <c10/core/ScalarType.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "paratrain/core/reduce_op.hpp"
#include "paratrain/concepts/communicator.hpp"
#include "paratrain/collectives/all_reduce_on.hpp"
#include "paratrain/strategy/detail/slot_pool.hpp"
#include "paratrain/strategy/detail/tensor_bytes.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/core/timeline.hpp"
#include "paratrain/strategy/bucket_layout.hpp"
#include "paratrain/strategy/step_agreement.hpp"

namespace paratrain {

// Note [Transient memory]
// Sharded (ZeRO 2, 3), a bucket's whole-size gradient buffer exists only while it is
// needed: allocated when its first gradient arrives (or one bucket ahead of the launch,
// so that autograd writes into it directly), and freed as soon as its reduce-scatter has
// completed and left this rank's shard, which the gradient hooks test in order while
// backward runs; the rest are freed in finish(). The whole buffers alive at once are then
// those of the buckets whose gradients are still arriving or in flight, not the whole
// model's: at most three, from a pool (Note [Pooled transients]), which
// paratrain::plan::peak counts (Note [Peak memory model]).

// Note [Exact averaging]
// Each rank back-propagates loss * n (n = its sample count this step), so its gradient
// is the sum over its samples. The buckets are summed across ranks and divided by the
// global sample count, which a small status all-reduce at the end of the step carries.
// The result is the gradient of the mean loss over the union of all ranks' samples:
// exactly what one device computes on the concatenated batch, also when ranks have
// different batch sizes, accumulate several micro-batches, or have run out of data
// (joined, n = 0).

/// What a bucket of gradients does once all of them are ready: the layer's extension
/// point (PyTorch's `register_comm_hook`). A hook returns a request for the summed
/// gradient and says where the result lives.
///
/// | hook                     | leaves on each rank               | used by              |
/// |--------------------------|-----------------------------------|----------------------|
/// | `AllReduceGradients`     | the whole summed bucket (`grad`)  | DDP, ZeRO stage 1    |
/// | `ReduceScatterGradients` | its shard of the sum (`shard`)    | ZeRO stages 2 and 3  |
///
/// A hook sums the buffers it is given in their type; where gradients are summed in a
/// narrower one (Precision::reduce, Note [Mixed precision]), GradientBuckets hands it a
/// narrowed copy of the bucket and widens the sum back when it completes.
template <class H, class Comm>
concept bucket_hook = requires(H& h, Comm& c, at::Tensor& grad, at::Tensor& shard) {
  { h.launch(c, grad, shard) } -> request;
  { H::shards_gradients } -> std::convertible_to<bool>;
};

namespace detail {

/// A collective's request whose result, taken in another type than its destination's,
/// is copied into the destination when it completes (and the buffers then dropped).
template <request R>
class WidenOnCompletion {
 public:
  explicit WidenOnCompletion(R inner) : inner_(std::move(inner)) {}
  WidenOnCompletion(R inner, at::Tensor result, at::Tensor destination, at::Tensor input)
      : inner_(std::move(inner)), result_(std::move(result)), destination_(std::move(destination)),
        input_(std::move(input)) {}

  void wait() {
    if (done_) return;
    inner_.wait();
    finish();
  }
  bool test() {
    if (done_) return true;
    if (!inner_.test()) return false;
    finish();
    return true;
  }

 private:
  void finish() {
    if (destination_.defined()) destination_.copy_(result_);
    result_ = destination_ = input_ = at::Tensor();
    done_ = true;
  }
  R inner_;
  at::Tensor result_, destination_, input_;
  bool done_ = false;
};

/// A hook's request, then (hybrid sharding: Note [Hybrid sharding]) the all-reduce of its
/// shard across the replicas, started when the first completes; without replicas, the
/// hook's request alone.
template <request R, class Comm>
class AcrossReplicas {
 public:
  AcrossReplicas(R first, Comm* replicas, at::Tensor shard)
      : first_(std::move(first)), replicas_(replicas), shard_(std::move(shard)) {}

  void wait() {
    if (!second_) {
      first_.wait();
      if (!start_second()) return;
    }
    second_->wait();
  }
  bool test() {
    if (!second_) {
      if (!first_.test()) return false;
      if (!start_second()) return true;
    }
    return second_->test();
  }

 private:
  using Second = decltype(std::declval<Comm&>().iall_reduce(std::declval<at::Tensor&>(), reduce_op::sum));
  // False when there is nothing to start (no replicas).
  bool start_second() {
    if (replicas_ == nullptr) return false;
    if (!second_) second_.emplace(replicas_->iall_reduce(shard_, reduce_op::sum));
    return true;
  }
  R first_;
  Comm* replicas_;
  at::Tensor shard_;
  std::optional<Second> second_;
};

}  // namespace detail

/// Every rank keeps the whole summed gradient.
struct AllReduceGradients {
  static constexpr bool shards_gradients = false;
  template <async_communicator Comm>
  auto launch(Comm& c, at::Tensor& grad, at::Tensor& /*shard*/) {
    return c.iall_reduce(grad, reduce_op::sum);
  }
};

/// Each rank keeps only its shard of the summed gradient (Note [Shard layout]); the whole
/// bucket exists only from its first gradient until its reduce-scatter completes.
struct ReduceScatterGradients {
  static constexpr bool shards_gradients = true;
  template <async_sharding_communicator Comm>
  auto launch(Comm& c, at::Tensor& grad, at::Tensor& shard) {
    return c.ireduce_scatter(grad, shard, reduce_op::sum);
  }
};

/// Gradients of a model's parameters in the buckets of a BucketLayout: hooks that see
/// each gradient become ready, launch each complete bucket through `Hook` in bucket
/// order (Note [Bucket order]) while backward goes on, and at the end of the step wait,
/// agree on the step's status (Note [Step agreement]) and average exactly (Note [Exact averaging]).
template <class Comm, bucket_hook<Comm> Hook>
class GradientBuckets {
 public:
  static constexpr bool shards = Hook::shards_gradients;

  /// `layout` must outlive this object; `on_complete(b)` is called when every gradient of
  /// bucket b is ready in a backward (accumulating or not): ZeRO-3 frees parameters then.
  /// `reduce_dtype`: the type buckets are summed in (Precision::reduce); empty: their own.
  /// Sharded, the hook reduces over `group` (default: `comm`) and, with `replicas`, each
  /// shard is then summed across them (Note [Hybrid sharding]); the step's agreement is
  /// always over `comm`.
  GradientBuckets(const BucketLayout& layout, Comm& comm, bool find_unused_parameters,
                  std::function<void(std::size_t)> on_complete = {},
                  std::optional<at::ScalarType> reduce_dtype = std::nullopt, Comm* group = nullptr,
                  Comm* replicas = nullptr)
      : layout_(&layout),
        comm_(&comm),
        group_(group != nullptr ? group : &comm),
        replicas_(replicas),
        find_unused_(find_unused_parameters),
        on_complete_(std::move(on_complete)),
        reduce_dtype_(reduce_dtype),
        params_(layout.params().size()),
        buckets_(layout.buckets().size()) {
    std::size_t largest = 0;
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      if constexpr (shards) {
        buckets_[b].shard = at::zeros({layout.shard_numel(b)}, layout.buckets()[b].options);
        release(b);
      } else {
        allocate(b);
      }
      largest = std::max(largest, static_cast<std::size_t>(layout.buckets()[b].padded) *
                                      layout.buckets()[b].options.dtype().itemsize());
    }
    // Note [Pooled transients]: the one filling, the one ahead of it, the one in flight.
    if constexpr (shards) pool_ = detail::SlotPool(largest, 3, layout.buckets().front().options.device());
    for (std::size_t i = 0; i < params_.size(); ++i) {
      params_[i].accumulator = torch::autograd::impl::grad_accumulator(tensor(i));
      params_[i].hook_key = params_[i].accumulator->add_post_hook(std::make_unique<ReadyHook>(this, i));
    }
  }

  GradientBuckets(const GradientBuckets&) = delete;
  GradientBuckets& operator=(const GradientBuckets&) = delete;
  ~GradientBuckets() {
    for (auto& p : params_)
      if (p.accumulator) p.accumulator->del_post_hook(p.hook_key);
  }

  /// Sets every gradient to zero (DDP: views into their buckets again; sharded: the
  /// whole-bucket buffers are released, and come back as gradients arrive).
  void zero_grad() {
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      if constexpr (shards) {
        release(b);
      } else {
        buckets_[b].grad.zero_();
        for (auto i : layout_->buckets()[b].params) keep_grad_in_bucket(i);
      }
    }
    for (auto& p : params_) p.used = false;
  }

  /// Before backward: with `sync`, buckets are reduced as they fill; without (gradient
  /// accumulation) the hooks only let gradients accumulate.
  void prepare(bool sync) {
    sync_ = sync;
    if (sync) sent_bytes_ = 0;
    ordered_step_ = false;
    next_launch_ = 0;
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      buckets_[b].pending = static_cast<int>(layout_->buckets()[b].params.size());
    for (auto& p : params_) p.ready = false;
    if (shards && sync) allocate(0);  // the first bucket's views are ready before its gradients
  }

  /// After backward (or instead of it, for a rank that has joined with no data):
  /// launches what is left, waits, and divides by the global sample count (times
  /// `loss_scale`, the factor backward's loss carried: Note [Loss scaling]). A rank that
  /// `failed` joins, and every rank's status then says how many failed, and nothing else.
  StepStatus finish(double local_samples, bool has_next, bool joined = false, bool failed = false,
                    double loss_scale = 1.0) {
    // Note [Step agreement]: per parameter, the ranks that used it, with find_unused_parameters.
    StepAgreement agreement(params_.size(), find_unused_);
    std::optional<std::string> unused;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      if (params_[i].used) agreement.mark_used(i);
      if (!params_[i].used && !joined && !find_unused_ && !unused) unused = layout_->params()[i].name;
      mark_ready(i);
    }
    agreement.set(local_samples, has_next, unused.has_value(), failed);
    const auto start = std::chrono::steady_clock::now();
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      if (auto& r = buckets_[b].request) {
        r->wait();
        if (timeline_) timeline_->completed(b);
      }
      buckets_[b].request.reset();
      if constexpr (shards) release(b);
    }
    all_reduce_on_device(agreement.values());
    exposed_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const auto status = agreement.status();
    if (status.ranks_failed > 0) return status;
    used_anywhere_.assign(params_.size(), true);
    for (std::size_t i = 0; i < params_.size(); ++i) used_anywhere_[i] = agreement.used_anywhere(i);
    // A parameter no rank used has no gradient, so the optimizer leaves it alone
    // (weight decay and momentum included), exactly as on a single device.
    if constexpr (!shards)
      for (std::size_t i = 0; i < params_.size(); ++i)
        if (!used_anywhere_[i]) tensor(i).mutable_grad() = at::Tensor();
    if (agreement.ranks_with_unused() > 0)
      throw error("DataParallel", comm_->rank(),
                  unused ? "parameter '" + *unused +
                               "' received no gradient in this step; enable "
                               "DataParallel::Options::find_unused_parameters if some parameters are legitimately "
                               "unused in some steps, or make every parameter take part in the loss"
                         : std::to_string(agreement.ranks_with_unused()) +
                               " other rank(s) found a parameter without gradient (see their message); enable "
                               "DataParallel::Options::find_unused_parameters if that is expected");
    if (status.samples > 0)
      for (std::size_t b = 0; b < buckets_.size(); ++b) {
        reduced(buckets_[b]).div_(status.samples * loss_scale);
        // Deterministic clipping's norm reads the whole sums: Note [Deterministic training].
        if (shards && ordered_step_ && ordered_whole_) ordered_[b].div_(status.samples * loss_scale);
      }
    return status;
  }

  /// Deterministic mode (Note [Deterministic training]), after the backward of this rank's
  /// shard of a round (prepare(false) before it): gathers every rank's shard of the round,
  /// bucket by bucket, adds the W gradients to the step's sums in rank order (the shards'
  /// order), and zeroes the buckets for the next round's backward. `first`, `last`: the
  /// step's first and last round; the last writes the step's gradients (the buckets, or this
  /// rank's shards) instead of the sums. `whole`: keep whole sums also when sharded
  /// (deterministic clipping reads them). Collective over the world (comm).
  void add_round(bool first, bool last, bool whole)
    requires sharding_communicator<Comm>
  {
    c10::NoGradGuard no_grad;
    const auto ranks = comm_->size();
    if (first) sent_bytes_ = 0;  // the step's: no prepare(true) in a deterministic step
    ordered_whole_ = whole || !shards;
    // Where the last round's sums go directly: the step's gradients, unless the whole sums
    // of a sharded step are kept too (then end_rounds() copies this rank's shard).
    const bool direct = last && !(shards && whole);
    ordered_.resize(buckets_.size());
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      allocate(b);  // zeros, where no gradient of the bucket arrived
      auto& bucket = buckets_[b];
      const auto n = bucket.grad.numel();
      auto rows = bucket.grad.view({1, n});  // one rank: its own gradient, no copy
      if (ranks > 1) {
        if (!gathered_.defined() || gathered_.numel() < n * ranks || gathered_.dtype() != bucket.grad.dtype() ||
            gathered_.device() != bucket.grad.device())
          gathered_ = at::empty({n * ranks}, bucket.grad.options());
        auto all = gathered_.narrow(0, 0, n * ranks);
        comm_->all_gather(bucket.grad, all);
        sent_bytes_ += n * static_cast<std::int64_t>(bucket.grad.element_size());
        rows = all.view({ranks, n});
      }
      if (!ordered_whole_) {  // this rank's shard of the sums only (Note [Shard layout])
        const auto m = layout_->shard_numel(b);
        rows = rows.narrow(1, group_->rank() * m, m);
      }
      auto& sum = ordered_[b];
      if (!direct && (!sum.defined() || sum.numel() != rows.size(1))) sum = at::empty({rows.size(1)}, rows.options());
      auto target = direct ? (shards ? bucket.shard : bucket.grad) : sum;
      // target = sum + row 0 (or row 0), then + row 1, ...: one addition at a time, in order.
      if (first) {
        if (target.data_ptr() != rows[0].data_ptr()) target.copy_(rows[0]);  // one rank, direct: there already
      } else {
        at::add_out(target, sum, rows[0]);
      }
      for (int r = 1; r < ranks; ++r) target.add_(rows[r]);
      if (!last) bucket.grad.zero_();  // for the next round's backward: the views stay
    }
    ordered_step_ = last;
    ordered_direct_ = direct;
  }

  /// Deterministic mode, after the last round where it kept the whole sums of a sharded
  /// step: this rank's shards of them become the step's gradients, which finish() averages.
  void end_rounds() {
    if (ordered_direct_) return;
    c10::NoGradGuard no_grad;
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      const auto m = layout_->shard_numel(b);
      buckets_[b].shard.copy_(ordered_[b].narrow(0, group_->rank() * m, m));
    }
  }

  /// What Totals adds up over every gradient element.
  struct Totals {
    double squares = 0;    ///< the sum of squares: the global 2-norm's square
    double nonfinite = 0;  ///< the number of NaN and Inf elements
  };

  /// After finish(): the squares (when `squares`) and the NaN and Inf elements (when
  /// `nonfinite`) of all reduced gradients, on every rank's shard when sharded, and of the
  /// gradients `also` accounts for (a pipeline's other stages: it adds theirs to the
  /// 2-element double tensor it is given). What clipping and the NaN check both need, in
  /// one synchronisation, not one a bucket or a use. Collective when sharded, and over
  /// `also`'s ranks.
  Totals totals(bool squares, bool nonfinite, const std::function<void(at::Tensor&)>& also = {}) {
    if (ordered_step_ && ordered_whole_ && !also) return ordered_totals(squares, nonfinite);
    std::vector<at::Tensor> parts;
    for (auto& b : buckets_) {
      const auto& g = reduced(b);
      const auto none = at::zeros({}, g.options().dtype(at::kDouble));
      parts.push_back(at::stack({squares ? g.norm().to(at::kDouble).square() : none,
                                 nonfinite ? at::isfinite(g).logical_not().sum().to(at::kDouble) : none}));
    }
    auto total = at::stack(parts).sum(0);
    if constexpr (shards)  // one group holds every shard once: Note [Hybrid sharding]
      detail::all_reduce_on(*group_, total, tensor(0).device(), reduce_op::sum);
    if (also) also(total);
    const auto t = total.cpu();
    return {t[0].template item<double>(), t[1].template item<double>()};
  }

  /// totals() of a deterministic step whose whole sums every rank holds: per parameter, in
  /// the model's order, in double, from the same bits at every world size and stage (Note
  /// [Deterministic training]); no collective.
  Totals ordered_totals(bool squares, bool nonfinite) const {
    std::vector<at::Tensor> square_sums, counts;
    for (const auto& p : layout_->params()) {
      const auto& sum = shards ? ordered_[p.bucket] : buckets_[p.bucket].grad;
      const auto g = sum.narrow(0, p.offset, p.tensor.numel()).to(at::kDouble);
      if (squares) square_sums.push_back(g.square().sum());
      if (nonfinite) counts.push_back(at::isfinite(g).logical_not().sum());
    }
    Totals out;
    if (squares) out.squares = at::stack(square_sums).sum().cpu().template item<double>();
    if (nonfinite) out.nonfinite = static_cast<double>(at::stack(counts).sum().cpu().template item<std::int64_t>());
    return out;
  }

  /// Scales the reduced gradients so that their global 2-norm, whose square is `squares`
  /// (totals), is at most `max_norm`, as torch::nn::utils::clip_grad_norm_ does on the
  /// whole model; returns the norm before.
  double clip_grad_norm(double max_norm, double squares) {
    const double norm = std::sqrt(squares);
    const double coef = std::min(max_norm / (norm + 1e-6), 1.0);
    for (auto& b : buckets_) reduced(b).mul_(coef);
    return norm;
  }

  /// After finish(): the name of the first parameter whose reduced gradient holds NaN or
  /// Inf in this rank's part of it (all of it, unless sharded); empty when there is none.
  [[nodiscard]] std::string first_nonfinite() const {
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      const auto bad = at::isfinite(reduced(buckets_[b])).logical_not().nonzero();
      if (bad.size(0) == 0) continue;
      auto at = bad[0][0].template item<std::int64_t>();
      if constexpr (shards) at += group_->rank() * layout_->shard_numel(b);
      for (auto i : layout_->buckets()[b].params) {
        const auto& p = layout_->params()[i];
        if (at >= p.offset && at < p.offset + p.tensor.numel()) return p.name;
      }
    }
    return {};
  }

  /// After finish(): whether any rank produced a gradient for parameter `i` this step
  /// (always true without find_unused_parameters).
  [[nodiscard]] bool used_anywhere(std::size_t i) const { return used_anywhere_.at(i); }
  /// This rank's shard of bucket `b`'s reduced gradient (Note [Shard layout]): the part
  /// a reduce-scatter left here, or that part of the whole all-reduced bucket.
  [[nodiscard]] at::Tensor shard(std::size_t b) const {
    if constexpr (shards) return buckets_.at(b).shard;
    const auto n = layout_->shard_numel(b);
    return buckets_.at(b).grad.narrow(0, group_->rank() * n, n);
  }
  /// Bytes of gradient storage held between steps.
  [[nodiscard]] std::size_t bytes() const {
    std::size_t n = 0;
    for (auto& b : buckets_) n += detail::bytes_of(reduced(b));
    for (const auto& sum : ordered_) n += detail::bytes_of(sum);  // deterministic mode's sums,
    n += detail::bytes_of(gathered_);                               // and its gathered round
    return n;
  }

  [[nodiscard]] double exposed_seconds() const noexcept { return exposed_seconds_; }
  [[nodiscard]] std::size_t bucket_count() const noexcept { return buckets_.size(); }
  /// Where each bucket's launch and completion are reported; null (the default): nowhere,
  /// at the cost of one pointer test. Note [Zero-cost timeline].
  void set_timeline(observe::StepTimeline* timeline) noexcept { timeline_ = timeline; }

  /// Bytes of gradients this rank handed to the step's collectives (the padded buckets,
  /// in the type they are summed in), since the last prepare(true): the last step's.
  [[nodiscard]] std::int64_t sent_bytes() const noexcept { return sent_bytes_; }

 private:
  using Request = detail::WidenOnCompletion<detail::AcrossReplicas<
      decltype(std::declval<Hook&>().launch(std::declval<Comm&>(), std::declval<at::Tensor&>(),
                                            std::declval<at::Tensor&>())),
      Comm>>;
  struct Param {
    bool ready = false;  // in this backward
    bool used = false;   // a gradient arrived since zero_grad()
    std::shared_ptr<torch::autograd::Node> accumulator;  // the variable keeps only a weak_ptr
    std::uintptr_t hook_key = 0;
  };
  struct Bucket {
    at::Tensor grad;   // the whole bucket, padded; sharded: only while gradients arrive
    at::Tensor shard;  // sharded: this rank's part of the sum
    int pending = 0;
    int slot = -1;  // the pool's slot `grad` is in; -1: the allocator's
    std::optional<Request> request;
  };

  // Fires after autograd has accumulated the parameter's gradient.
  struct ReadyHook final : torch::autograd::FunctionPostHook {
    ReadyHook(GradientBuckets* g, std::size_t i) : owner(g), index(i) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& grad_inputs,
                                              const torch::autograd::variable_list&) override {
      owner->params_[index].used = true;
      owner->mark_ready(index);
      return grad_inputs;
    }
    GradientBuckets* owner;
    std::size_t index;
  };

  [[nodiscard]] const at::Tensor& tensor(std::size_t i) const { return layout_->params()[i].tensor; }
  [[nodiscard]] static const at::Tensor& reduced(const Bucket& b) { return shards ? b.shard : b.grad; }

  // The whole-bucket buffer, with every gradient of the bucket a view into it.
  // Sharded, from the pool where a slot is free (Note [Pooled transients]).
  void allocate(std::size_t b) {
    auto& bucket = buckets_[b];
    if (bucket.grad.defined()) return;
    const auto& layout = layout_->buckets()[b];
    const auto bytes = static_cast<std::size_t>(layout.padded) * layout.options.dtype().itemsize();
    bucket.slot = shards ? pool_.acquire(bytes) : -1;
    // Every slot taken: the oldest reduce-scatter in flight hands its slot back first, so
    // that the pool bounds what is alive (Note [Pooled transients]); only buckets still
    // filling (gradient accumulation) make it overflow to the allocator.
    for (std::size_t k = 0; shards && bucket.slot < 0 && k < buckets_.size(); ++k)
      if (auto& r = buckets_[k].request) {
        r->wait();
        if (timeline_) timeline_->completed(k);
        r.reset();
        release(k);
        bucket.slot = pool_.acquire(bytes);
      }
    bucket.grad = bucket.slot >= 0 ? pool_.view(bucket.slot, 0, layout.padded, layout.options).zero_() : layout_->zeros(b);
    for (auto i : layout.params) keep_grad_in_bucket(i);
  }

  void release(std::size_t b) {
    buckets_[b].grad = at::Tensor();
    for (auto i : layout_->buckets()[b].params) tensor(i).mutable_grad() = at::Tensor();
    pool_.release(std::exchange(buckets_[b].slot, -1));
  }

  void mark_ready(std::size_t i) {
    auto& p = params_[i];
    if (p.ready) return;
    p.ready = true;
    const auto b = layout_->params()[i].bucket;
    allocate(b);
    keep_grad_in_bucket(i);
    if (--buckets_[b].pending == 0 && on_complete_) on_complete_(b);
    if (!sync_) return;
    // Note [Bucket order]: launch in index order only.
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
      auto& bucket = buckets_[next_launch_];
      if (timeline_) timeline_->launched(next_launch_);
      launch(bucket);
      ++next_launch_;
      if (shards && next_launch_ < buckets_.size()) allocate(next_launch_);  // one bucket ahead
    }
    // MPI progresses only inside MPI calls (no progress thread in OpenMPI 4.1); each
    // gradient hook gives the oldest pending reduction a turn.
    for (std::size_t k = 0; k < buckets_.size(); ++k)
      if (auto& r = buckets_[k].request) {
        if (!r->test()) break;
        if (timeline_) timeline_->completed(k);
        if constexpr (shards) {  // its shard is reduced: the whole buffer goes (Note [Transient memory])
          r.reset();
          release(k);
        }
      }
  }

  // The bucket's sum through the hook, in reduce_dtype_ where that is narrower: Note
  // [Mixed precision]. The hook then sums a narrowed copy (and, sharded, into a narrowed
  // shard), and the request widens the result into the bucket (or its shard).
  void launch(Bucket& bucket) {
    const auto own = bucket.grad.scalar_type();
    const auto wire = reduce_dtype_.value_or(own);
    sent_bytes_ += bucket.grad.numel() * static_cast<std::int64_t>(c10::elementSize(wire));
    // Sharded, over the group, then across the replicas (Note [Hybrid sharding]).
    auto& comm = shards ? *group_ : *comm_;
    auto* across = shards ? replicas_ : nullptr;
    if (wire == own) {
      bucket.request.emplace(detail::AcrossReplicas(hook_.launch(comm, bucket.grad, bucket.shard), across, bucket.shard));
      return;
    }
    auto grad = bucket.grad.to(wire);
    auto shard = shards ? at::empty(bucket.shard.sizes(), bucket.shard.options().dtype(wire)) : at::Tensor();
    auto r = detail::AcrossReplicas(hook_.launch(comm, grad, shard), across, shard);
    if constexpr (shards) bucket.request.emplace(std::move(r), shard, bucket.shard, grad);
    else bucket.request.emplace(std::move(r), grad, bucket.grad, at::Tensor());
  }

  // The gradient of parameter i as a view into its bucket. If something replaced .grad
  // (autograd, when the bucket was not allocated yet; a user's zero_grad(set_to_none)),
  // the gradient is copied into the bucket and the view restored, so it is never lost.
  void keep_grad_in_bucket(std::size_t i) {
    auto& g = tensor(i).mutable_grad();
    const auto& p = layout_->params()[i];
    auto view = buckets_[p.bucket].grad.narrow(0, p.offset, p.tensor.numel());
    if (g.defined() && g.data_ptr() == view.data_ptr()) return;
    c10::NoGradGuard no_grad;
    if (g.defined()) view.copy_(g.reshape({-1}));
    else view.zero_();
    g = view.view(p.tensor.sizes());
  }

  // On the parameters' device, where the communicator works (comm::Nccl: CUDA only).
  void all_reduce_on_device(at::Tensor& t) { detail::all_reduce_on(*comm_, t, tensor(0).device(), reduce_op::sum); }

  const BucketLayout* layout_;
  Comm* comm_;
  Comm* group_;     // sharded: where the hook reduces
  Comm* replicas_;  // hybrid sharding: where shards are summed next
  bool find_unused_;
  std::function<void(std::size_t)> on_complete_;
  std::optional<at::ScalarType> reduce_dtype_;
  Hook hook_;
  std::vector<Param> params_;
  std::vector<Bucket> buckets_;
  detail::SlotPool pool_;  // sharded: the whole buffers, Note [Pooled transients]
  std::vector<bool> used_anywhere_;
  // Deterministic mode (Note [Deterministic training]): the step's sums in shard order, kept
  // between steps for reuse (whole, or this rank's shards), the round's gathered buffer, and
  // whether the reduced gradients came from them this step.
  std::vector<at::Tensor> ordered_;
  at::Tensor gathered_;
  bool ordered_whole_ = false;
  bool ordered_step_ = false;
  bool ordered_direct_ = false;  // the last round wrote the step's gradients themselves
  std::size_t next_launch_ = 0;
  bool sync_ = true;
  double exposed_seconds_ = 0;
  std::int64_t sent_bytes_ = 0;
  observe::StepTimeline* timeline_ = nullptr;
};

}  // namespace paratrain
