#pragma once
/// \file
/// paratrain::gradient_hook — what a bucket of gradients does once all of them are ready
/// (PyTorch's `register_comm_hook`): the public seam of the bucket layer, Note [Gradient hooks].

#include <ATen/ATen.h>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <utility>

#include "paratrain/concepts/communicator.hpp"
#include "paratrain/strategy/buckets/bucket_layout.hpp"

namespace paratrain {

// Note [Gradient hooks]
// ~~~~~~~~~~~~~~~~~~~~~
// The bucket layer (GradientBuckets) knows when each bucket of gradients is complete and
// launches buckets in order (Note [Bucket order]) while backward goes on; what a launch
// does is a hook's: a value with `launch(GradientBucket&)` returning a request. The bucket
// it is given holds `input`, this rank's gradients summed over its samples (flat, padded:
// Note [Shard layout]), and `output`, where this rank's part of the sum over `group` must be
// when the request completes: `input` itself where every rank keeps whole gradients (DDP,
// ZeRO-1), its shard where each keeps one (ZeRO-2, 3), then summed across `replicas` where
// the bucket has them (hybrid sharding). Each bucket has its own `group` and `replicas` (an
// experts' and a dense bucket differ: Note [Expert buckets]), on communicators no layer uses
// (Note [Gradient communicators]): a hook sums over the bucket's, never over ranks of its
// own. The sum is then divided by the step's global sample count (Note [Exact averaging]) by
// the layer, not by the hook.
//
//   SumGradients          the sum, exactly: an all-reduce, or a reduce-scatter then (where
//                         the bucket has replicas) an all-reduce of the shard across them (default)
//   NarrowGradients       another hook over a copy in a narrower type (fp16, bf16: half the
//                         bytes; Precision::reduce is this), widened back as it completes
//   PowerSgd              rank-r compression with error feedback (Vogels et al. 2019)
//   OrderedSum            deterministic mode's sum in shard order (Note [Deterministic training])
//
// A hook owns what it keeps (PowerSGD's factors and errors, the narrowed copies in flight)
// and says what it handed to collectives in `sent_bytes`; the buffers of the gradients
// themselves are the parameter store's (WholeGradients, ShardedGradients), so a hook works
// under every store that gives it the kind of output it sums into. A hook runs on the
// thread of backward, inside autograd's post-accumulation hooks: it must not run autograd.
// The requests of one step's buckets complete in bucket order on every rank (the layer tests
// and waits them in that order), which keeps each communicator's collectives in one order.

/// The ranks a bucket's gradients are summed over (GradientBucket::group and ::replicas):
/// each bucket's own, as its parameter store says (Note [Expert buckets]).
template <class Comm>
struct SumRanks {
  Comm* group = nullptr;
  Comm* replicas = nullptr;
};

/// One bucket of gradients, as a hook sees it (PyTorch's GradBucket).
template <class Comm>
struct GradientBucket {
  /// Its place in bucket order: 0 is launched first (Note [Bucket order]).
  std::size_t index = 0;
  /// This rank's gradients of the bucket: flat, padded, in the parameters' type.
  at::Tensor input;
  /// Where this rank's part of the sum goes: `input` itself (whole()), or the elements
  /// [output_offset, output_offset + output.numel()) of the bucket (a shard).
  at::Tensor output;
  std::int64_t output_offset = 0;
  /// The parameters in it (names, shapes, offsets in `input`: layout->view(input, i)).
  const BucketLayout* layout = nullptr;
  /// The ranks whose gradients are summed into `output`.
  Comm* group = nullptr;
  /// Where a shard is held by more ranks than the group (hybrid sharding: Note [Hybrid
  /// sharding]): the ranks holding the same shard, across which it is summed next; null
  /// otherwise.
  Comm* replicas = nullptr;
  /// What the hook handed to collectives for this bucket, in bytes: it adds to it.
  std::int64_t sent_bytes = 0;

  /// Whether every rank keeps the whole sum (output is input).
  [[nodiscard]] bool whole() const { return output.is_same(input); }
  /// The bucket's parameter indices into layout->params(), in layout order.
  [[nodiscard]] const std::vector<std::size_t>& params() const { return layout->buckets()[index].params; }
  /// Whether this is the last bucket a step launches.
  [[nodiscard]] bool last() const { return index + 1 == layout->buckets().size(); }
};

/// A gradient hook for buckets summed over `Comm` (Note [Gradient hooks]): a movable value
/// whose `launch(GradientBucket<Comm>&)` starts the sum and returns a request for it.
template <class H, class Comm>
concept gradient_hook = std::movable<H> && requires(H& h, GradientBucket<Comm>& b) {
  { h.launch(b) } -> request;
};

/// Any gradient hook over `Comm`, behind one type: what a strategy holds, so that a hook is
/// chosen at run time (DataParallel::register_gradient_hook, deterministic mode).
template <class Comm>
class AnyGradientHook {
 public:
  AnyGradientHook() = default;
  template <gradient_hook<Comm> H>
    requires(!std::same_as<std::remove_cvref_t<H>, AnyGradientHook>)
  AnyGradientHook(H hook) : self_(std::make_unique<Model<H>>(std::move(hook))) {}  // NOLINT: any hook converts

  [[nodiscard]] explicit operator bool() const noexcept { return self_ != nullptr; }
  AnyRequest launch(GradientBucket<Comm>& bucket) { return self_->launch(bucket); }
  /// Bytes the hook keeps between steps (its `bytes()`, where it has one).
  [[nodiscard]] std::size_t bytes() const { return self_ ? self_->bytes() : 0; }
  /// The hook, where it is an `H`; else null.
  template <class H>
  [[nodiscard]] H* target() noexcept {
    auto* m = dynamic_cast<Model<H>*>(self_.get());
    return m != nullptr ? &m->hook : nullptr;
  }

 private:
  struct Base {
    virtual ~Base() = default;
    virtual AnyRequest launch(GradientBucket<Comm>& bucket) = 0;
    [[nodiscard]] virtual std::size_t bytes() const = 0;
  };
  template <class H>
  struct Model final : Base {
    explicit Model(H h) : hook(std::move(h)) {}
    AnyRequest launch(GradientBucket<Comm>& bucket) override { return AnyRequest(hook.launch(bucket)); }
    [[nodiscard]] std::size_t bytes() const override {
      if constexpr (requires(const H& h) { { h.bytes() } -> std::convertible_to<std::size_t>; })
        return hook.bytes();
      else
        return 0;
    }
    H hook;
  };
  std::unique_ptr<Base> self_;
};

}  // namespace paratrain
