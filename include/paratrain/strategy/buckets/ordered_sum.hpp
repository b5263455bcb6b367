#pragma once
/// \file
/// paratrain::OrderedSum — deterministic mode's gradient hook: each bucket's shard gradients
/// gathered from every rank as the bucket completes in backward, and added in shard order
/// (Note [Deterministic training]).

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "paratrain/concepts/communicator.hpp"
#include "paratrain/strategy/buckets/gradient_hook.hpp"
#include "paratrain/strategy/buckets/hooks.hpp"
#include "paratrain/strategy/detail/tensor_bytes.hpp"

namespace paratrain {

/// The sum of a step's shard gradients in shard order, round by round (Note [Deterministic
/// training]): rank r of the W ranks of `data` computes shards r, r + W, ... one round each;
/// as each bucket of a round's backward completes, every rank's gradient of it is all-gathered
/// (a collective that moves bytes and adds nothing), and, when the gather completes, added
/// to the step's sums in rank order, which is the shards' order: acc = g_0; acc += g_1; ...
/// (a first round of two ranks is one pair, g_0 + g_1, which an all-reduce computes exactly).
/// The last round writes the step's gradients (the bucket's output) directly, unless the
/// whole sums of a sharded bucket are to be kept (deterministic clipping reads them), which
/// are then kept and this rank's shard copied out of them. The gathers overlap backward as
/// DDP's all-reduces do.
template <class Comm>
class OrderedSum {
 public:
  explicit OrderedSum(Comm& data) : data_(&data) {}

  /// Before each round's backward: whether it is the step's first and last, and whether the
  /// whole sums are kept where the gradients are sharded (clipping's norm reads them).
  void begin_round(bool first, bool last, bool keep_whole) {
    first_ = first;
    last_ = last;
    keep_whole_ = keep_whole;
    if (first) {
      whole_.clear();
      kept_.clear();
    }
  }

  AnyRequest launch(GradientBucket<Comm>& b) {
    layout_ = b.layout;
    const int ranks = data_->size();
    const auto n = b.input.numel();
    if (ranks == 1) {  // one rank: its own gradient is the round's only row, no copy
      add(b, b.input.view({1, n}));
      return {};
    }
    b.sent_bytes += n * static_cast<std::int64_t>(b.input.element_size());
    if (ranks == 2 && first_) {
      // Two rows starting the sum: row 0 + row 1, the same in either order (IEEE addition
      // commutes; it is their grouping that changes a sum), which is what any all-reduce of
      // two ranks computes, element by element. So the pair is summed in place by the
      // communicator's all-reduce, overlapped as DDP's is, and is the round's one row.
      return detail::Then(data_->iall_reduce(b.input, reduce_op::sum), [this, b, n] { add(b, b.input.view({1, n})); });
    }
    auto all = at::empty({n * ranks}, b.input.options());
    if constexpr (async_sharding_communicator<Comm>) {
      return detail::Then(data_->iall_gather(b.input, all), [this, b, all, ranks, n] { add(b, all.view({ranks, n})); });
    } else {
      data_->all_gather(b.input, all);
      add(b, all.view({ranks, n}));
      return {};
    }
  }

  /// After the last round: the squares (when `squares`) and the NaN and Inf elements (when
  /// `nonfinite`) of the whole sums every rank holds, per parameter in layout order, in
  /// double: the same bits at every world size and stage. Empty where the sums are sharded
  /// and were not kept whole.
  [[nodiscard]] std::optional<std::pair<double, double>> totals(bool squares, bool nonfinite) const {
    if (layout_ == nullptr || whole_.size() != layout_->buckets().size()) return std::nullopt;
    std::vector<at::Tensor> square_sums, counts;
    for (const auto& p : layout_->params()) {
      const auto& sum = whole_[p.bucket];
      if (!sum.defined()) return std::nullopt;
      const auto g = sum.narrow(0, p.offset, p.tensor.numel()).to(at::kDouble);
      if (squares) square_sums.push_back(g.square().sum());
      if (nonfinite) counts.push_back(at::isfinite(g).logical_not().sum());
    }
    std::pair<double, double> out{0, 0};
    if (squares) out.first = at::stack(square_sums).sum().cpu().template item<double>();
    if (nonfinite) out.second = static_cast<double>(at::stack(counts).sum().cpu().template item<std::int64_t>());
    return out;
  }

  /// Divides the whole sums kept beside sharded gradients (the gradients themselves are the
  /// bucket layer's to divide).
  void divide(double divisor) {
    for (std::size_t b = 0; b < whole_.size(); ++b)
      if (kept_[b]) whole_[b].div_(divisor);
  }

  /// The sums kept between steps for reuse.
  [[nodiscard]] std::size_t bytes() const {
    std::size_t n = 0;
    for (const auto& s : sums_) n += detail::bytes_of(s);
    return n;
  }

 private:
  // The round's `rows` (one per rank, in rank order) of bucket b, added to the step's sums.
  void add(const GradientBucket<Comm>& b, at::Tensor rows) {
    c10::NoGradGuard no_grad;
    const bool whole = keep_whole_ || b.whole();
    if (!whole) rows = rows.narrow(1, b.output_offset, b.output.numel());  // this rank's shard only
    // Where the last round's sums go directly: the step's gradients, unless the whole sums
    // of a sharded bucket are kept (then this rank's shard is copied out of them).
    const bool direct = last_ && (b.whole() || !keep_whole_);
    if (sums_.size() <= b.index) sums_.resize(b.index + 1);
    auto& sum = sums_[b.index];
    if (!direct && (!sum.defined() || sum.numel() != rows.size(1))) sum = at::empty({rows.size(1)}, rows.options());
    auto target = direct ? b.output : sum;
    // target = sum + row 0 (or row 0), then + row 1, ...: one addition at a time, in order.
    std::int64_t r = 1;
    if (!first_) {
      at::add_out(target, sum, rows[0]);
    } else if (rows.size(0) > 1) {
      at::add_out(target, rows[0], rows[1]);  // row 0 + row 1 in one pass, not a copy and an addition
      r = 2;
    } else if (target.data_ptr() != rows[0].data_ptr()) {
      target.copy_(rows[0]);  // one row (one rank, or a pair summed already): there already when direct
    }
    for (; r < rows.size(0); ++r) target.add_(rows[r]);
    if (!last_) return;
    if (!direct) b.output.copy_(sum.narrow(0, b.output_offset, b.output.numel()));
    if (whole_.size() <= b.index) {
      whole_.resize(b.index + 1);
      kept_.resize(b.index + 1);
    }
    whole_[b.index] = whole ? target : at::Tensor();
    kept_[b.index] = whole && !direct;
  }

  Comm* data_;
  const BucketLayout* layout_ = nullptr;
  bool first_ = true, last_ = true, keep_whole_ = false;
  std::vector<at::Tensor> sums_;   // by bucket: the sums of the rounds so far (whole, or this rank's shard)
  std::vector<at::Tensor> whole_;  // by bucket, after the last round: the whole sums, where kept
  std::vector<bool> kept_;         // whether whole_[b] is a sum of its own (not the gradients themselves)
};

}  // namespace paratrain
