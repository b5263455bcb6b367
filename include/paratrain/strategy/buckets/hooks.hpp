#pragma once
/// \file
/// The gradient hooks every strategy can use (Note [Gradient hooks]): SumGradients, the exact
/// sum (all-reduce, or reduce-scatter across a hybrid sharding's replicas), and
/// NarrowGradients, another hook over a copy in fp16 or bf16 (PyTorch's fp16/bf16 compression).

#include <ATen/ATen.h>
#include <c10/core/ScalarType.h>

#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "paratrain/concepts/communicator.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/core/reduce_op.hpp"
#include "paratrain/strategy/buckets/gradient_hook.hpp"

namespace paratrain {

namespace detail {

/// A request, then `then()` once, when it completes: what a hook does with a result (copy
/// it back, add it in order) as soon as it is there.
template <request R>
class Then {
 public:
  Then(R inner, std::function<void()> then) : inner_(std::move(inner)), then_(std::move(then)) {}

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
    done_ = true;
    std::exchange(then_, {})();  // and drops what it held
  }
  R inner_;
  std::function<void()> then_;
  bool done_ = false;
};

/// A request, then (hybrid sharding: Note [Hybrid sharding]) the all-reduce of the shard
/// across the replicas, started when the first completes.
template <request R, class Comm>
class AcrossReplicas {
 public:
  AcrossReplicas(R first, Comm& replicas, at::Tensor shard)
      : first_(std::move(first)), replicas_(&replicas), shard_(std::move(shard)) {}

  void wait() {
    if (!second_) {
      first_.wait();
      second_.emplace(replicas_->iall_reduce(shard_, reduce_op::sum));
    }
    second_->wait();
  }
  bool test() {
    if (!second_) {
      if (!first_.test()) return false;
      second_.emplace(replicas_->iall_reduce(shard_, reduce_op::sum));
    }
    return second_->test();
  }

 private:
  using Second = decltype(std::declval<Comm&>().iall_reduce(std::declval<at::Tensor&>(), reduce_op::sum));
  R first_;
  Comm* replicas_;
  at::Tensor shard_;
  std::optional<Second> second_;
};

}  // namespace detail

/// The exact sum (the default hook): an all-reduce of the bucket where every rank keeps it
/// whole; a reduce-scatter into this rank's shard where it keeps a shard (Note [Shard
/// layout]), then, sharded in groups, the shard's all-reduce across the replicas (Note
/// [Hybrid sharding]). In the bucket's type.
struct SumGradients {
  template <async_communicator Comm>
  AnyRequest launch(GradientBucket<Comm>& b) const {
    b.sent_bytes += static_cast<std::int64_t>(b.input.nbytes());
    if (b.whole()) return b.group->iall_reduce(b.input, reduce_op::sum);
    if constexpr (async_sharding_communicator<Comm>) {
      auto first = b.group->ireduce_scatter(b.input, b.output, reduce_op::sum);
      if (b.replicas == nullptr) return first;
      return detail::AcrossReplicas(std::move(first), *b.replicas, b.output);
    } else {
      throw error("SumGradients", b.group->rank(),
                  "the bucket's output is a shard, and this communicator has no ireduce_scatter");
    }
  }
};

/// Another hook (`Inner`, SumGradients by default) over a copy of the bucket in a narrower
/// type, `wire` (at::kHalf or at::kBFloat16): half the bytes of fp32, each element rounded
/// to `wire` before the sum and the sum computed in `wire`, then widened back into the
/// bucket's output as the request completes: PyTorch's fp16_compress_hook and
/// bf16_compress_hook (and their wrappers of other hooks). A bucket already in `wire` goes
/// to `Inner` as it is. fp16 keeps 5 exponent bits: a sum beyond 65504 becomes Inf, which
/// DataParallelOptions::nonfinite_gradients sees; bf16 has fp32's range and 8 bits of
/// mantissa. Precision::reduce is this hook around SumGradients (Note [Mixed precision]).
///
/// \code
///   strategy.register_gradient_hook(paratrain::NarrowGradients(at::kBFloat16));
/// \endcode
template <class Inner = SumGradients>
class NarrowGradients {
 public:
  explicit NarrowGradients(at::ScalarType wire, Inner inner = {}) : wire_(wire), inner_(std::move(inner)) {
    if (!at::isFloatingType(wire))
      throw error("NarrowGradients", -1,
                  std::string("sums gradients in a floating-point type, not ") + c10::toString(wire) +
                      " (at::kHalf or at::kBFloat16)");
  }

  template <class Comm>
  AnyRequest launch(GradientBucket<Comm>& b) {
    if (b.input.scalar_type() == wire_) return AnyRequest(inner_.launch(b));
    GradientBucket<Comm> narrow = b;
    narrow.input = b.input.to(wire_);
    narrow.output = b.whole() ? narrow.input : at::empty(b.output.sizes(), b.output.options().dtype(wire_));
    narrow.sent_bytes = 0;
    auto r = inner_.launch(narrow);
    b.sent_bytes += narrow.sent_bytes;
    // Widened into the output as it completes; the narrow copies go with the request.
    return detail::Then(AnyRequest(std::move(r)), [out = b.output, sum = narrow.output, in = narrow.input]() mutable {
      out.copy_(sum);
    });
  }

  [[nodiscard]] at::ScalarType wire() const noexcept { return wire_; }
  [[nodiscard]] std::size_t bytes() const {
    if constexpr (requires(const Inner& i) { { i.bytes() } -> std::convertible_to<std::size_t>; }) return inner_.bytes();
    return 0;
  }

 private:
  at::ScalarType wire_;
  Inner inner_;
};

}  // namespace paratrain
