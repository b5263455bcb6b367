#pragma once
/// \file
/// paratrain::PowerSgd — a gradient hook that sends each gradient matrix as two thin
/// factors (Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient
/// Compression for Distributed Optimization", NeurIPS 2019; PyTorch's powerSGD_hook).

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "paratrain/concepts/communicator.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/core/reduce_op.hpp"
#include "paratrain/strategy/buckets/gradient_hook.hpp"
#include "paratrain/strategy/buckets/hooks.hpp"
#include "paratrain/strategy/detail/tensor_bytes.hpp"
#include "paratrain/util/fnv1a.hpp"

namespace paratrain {

// Note [PowerSGD]
// ~~~~~~~~~~~~~~~
// Each gradient of two or more dimensions is a matrix M (n × m: its first dimension by the
// rest) whose sum over the ranks is sent as the product of two thin ones, rank r:
//   P = M Q                  (Q: m × r, the last step's, or drawn at random the first time)
//   P <- sum of P over ranks, then orthogonalised (Gram-Schmidt, column by column)
//   Q = Mᵀ P;  Q <- sum of Q over ranks
//   sum of M ≈ P Qᵀ
// two all-reduces of (n + m) r elements instead of one of n m: one power iteration, warm-
// started from the last step's Q, which converges across steps (Vogels et al., section 3).
// A matrix too small to gain (n m ≤ (n + m) r × min_compression_rate) and every vector (a
// bias) is summed exactly, in the first all-reduce with the Ps. With error feedback, what
// the approximation left out is added to the next step's gradient: each rank keeps
// e = (M + e) - (P Qᵀ) / W, so that the ranks' errors add up to the sum's (W ranks). Sums,
// not means: the bucket layer divides by the step's samples afterwards, as for every hook
// (Note [Exact averaging]); PyTorch's hook, which averages, keeps e = (M + e) - P Qᵀ/W
// likewise. For the first `start_step` steps every bucket is summed exactly (PyTorch's
// start_powerSGD_iter): compressing from the first step hurts accuracy (section 4.2).
// Random Qs are drawn from a generator seeded with initial_seed(seed, name, step) for each
// gradient (its parameter's name), so every rank draws the same, whatever the bucketing;
// every Q, drawn or kept from the last step, is orthogonalised before P = M Q (as PyTorch's
// hook: the same P after orthogonalisation, and Q's scale does not grow across steps).

/// PowerSgd's settings; the defaults are PyTorch's, but start_step (its start_powerSGD_iter,
/// 1000 by default there, which suits long runs).
struct PowerSgdOptions {
  int rank = 1;                  ///< r, the factors' width (matrix_approximation_rank)
  std::int64_t start_step = 10;  ///< steps summed exactly before compressing
  double min_compression_rate = 2;
  bool error_feedback = true;
  bool warm_start = true;        ///< each step's Q starts from the last's
  double orthogonalization_epsilon = 0;
  std::uint64_t seed = 0;
};

/// PowerSGD gradient compression (Note [PowerSGD]) for strategies that keep whole gradients
/// (DDP, zero::stage1). Every rank registers it alike.
///
/// \code
///   strategy.register_gradient_hook(paratrain::PowerSgd({.rank = 4, .start_step = 100}));
/// \endcode
class PowerSgd {
 public:
  /// It sums whole buckets: refused where a strategy keeps a shard of each (ZeRO-2, 3).
  static constexpr bool whole_gradients_only = true;

  explicit PowerSgd(PowerSgdOptions options = {}) : options_(options) {
    if (options.rank < 1)
      throw error("PowerSgd", -1, "PowerSgdOptions::rank is " + std::to_string(options.rank) + "; it is at least 1");
    if (options.start_step < 0 || options.min_compression_rate < 0 || options.orthogonalization_epsilon < 0)
      throw error("PowerSgd", -1, "PowerSgdOptions::start_step, min_compression_rate and orthogonalization_epsilon "
                                  "are 0 or more");
  }

  /// The seed of the random Q of the gradient of parameter `name` drawn in step `step`
  /// (counted from 0): splitmix64 over the three. Public, so that a reference written
  /// without paratrain draws the same.
  [[nodiscard]] static std::uint64_t initial_seed(std::uint64_t seed, const std::string& name,
                                                  std::int64_t step) noexcept {
    detail::Fnv1a h;
    for (const char c : name) h.mix(static_cast<std::uint64_t>(static_cast<unsigned char>(c)));
    auto mix = [](std::uint64_t z) {
      z += 0x9e3779b97f4a7c15ULL;
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
      return z ^ (z >> 31);
    };
    return mix(mix(mix(seed) ^ h.value62()) ^ static_cast<std::uint64_t>(step));
  }

  /// Orthogonalises the columns of `p` (n × r) in place, Gram-Schmidt, as PyTorch's hook:
  /// each column divided by its norm (plus `epsilon`; a zero column stays zero), then taken
  /// out of the columns after it.
  static void orthogonalize(at::Tensor& p, double epsilon) {
    for (std::int64_t i = 0; i < p.size(1); ++i) {
      auto col = p.narrow(1, i, 1);
      const auto norm = col.norm();
      col.div_(at::where(norm > 0, norm + epsilon, at::ones_like(norm)));
      if (i + 1 < p.size(1)) {
        auto rest = p.narrow(1, i + 1, p.size(1) - i - 1);
        rest.sub_((col * rest).sum(0, /*keepdim=*/true) * col);
      }
    }
  }

  template <async_communicator Comm>
  AnyRequest launch(GradientBucket<Comm>& b) {
    if (!b.whole())
      throw error("PowerSgd", b.group->rank(), "compresses whole buckets, and this one's output is a shard");
    const auto step = steps_;  // this step's, counted from 0
    if (b.last()) ++steps_;
    if (step < options_.start_step) return SumGradients{}.launch(b);
    auto& state = buckets_[b.index];
    if (state.matrices.empty() && state.vectors.empty()) plan(b, state);
    // The exact elements with the Ps, then the Qs: what the two all-reduces send.
    std::int64_t elements = state.exact;
    for (const auto& mat : state.matrices) elements += (mat.n + mat.m) * mat.r;
    b.sent_bytes += elements * static_cast<std::int64_t>(b.input.element_size());
    return Request<Comm>(this, &state, b, step);
  }

  /// The factors, errors and matrices' plans it keeps between steps, in bytes.
  [[nodiscard]] std::size_t bytes() const {
    std::size_t n = 0;
    for (const auto& [index, s] : buckets_) {
      n += detail::bytes_of(s.error);
      for (const auto& q : s.qs) n += detail::bytes_of(q);
    }
    return n;
  }
  /// Steps it has seen (a step is counted when its last bucket is launched).
  [[nodiscard]] std::int64_t steps() const noexcept { return steps_; }
  [[nodiscard]] const PowerSgdOptions& options() const noexcept { return options_; }

 private:
  // One compressed gradient: its elements [offset, offset + n m) of the bucket, as n × m.
  struct Matrix {
    std::int64_t offset = 0, n = 0, m = 0, r = 0;
    std::string name;
  };
  // One exactly summed range of the bucket: a vector, a small matrix, the padding.
  struct Range {
    std::int64_t offset = 0, numel = 0;
  };
  struct Bucket {
    std::vector<Matrix> matrices;
    std::vector<Range> vectors;
    std::int64_t exact = 0;  // elements summed exactly
    at::Tensor error;        // error feedback: the bucket's elements
    std::vector<at::Tensor> qs;  // warm start: each matrix's last Q (m × r)
  };

  template <class Comm>
  void plan(const GradientBucket<Comm>& b, Bucket& state) const {
    const auto& layout = *b.layout;
    std::int64_t covered = 0;
    for (auto i : b.params()) {
      const auto& p = layout.params()[i];
      const auto numel = p.tensor.numel();
      const std::int64_t n = p.tensor.dim() >= 2 ? p.tensor.size(0) : 0, m = n > 0 ? numel / n : 0;
      const std::int64_t r = std::min<std::int64_t>({options_.rank, n, m});
      if (n > 0 && static_cast<double>((n + m) * r) * options_.min_compression_rate < static_cast<double>(n * m))
        state.matrices.push_back({p.offset, n, m, r, p.name});
      else
        state.vectors.push_back({p.offset, numel});
      covered = std::max(covered, p.offset + numel);
    }
    if (covered < b.input.numel()) state.vectors.push_back({covered, b.input.numel() - covered});  // padding
    for (const auto& v : state.vectors) state.exact += v.numel;
  }

  // The two all-reduces of one bucket, and the work between and after them.
  template <class Comm>
  class Request {
   public:
    Request(PowerSgd* hook, Bucket* state, GradientBucket<Comm>& b, std::int64_t step)
        : hook_(hook), state_(state), bucket_(b) {
      c10::NoGradGuard no_grad;
      const auto& o = hook_->options_;
      auto& in = bucket_.input;
      if (o.error_feedback) {
        if (!state_->error.defined()) state_->error = at::zeros_like(in);
        in.add_(state_->error);
        local_ = in.clone();  // M + e: what the error is measured against
      }
      // [exact elements, P_1, P_2, ...] in one buffer, one all-reduce.
      std::int64_t total = state_->exact;
      for (const auto& mat : state_->matrices) total += mat.n * mat.r;
      first_buffer_ = at::empty({total}, in.options());
      std::int64_t at = 0;
      for (const auto& v : state_->vectors) {
        first_buffer_.narrow(0, at, v.numel).copy_(in.narrow(0, v.offset, v.numel));
        at += v.numel;
      }
      if (state_->qs.size() != state_->matrices.size() || !o.warm_start) state_->qs.assign(state_->matrices.size(), {});
      for (std::size_t j = 0; j < state_->matrices.size(); ++j) {
        const auto& mat = state_->matrices[j];
        auto& q = state_->qs[j];
        if (!q.defined()) {
          auto g = at::make_generator<at::CPUGeneratorImpl>(initial_seed(o.seed, mat.name, step));
          q = at::randn({mat.m, mat.r}, g, at::TensorOptions(at::kFloat)).to(in.options());
        }
        orthogonalize(q, o.orthogonalization_epsilon);  // the last step's too, as PyTorch's hook
        auto p = first_buffer_.narrow(0, at, mat.n * mat.r).view({mat.n, mat.r});
        at::mm_out(p, matrix(in, mat), q);
        at += mat.n * mat.r;
      }
      first_.emplace(bucket_.group->iall_reduce(first_buffer_, reduce_op::sum));
    }

    void wait() {
      if (done_) return;
      if (!second_) {
        first_->wait();
        after_first();
      }
      second_->wait();
      after_second();
    }
    bool test() {
      if (done_) return true;
      if (!second_) {
        if (!first_->test()) return false;
        after_first();
      }
      if (!second_->test()) return false;
      after_second();
      return true;
    }

   private:
    using Inner = decltype(std::declval<Comm&>().iall_reduce(std::declval<at::Tensor&>(), reduce_op::sum));

    static at::Tensor matrix(const at::Tensor& flat, const Matrix& mat) {
      return flat.narrow(0, mat.offset, mat.n * mat.m).view({mat.n, mat.m});
    }

    // The Ps are summed: orthogonalised, each Q = Mᵀ P, and the Qs summed next.
    void after_first() {
      c10::NoGradGuard no_grad;
      const auto& o = hook_->options_;
      const auto& in = bucket_.input;
      std::int64_t total = 0;
      for (const auto& mat : state_->matrices) total += mat.m * mat.r;
      second_buffer_ = at::empty({total}, in.options());
      std::int64_t at = state_->exact, qat = 0;
      for (std::size_t j = 0; j < state_->matrices.size(); ++j) {
        const auto& mat = state_->matrices[j];
        auto p = first_buffer_.narrow(0, at, mat.n * mat.r).view({mat.n, mat.r});
        orthogonalize(p, o.orthogonalization_epsilon);
        auto q = second_buffer_.narrow(0, qat, mat.m * mat.r).view({mat.m, mat.r});
        at::mm_out(q, matrix(in, mat).t(), p);
        at += mat.n * mat.r;
        qat += mat.m * mat.r;
      }
      second_.emplace(bucket_.group->iall_reduce(second_buffer_, reduce_op::sum));
    }

    // The sums: the exact ones copied back, each matrix's approximated by P Qᵀ; the error kept.
    void after_second() {
      c10::NoGradGuard no_grad;
      done_ = true;
      const auto& o = hook_->options_;
      auto& out = bucket_.output;
      std::int64_t at = 0;
      for (const auto& v : state_->vectors) {
        out.narrow(0, v.offset, v.numel).copy_(first_buffer_.narrow(0, at, v.numel));
        at += v.numel;
      }
      std::int64_t qat = 0;
      for (std::size_t j = 0; j < state_->matrices.size(); ++j) {
        const auto& mat = state_->matrices[j];
        const auto p = first_buffer_.narrow(0, at, mat.n * mat.r).view({mat.n, mat.r});
        const auto q = second_buffer_.narrow(0, qat, mat.m * mat.r).view({mat.m, mat.r});
        auto approx = matrix(out, mat);
        at::mm_out(approx, p, q.t());
        if (o.warm_start) state_->qs[j] = q.clone();
        at += mat.n * mat.r;
        qat += mat.m * mat.r;
      }
      if (o.error_feedback) {
        // e = (M + e) - sum / W on the compressed elements; the exact ones leave no error.
        const double ranks = bucket_.group->size();
        auto& e = state_->error;
        e.copy_(local_).sub_(out, 1.0 / ranks);
        for (const auto& v : state_->vectors) e.narrow(0, v.offset, v.numel).zero_();
      }
      first_buffer_ = second_buffer_ = local_ = at::Tensor();
    }

    PowerSgd* hook_;
    Bucket* state_;
    GradientBucket<Comm> bucket_;
    at::Tensor local_, first_buffer_, second_buffer_;
    std::optional<Inner> first_, second_;
    bool done_ = false;
  };

  PowerSgdOptions options_;
  std::map<std::size_t, Bucket> buckets_;
  std::int64_t steps_ = 0;
};

}  // namespace paratrain
