#pragma once
/// \file
/// Where a bucket's gradients accumulate and where their sum is kept: WholeGradients (every
/// rank the whole sum: DDP, ZeRO-1) and ShardedGradients (each rank its shard, the whole
/// bucket only while it fills and is reduced: ZeRO-2, 3). A parameter store names its own.

#include <ATen/ATen.h>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "paratrain/strategy/buckets/bucket_layout.hpp"
#include "paratrain/memory/slot_pool.hpp"
#include "paratrain/strategy/detail/tensor_bytes.hpp"

namespace paratrain {

// Note [Transient memory]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Sharded (ZeRO 2, 3), a bucket's whole-size gradient buffer exists only while it is
// needed: acquired when its first gradient arrives (or one bucket ahead of the launch,
// so that autograd writes into it directly), and released as soon as its reduce-scatter
// has completed and left this rank's shard, which the gradient hooks test in order while
// backward runs; the rest are released when the step's collectives are waited for. The
// whole buffers alive at once are then those of the buckets whose gradients are still
// arriving or in flight, not the whole model's: at most three, from a pool (Note [Pooled
// transients]), which paratrain::plan::peak counts (Note [Peak memory model]).

/// What GradientBuckets asks of the buffers of a BucketLayout's gradients:
/// - `holds(b)`: whether bucket b's input buffer exists now;
/// - `acquire(b, overflow)`: makes it (zeroed) where it does not, from a pool where one
///   bounds them; false when the pool has no room and `overflow` is false (the layer then
///   completes the oldest reduction in flight and asks again, Note [Pooled transients]);
/// - `input(b)`: the buffer the bucket's gradients accumulate in (the parameters' .grad are
///   views of it); `output(b)`, `output_offset(b)`: where this rank's part of the sum is;
/// - `completed(b)`: bucket b's sum is in output(b); `clear(b)`: a new step's gradients start;
/// - `bytes()`: what it holds between steps.
template <class S>
concept gradient_storage = requires(S& s, const S& cs, std::size_t b) {
  { cs.holds(b) } -> std::same_as<bool>;
  { s.acquire(b, true) } -> std::same_as<bool>;
  { cs.input(b) } -> std::same_as<const at::Tensor&>;
  { cs.output(b) } -> std::same_as<const at::Tensor&>;
  { cs.output_offset(b) } -> std::same_as<std::int64_t>;
  s.completed(b);
  s.clear(b);
  { cs.bytes() } -> std::same_as<std::size_t>;
};

/// Every rank keeps each bucket whole: one buffer a bucket, made once, into which
/// gradients accumulate and in which their sum is left (DDP, ZeRO-1).
class WholeGradients {
 public:
  explicit WholeGradients(const BucketLayout& layout) {
    for (std::size_t b = 0; b < layout.buckets().size(); ++b) buffers_.push_back(layout.zeros(b));
  }
  [[nodiscard]] bool holds(std::size_t) const noexcept { return true; }
  bool acquire(std::size_t, bool) noexcept { return true; }
  [[nodiscard]] const at::Tensor& input(std::size_t b) const { return buffers_[b]; }
  [[nodiscard]] const at::Tensor& output(std::size_t b) const { return buffers_[b]; }
  [[nodiscard]] std::int64_t output_offset(std::size_t) const noexcept { return 0; }
  void completed(std::size_t) noexcept {}
  void clear(std::size_t b) { buffers_[b].zero_(); }
  [[nodiscard]] std::size_t bytes() const {
    std::size_t n = 0;
    for (const auto& t : buffers_) n += detail::bytes_of(t);
    return n;
  }

 private:
  std::vector<at::Tensor> buffers_;
};

/// Each rank keeps its shard of each bucket's sum (Note [Shard layout]): shard `index[b]` of
/// bucket b (its rank among those the bucket is sharded over); the whole bucket exists from
/// its first gradient until its sum is reduced into the shard (Note [Transient memory]), in
/// one of three pooled slots where it fits.
class ShardedGradients {
 public:
  ShardedGradients(const BucketLayout& layout, std::vector<int> index) : layout_(&layout), index_(std::move(index)) {
    std::size_t largest = 0;
    for (std::size_t b = 0; b < layout.buckets().size(); ++b) {
      shards_.push_back(at::zeros({layout.shard_numel(b)}, layout.buckets()[b].options));
      largest = std::max(largest, bytes_of_bucket(b));
    }
    inputs_.resize(shards_.size());
    slots_.assign(shards_.size(), -1);
    // Note [Pooled transients]: the one filling, the one ahead of it, the one in flight.
    pool_ = memory::SlotPool(largest, 3, layout.buckets().front().options.device());
  }
  [[nodiscard]] bool holds(std::size_t b) const { return inputs_[b].defined(); }
  bool acquire(std::size_t b, bool overflow) {
    if (holds(b)) return true;
    const auto& bucket = layout_->buckets()[b];
    slots_[b] = pool_.acquire(bytes_of_bucket(b));
    if (slots_[b] < 0 && !overflow) return false;
    inputs_[b] = slots_[b] >= 0 ? pool_.view(slots_[b], 0, bucket.padded, bucket.options).zero_() : layout_->zeros(b);
    return true;
  }
  [[nodiscard]] const at::Tensor& input(std::size_t b) const { return inputs_[b]; }
  [[nodiscard]] const at::Tensor& output(std::size_t b) const { return shards_[b]; }
  [[nodiscard]] std::int64_t output_offset(std::size_t b) const { return index_[b] * layout_->shard_numel(b); }
  /// Its shard is reduced: the whole buffer goes (Note [Transient memory]).
  void completed(std::size_t b) { release(b); }
  void clear(std::size_t b) { release(b); }
  /// The shards (the whole buffers are the pool's, counted by the plan as transients).
  [[nodiscard]] std::size_t bytes() const {
    std::size_t n = 0;
    for (const auto& t : shards_) n += detail::bytes_of(t);
    return n;
  }

 private:
  [[nodiscard]] std::size_t bytes_of_bucket(std::size_t b) const {
    const auto& bucket = layout_->buckets()[b];
    return static_cast<std::size_t>(bucket.padded) * bucket.options.dtype().itemsize();
  }
  void release(std::size_t b) {
    inputs_[b] = at::Tensor();
    pool_.release(std::exchange(slots_[b], -1));
  }

  const BucketLayout* layout_;
  std::vector<int> index_;
  std::vector<at::Tensor> shards_, inputs_;
  std::vector<int> slots_;  // the pool's slot each input is in; -1: the allocator's
  memory::SlotPool pool_;
};

static_assert(gradient_storage<WholeGradients>);
static_assert(gradient_storage<ShardedGradients>);

}  // namespace paratrain
