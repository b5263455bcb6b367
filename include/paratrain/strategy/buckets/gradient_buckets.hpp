#pragma once
/// \file
/// paratrain::GradientBuckets — the bucket layer: gradient-ready hooks over a BucketLayout,
/// each complete bucket launched through a gradient hook in bucket order while backward goes
/// on, and the step's reductions waited for. Readiness, order and timing only: the buffers
/// are a gradient storage's, what a launch does is a hook's (Note [Gradient hooks]).

#include <torch/csrc/autograd/function.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "paratrain/core/error.hpp"
#include "paratrain/core/timeline.hpp"
#include "paratrain/strategy/buckets/bucket_layout.hpp"
#include "paratrain/strategy/buckets/gradient_hook.hpp"
#include "paratrain/strategy/buckets/gradient_storage.hpp"
#include "paratrain/strategy/detail/tensor_bytes.hpp"

namespace paratrain {

// Note [Exact averaging]
// ~~~~~~~~~~~~~~~~~~~~~~
// Each rank back-propagates loss * n (n = its sample count this step), so its gradient
// is the sum over its samples. The buckets are summed across ranks and divided by the
// global sample count, which a small status all-reduce at the end of the step carries.
// The result is the gradient of the mean loss over the union of all ranks' samples:
// exactly what one device computes on the concatenated batch, also when ranks have
// different batch sizes, accumulate several micro-batches, or have run out of data
// (joined, n = 0).

/// Gradients of a model's parameters in the buckets of a BucketLayout, their buffers in a
/// `Storage` (gradient_storage): hooks that see each gradient become ready, launch each
/// complete bucket through the gradient hook in bucket order (Note [Bucket order]) while
/// backward goes on, and, at the end of a step, wait for every bucket's sum, which the
/// strategy then averages exactly (Note [Exact averaging]) once the ranks have agreed on
/// the step (Note [Step agreement]).
template <class Comm, gradient_storage Storage>
class GradientBuckets {
 public:
  /// `layout` must outlive this object; `on_complete(b)` is called when every gradient of
  /// bucket b is ready in a backward (accumulating or not): ZeRO-3 frees parameters then.
  /// Bucket b is summed by `hook` over `ranks[b].group` (and, sharded in groups, across
  /// `ranks[b].replicas`).
  GradientBuckets(const BucketLayout& layout, Storage storage, std::vector<SumRanks<Comm>> ranks,
                  AnyGradientHook<Comm> hook, std::function<void(std::size_t)> on_complete = {})
      : layout_(&layout),
        storage_(std::move(storage)),
        ranks_(std::move(ranks)),
        hook_(std::move(hook)),
        on_complete_(std::move(on_complete)),
        params_(layout.params().size()),
        buckets_(layout.buckets().size()) {
    if (ranks_.size() != buckets_.size())
      throw error("GradientBuckets", -1,
                  std::to_string(ranks_.size()) + " sets of ranks for " + std::to_string(buckets_.size()) + " buckets");
    for (std::size_t b = 0; b < buckets_.size(); ++b) attach(b);
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

  /// What a complete bucket does from the next launch on (Note [Gradient hooks]); between steps.
  void set_hook(AnyGradientHook<Comm> hook) { hook_ = std::move(hook); }
  [[nodiscard]] AnyGradientHook<Comm>& hook() noexcept { return hook_; }

  /// A new step's gradients start: every gradient is zero (a view into its bucket's buffer,
  /// or none where the storage has released the buffer and makes it as gradients arrive).
  void zero_grad() {
    clear();
    for (auto& p : params_) p.used = false;
    sent_bytes_ = 0;
  }
  /// Every bucket's gradients zero again, keeping what was used (deterministic mode's rounds).
  void clear() {
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      storage_.clear(b);
      attach(b);
    }
  }

  /// Before backward: with `sync`, buckets are launched as they fill; without (gradient
  /// accumulation) the hooks only let gradients accumulate.
  void prepare(bool sync) {
    sync_ = sync;
    next_launch_ = 0;
    for (std::size_t b = 0; b < buckets_.size(); ++b)
      buckets_[b].pending = static_cast<int>(layout_->buckets()[b].params.size());
    for (auto& p : params_) p.ready = false;
    if (sync) acquire(0);  // the first bucket's views are ready before its gradients
  }

  /// After backward (or instead of it, for a rank with no data): launches what is left and
  /// waits for every bucket's sum, in bucket order.
  void flush() {
    for (std::size_t i = 0; i < params_.size(); ++i) mark_ready(i);
    const auto start = std::chrono::steady_clock::now();
    for (std::size_t b = 0; b < buckets_.size(); ++b) complete(b);
    exposed_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  /// Whether this rank produced a gradient for parameter `i` since zero_grad().
  [[nodiscard]] bool used(std::size_t i) const { return params_[i].used; }

  /// After the ranks agreed (`used_anywhere(i)`: whether any rank used parameter i): a
  /// parameter no rank used has no gradient, so the optimizer leaves it alone (weight decay
  /// and momentum included), exactly as on a single device.
  template <class UsedAnywhere>
  void settle(UsedAnywhere&& used_anywhere) {
    used_anywhere_.assign(params_.size(), true);
    for (std::size_t i = 0; i < params_.size(); ++i) {
      used_anywhere_[i] = used_anywhere(i);
      if (!used_anywhere_[i]) tensor(i).mutable_grad() = at::Tensor();
    }
  }

  /// What each bucket's gradients are multiplied by before they are summed across ranks, from
  /// the next launch on: this rank's loss unit under loss scaling (Note [Loss scaling]), a
  /// power of two, so the product is exact; 1 (the default) leaves them as they are.
  void set_input_factor(double factor) noexcept { input_factor_ = factor; }

  /// Divides every sum by `divisor`: the global sample count (times the loss scale).
  void divide(double divisor) {
    for (std::size_t b = 0; b < buckets_.size(); ++b) output(b).div_(divisor);
  }
  /// Multiplies every sum by `factor` (clipping).
  void scale(double factor) {
    for (std::size_t b = 0; b < buckets_.size(); ++b) output(b).mul_(factor);
  }

  /// This rank's part of the sums' squares (when `squares`) and NaN and Inf elements (when
  /// `nonfinite`), as a 2-element double tensor on the gradients' device: the ranks that
  /// partition the gradients sum it (clipping and the NaN check need both, in one all-reduce).
  /// `counted`, where given, says per parameter of the layout whether its squares count
  /// on this rank (a parameter replicated over a tensor group counts on one of its ranks:
  /// Note [Norms over a tensor group]); the others' parts of this rank's output are left out.
  [[nodiscard]] at::Tensor local_totals(bool squares, bool nonfinite,
                                        const std::vector<char>* counted = nullptr) const {
    std::vector<at::Tensor> parts;
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      const auto& g = output(b);
      const auto none = at::zeros({}, g.options().dtype(at::kDouble));
      const auto& in = layout_->buckets()[b].params;
      const bool all = counted == nullptr || std::all_of(in.begin(), in.end(), [&](auto i) { return (*counted)[i]; });
      auto sq = !squares ? none : all ? g.norm().to(at::kDouble).square() : counted_squares(b, *counted, none);
      parts.push_back(at::stack({sq, nonfinite ? at::isfinite(g).logical_not().sum().to(at::kDouble) : none}));
    }
    return at::stack(parts).sum(0);
  }

  /// The squares of the counted parameters' parts of this rank's output of bucket `b`,
  /// added to `sum` (local_totals, where some of the bucket's parameters do not count).
  [[nodiscard]] at::Tensor counted_squares(std::size_t b, const std::vector<char>& counted, at::Tensor sum) const {
    const auto& g = output(b);
    const auto begin = storage_.output_offset(b), end = begin + g.numel();
    for (auto i : layout_->buckets()[b].params) {
      if (!counted[i]) continue;
      const auto& p = layout_->params()[i];
      const auto lo = std::max(begin, p.offset), hi = std::min(end, p.offset + p.tensor.numel());
      if (lo < hi) sum = sum + g.narrow(0, lo - begin, hi - lo).norm().to(at::kDouble).square();
    }
    return sum;
  }

  /// The name of the first parameter whose sum holds NaN or Inf in this rank's part of it;
  /// empty when there is none.
  [[nodiscard]] std::string first_nonfinite() const {
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      const auto bad = at::isfinite(output(b)).logical_not().nonzero();
      if (bad.size(0) == 0) continue;
      const auto at = bad[0][0].template item<std::int64_t>() + storage_.output_offset(b);
      for (auto i : layout_->buckets()[b].params) {
        const auto& p = layout_->params()[i];
        if (at >= p.offset && at < p.offset + p.tensor.numel()) return p.name;
      }
    }
    return {};
  }

  /// After settle(): whether any rank produced a gradient for parameter `i` this step.
  [[nodiscard]] bool used_anywhere(std::size_t i) const { return used_anywhere_.at(i); }
  /// This rank's part of bucket `b`'s sum: the elements [output_offset(b), + numel) of it.
  [[nodiscard]] const at::Tensor& output(std::size_t b) const { return storage_.output(b); }
  [[nodiscard]] std::int64_t output_offset(std::size_t b) const { return storage_.output_offset(b); }
  /// Bytes of gradient storage held between steps, and the hook's own.
  [[nodiscard]] std::size_t bytes() const { return storage_.bytes() + hook_.bytes(); }

  [[nodiscard]] double exposed_seconds() const noexcept { return exposed_seconds_; }
  [[nodiscard]] std::size_t bucket_count() const noexcept { return buckets_.size(); }
  /// Where each bucket's launch and completion are reported; null (the default): nowhere,
  /// at the cost of one pointer test. Note [Zero-cost timeline].
  void set_timeline(StepTimeline* timeline) noexcept { timeline_ = timeline; }

  /// Bytes of gradients this rank handed to the step's collectives (what the hooks said
  /// they sent), since zero_grad(): the last step's.
  [[nodiscard]] std::int64_t sent_bytes() const noexcept { return sent_bytes_; }

 private:
  struct Param {
    bool ready = false;  // in this backward
    bool used = false;   // a gradient arrived since zero_grad()
    std::shared_ptr<torch::autograd::Node> accumulator;  // the variable keeps only a weak_ptr
    std::uintptr_t hook_key = 0;
  };
  struct Bucket {
    int pending = 0;
    std::optional<AnyRequest> request;
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

  // The bucket's gradients as views of its input buffer, where the storage holds one; none
  // where it does not.
  void attach(std::size_t b) {
    for (auto i : layout_->buckets()[b].params) {
      if (storage_.holds(b)) keep_grad_in_bucket(i);
      else tensor(i).mutable_grad() = at::Tensor();
    }
  }

  // The input buffer of bucket b, with every gradient of the bucket a view into it. Where a
  // pool bounds the buffers and every slot is taken, the oldest reduction in flight hands
  // its slot back first (Note [Pooled transients]); only buckets still filling (gradient
  // accumulation) make it overflow to the allocator.
  void acquire(std::size_t b) {
    if (storage_.holds(b)) return;
    for (std::size_t k = 0; !storage_.acquire(b, /*overflow=*/false) && k < buckets_.size(); ++k) complete(k);
    storage_.acquire(b, /*overflow=*/true);
    attach(b);
  }

  // Waits for bucket b's sum, if it is in flight.
  void complete(std::size_t b) {
    auto& r = buckets_[b].request;
    if (!r) return;
    r->wait();
    finished(b);
  }
  void finished(std::size_t b) {
    buckets_[b].request.reset();
    if (timeline_) timeline_->completed(b);
    storage_.completed(b);
    attach(b);  // no gradient keeps a view of a buffer the storage released
  }

  void mark_ready(std::size_t i) {
    auto& p = params_[i];
    if (p.ready) return;
    p.ready = true;
    const auto b = layout_->params()[i].bucket;
    acquire(b);
    keep_grad_in_bucket(i);
    if (--buckets_[b].pending == 0 && on_complete_) on_complete_(b);
    if (!sync_) return;
    // Note [Bucket order]: launch in index order only.
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
      if (timeline_) timeline_->launched(next_launch_);
      launch(next_launch_);
      ++next_launch_;
      if (next_launch_ < buckets_.size()) acquire(next_launch_);  // one bucket ahead
    }
    // MPI progresses only inside MPI calls (no progress thread in OpenMPI 4.1); each
    // gradient hook gives the oldest pending reduction a turn.
    for (std::size_t k = 0; k < buckets_.size(); ++k)
      if (auto& r = buckets_[k].request) {
        if (!r->test()) break;
        finished(k);
      }
  }

  void launch(std::size_t b) {
    if (input_factor_ != 1.0) {
      c10::NoGradGuard no_grad;
      storage_.input(b).mul_(input_factor_);
    }
    GradientBucket<Comm> bucket{.index = b,
                                .input = storage_.input(b),
                                .output = storage_.output(b),
                                .output_offset = storage_.output_offset(b),
                                .layout = layout_,
                                .group = ranks_[b].group,
                                .replicas = ranks_[b].replicas};
    buckets_[b].request.emplace(hook_.launch(bucket));
    sent_bytes_ += bucket.sent_bytes;
  }

  // The gradient of parameter i as a view into its bucket. If something replaced .grad
  // (autograd, when the bucket was not allocated yet; a user's zero_grad(set_to_none)),
  // the gradient is copied into the bucket and the view restored, so it is never lost.
  void keep_grad_in_bucket(std::size_t i) {
    auto& g = tensor(i).mutable_grad();
    const auto& p = layout_->params()[i];
    auto view = storage_.input(p.bucket).narrow(0, p.offset, p.tensor.numel());
    if (g.defined() && g.data_ptr() == view.data_ptr()) return;
    c10::NoGradGuard no_grad;
    if (g.defined()) view.copy_(g.reshape({-1}));
    else view.zero_();
    g = view.view(p.tensor.sizes());
  }

  const BucketLayout* layout_;
  Storage storage_;
  std::vector<SumRanks<Comm>> ranks_;  // per bucket
  AnyGradientHook<Comm> hook_;
  std::function<void(std::size_t)> on_complete_;
  std::vector<Param> params_;
  std::vector<Bucket> buckets_;
  std::vector<bool> used_anywhere_;
  std::size_t next_launch_ = 0;
  bool sync_ = true;
  double input_factor_ = 1.0;
  double exposed_seconds_ = 0;
  std::int64_t sent_bytes_ = 0;
  StepTimeline* timeline_ = nullptr;
};

}  // namespace paratrain
