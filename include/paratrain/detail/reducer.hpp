#pragma once
/// \file
/// The gradient reducer behind DataParallel: buckets, autograd hooks, overlap, join.

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "paratrain/comm/reduce_op.hpp"
#include "paratrain/concepts/communicator.hpp"
#include "paratrain/error.hpp"
#include "paratrain/observe/timeline.hpp"

namespace paratrain::detail {

// Note [Bucket order]
// Parameters are packed into buckets in reverse registration order (the order
// backward produces their gradients in most models), each bucket one flat buffer of
// one dtype. Every parameter's .grad is a view into its bucket, so autograd
// accumulates straight into the buffer that is all-reduced and nothing is copied.
// A bucket is launched as soon as its last gradient is ready *and* every bucket
// before it has been launched: ranks may see gradients in different orders (an
// unused parameter, a data-dependent branch), but they always launch buckets
// 0, 1, 2, ... so their collectives match without any coordination.

// Note [Exact averaging]
// Each rank back-propagates loss * n (n = its sample count this step), so its gradient
// is the sum over its samples. The buckets are summed across ranks and divided by the
// global sample count, which a small status all-reduce at the end of the step carries.
// The result is the gradient of the mean loss over the union of all ranks' samples:
// exactly what one device computes on the concatenated batch, also when ranks have
// different batch sizes, accumulate several micro-batches, or have run out of data
// (joined, n = 0).

/// Collective facts about one step, the same on every rank.
struct StepStatus {
  double samples = 0;       ///< samples across all ranks this step
  int ranks_with_next = 0;  ///< ranks that have another batch after this one
};

template <async_communicator Comm>
class Reducer {
 public:
  struct Options {
    std::size_t bucket_cap_bytes = std::size_t{25} << 20;
    std::size_t first_bucket_cap_bytes = std::size_t{1} << 20;
    bool find_unused_parameters = false;
  };

  Reducer(const torch::nn::Module& model, Comm& comm, Options options) : comm_(&comm), options_(options) {
    // A parameter shared by two modules (tied weights) is one tensor: bucket it once.
    std::set<const void*> seen;
    for (const auto& item : model.named_parameters(/*recurse=*/true))
      if (item.value().requires_grad() && seen.insert(item.value().unsafeGetTensorImpl()).second)
        params_.push_back({item.key(), item.value()});
    if (params_.empty())
      throw error("DataParallel", comm.rank(), "the model has no parameter that requires a gradient");
    std::reverse(params_.begin(), params_.end());
    build_buckets();
    install_hooks();
  }

  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;
  ~Reducer() {
    for (auto& p : params_)
      if (p.accumulator) p.accumulator->del_post_hook(p.hook_key);
  }

  /// Sets every gradient to zero, as a view into its bucket again (finish() leaves the
  /// gradients of parameters no rank used undefined, as single-device training would).
  void zero_grad() {
    for (auto& b : buckets_) b.flat.zero_();
    for (auto& p : params_) {
      keep_grad_in_bucket(p);
      p.used = false;
    }
  }

  /// Before backward: with `sync`, buckets are all-reduced as they fill; without
  /// (gradient accumulation) the hooks only let gradients accumulate.
  void prepare(bool sync) {
    sync_ = sync;
    next_launch_ = 0;
    for (auto& b : buckets_) b.pending = static_cast<int>(b.params.size());
    for (auto& p : params_) p.ready = false;
  }

  /// After backward (or instead of it, for a rank that has joined with no data):
  /// launches what is left, waits, divides by the global sample count.
  StepStatus finish(double local_samples, bool has_next, bool joined = false) {
    // [samples, ranks with a next batch, ranks with an unexpected unused parameter,
    //  then with find_unused_parameters: for each parameter, the ranks that used it]
    const bool track = options_.find_unused_parameters;
    auto status = at::zeros({3 + (track ? static_cast<std::int64_t>(params_.size()) : 0)}, at::kDouble);
    auto* s = status.data_ptr<double>();
    std::optional<std::string> unused;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      auto& p = params_[i];
      if (track && p.used) s[3 + i] = 1;
      if (!p.used && !joined && !track && !unused) unused = p.name;
      mark_ready(p);
    }
    s[0] = local_samples;
    s[1] = has_next ? 1 : 0;
    s[2] = unused ? 1 : 0;
    const auto start = std::chrono::steady_clock::now();
    for (std::size_t i = 0; i < buckets_.size(); ++i) {
      auto& b = buckets_[i];
      if (b.request) {
        b.request->wait();
        if (timeline_) timeline_->completed(i);
      }
      b.request.reset();
    }
    // On the parameters' device, where the communicator works (comm::Nccl: CUDA only).
    if (const auto device = params_.front().tensor.device(); device.is_cpu()) {
      comm_->all_reduce(status, reduce_op::sum);
    } else {
      auto on_device = status.to(device);
      comm_->all_reduce(on_device, reduce_op::sum);
      status.copy_(on_device);
    }
    exposed_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    // A parameter no rank used has no gradient, so the optimizer leaves it alone
    // (weight decay and momentum included), exactly as on a single device.
    if (track)
      for (std::size_t i = 0; i < params_.size(); ++i)
        if (s[3 + i] == 0) params_[i].tensor.mutable_grad() = at::Tensor();
    if (s[2] > 0)
      throw error("DataParallel", comm_->rank(),
                  unused ? "parameter '" + *unused +
                               "' received no gradient in this step; enable "
                               "DataParallel::Options::find_unused_parameters if some parameters are legitimately "
                               "unused in some steps, or make every parameter take part in the loss"
                         : std::to_string(static_cast<int>(s[2])) +
                               " other rank(s) found a parameter without gradient (see their message); enable "
                               "DataParallel::Options::find_unused_parameters if that is expected");
    if (s[0] > 0)
      for (auto& b : buckets_) b.flat.div_(s[0]);
    return {s[0], static_cast<int>(s[1])};
  }

  /// Seconds the last finish() spent waiting for communication that backward did not hide.
  [[nodiscard]] double exposed_seconds() const noexcept { return exposed_seconds_; }
  [[nodiscard]] std::size_t bucket_count() const noexcept { return buckets_.size(); }
  /// Where each bucket's launch and completion are reported; null (the default): nowhere,
  /// at the cost of one pointer test. Note [Zero-cost timeline].
  void set_timeline(observe::StepTimeline* timeline) noexcept { timeline_ = timeline; }
  /// The parameter names of bucket `i`, in the order they are laid out.
  [[nodiscard]] std::vector<std::string> bucket_names(std::size_t i) const {
    std::vector<std::string> names;
    for (auto p : buckets_.at(i).params) names.push_back(params_[p].name);
    return names;
  }

 private:
  using Request = decltype(std::declval<Comm&>().iall_reduce(std::declval<at::Tensor&>(), reduce_op::sum));

  struct Param {
    std::string name;
    at::Tensor tensor;
    std::size_t bucket = 0;
    std::int64_t offset = 0;  // in the bucket's flat buffer
    bool ready = false;  // in this backward
    bool used = false;   // a gradient arrived since zero_grad()
    std::shared_ptr<torch::autograd::Node> accumulator;  // the variable keeps only a weak_ptr
    std::uintptr_t hook_key = 0;
  };
  struct Bucket {
    at::Tensor flat;
    std::vector<std::size_t> params;
    int pending = 0;
    std::optional<Request> request;
  };

  // Fires after autograd has accumulated the parameter's gradient into its view.
  struct ReadyHook final : torch::autograd::FunctionPostHook {
    ReadyHook(Reducer* r, std::size_t i) : reducer(r), index(i) {}
    torch::autograd::variable_list operator()(const torch::autograd::variable_list& grad_inputs,
                                              const torch::autograd::variable_list&) override {
      auto& p = reducer->params_[index];
      p.used = true;
      reducer->mark_ready(p);
      return grad_inputs;
    }
    Reducer* reducer;
    std::size_t index;
  };

  void build_buckets() {
    std::size_t cap = options_.first_bucket_cap_bytes;
    std::vector<std::vector<std::size_t>> groups;
    std::vector<std::size_t> bytes;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const auto& t = params_[i].tensor;
      const bool fits = !groups.empty() && bytes.back() < cap &&
                        params_[groups.back().front()].tensor.scalar_type() == t.scalar_type();
      if (!fits) {
        if (!groups.empty()) cap = options_.bucket_cap_bytes;
        groups.emplace_back();
        bytes.push_back(0);
      }
      groups.back().push_back(i);
      bytes.back() += static_cast<std::size_t>(t.numel() * t.element_size());
    }
    at::NoGradGuard no_grad;
    for (auto& group : groups) {
      std::int64_t numel = 0;
      for (auto i : group) numel += params_[i].tensor.numel();
      auto& b = buckets_.emplace_back();
      b.flat = at::zeros({numel}, params_[group.front()].tensor.options().requires_grad(false));
      b.params = group;
      std::int64_t offset = 0;
      for (auto i : group) {
        auto& p = params_[i];
        p.bucket = buckets_.size() - 1;
        p.offset = offset;
        auto view = b.flat.narrow(0, offset, p.tensor.numel()).view_as(p.tensor);
        if (p.tensor.grad().defined()) view.copy_(p.tensor.grad());
        p.tensor.mutable_grad() = view;
        offset += p.tensor.numel();
      }
    }
  }

  void install_hooks() {
    for (std::size_t i = 0; i < params_.size(); ++i) {
      auto& p = params_[i];
      p.accumulator = torch::autograd::impl::grad_accumulator(p.tensor);
      p.hook_key = p.accumulator->add_post_hook(std::make_unique<ReadyHook>(this, i));
    }
  }

  void mark_ready(Param& p) {
    if (p.ready) return;
    p.ready = true;
    keep_grad_in_bucket(p);
    --buckets_[p.bucket].pending;
    if (!sync_) return;
    // Note [Bucket order]: launch in index order only.
    while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
      auto& b = buckets_[next_launch_++];
      if (timeline_) timeline_->launched(next_launch_ - 1);
      b.request.emplace(comm_->iall_reduce(b.flat, reduce_op::sum));
    }
    // MPI progresses only inside MPI calls (no progress thread in OpenMPI 4.1); each
    // gradient hook gives the oldest pending all-reduce a turn.
    for (std::size_t i = 0; i < buckets_.size(); ++i)
      if (auto& b = buckets_[i]; b.request) {
        if (!b.request->test()) break;
        if (timeline_) timeline_->completed(i);
      }
  }

  // If something replaced .grad (a user's zero_grad(set_to_none), say), the gradient
  // is copied back into the bucket and the view restored, so it is never lost.
  void keep_grad_in_bucket(Param& p) {
    auto& g = p.tensor.mutable_grad();
    auto view = buckets_[p.bucket].flat.narrow(0, p.offset, p.tensor.numel());
    if (g.defined() && g.data_ptr() == view.data_ptr()) return;
    at::NoGradGuard no_grad;
    if (g.defined()) view.copy_(g.reshape({-1}));
    else view.zero_();
    g = view.view_as(p.tensor);
  }

  Comm* comm_;
  Options options_;
  std::vector<Param> params_;
  std::vector<Bucket> buckets_;
  std::size_t next_launch_ = 0;
  bool sync_ = true;
  double exposed_seconds_ = 0;
  observe::StepTimeline* timeline_ = nullptr;
};

}  // namespace paratrain::detail
