#pragma once
/// \file
/// The communicator concepts: what a strategy may ask of a transport.
///
/// | concept                      | adds                                   | needed by                  |
/// |------------------------------|----------------------------------------|----------------------------|
/// | `communicator`               | rank, size, all_reduce, broadcast, barrier | every strategy          |
/// | `sharding_communicator`      | reduce_scatter, all_gather             | `Sharded` (ZeRO/FSDP)      |
/// | `point_to_point_communicator`| send, recv                             | `Pipeline`                 |
/// | `async_communicator`         | iall_reduce returning a `request`      | overlapped DDP buckets     |
/// | `async_sharding_communicator`| ireduce_scatter, iall_gather returning a `request` | overlapped ZeRO/FSDP gathers and gradient shards |
/// | `all_to_all_communicator`    | all_to_all, equal parts and per-rank counts | experts' token routing, all-to-all attention |
/// | `async_all_to_all_communicator` | iall_to_all (both forms) returning a `request` | overlapped routing |
///
/// Models: `comm::SingleDevice` (all of them, trivially), `comm::Mpi` (all of them),
/// `comm::Gloo` (all of them), `comm::Nccl` (device buffers). A type of your own opts in
/// by having the members; `static_assert(paratrain::explain_communicator<MyComm>())`
/// (or `explain_sharding_communicator`, `explain_async_sharding_communicator`) says
/// which one is missing.

#include <ATen/core/Tensor.h>

#include <concepts>
#include <cstdint>
#include <memory>
#include <span>
#include <type_traits>
#include <utility>

#include "paratrain/core/reduce_op.hpp"

namespace paratrain {

/// A handle to a non-blocking operation: `wait()` blocks until it is complete,
/// `test()` makes progress and says whether it is.
template <class R>
concept request = std::movable<R> && requires(R& r) {
  r.wait();
  { r.test() } -> std::same_as<bool>;
};

/// Any request, behind one type: what a gradient hook that starts different collectives (or
/// a chain of them) returns, and what a tensor group's started exchange waits on
/// (tp::Pending). A default-constructed one is complete.
class AnyRequest {
 public:
  AnyRequest() = default;
  template <request R>
    requires(!std::same_as<std::remove_cvref_t<R>, AnyRequest>)
  AnyRequest(R r) : self_(std::make_unique<Model<R>>(std::move(r))) {}  // NOLINT: any request converts

  void wait() {
    if (self_) self_->wait();
  }
  [[nodiscard]] bool test() { return !self_ || self_->test(); }

 private:
  struct Base {
    virtual ~Base() = default;
    virtual void wait() = 0;
    virtual bool test() = 0;
  };
  template <class R>
  struct Model final : Base {
    explicit Model(R r) : inner(std::move(r)) {}
    void wait() override { inner.wait(); }
    bool test() override { return inner.test(); }
    R inner;
  };
  std::unique_ptr<Base> self_;
};

/// A group of ranks that can reduce and broadcast tensors in place.
template <class C>
concept communicator = std::movable<C> &&
    requires(C& c, const C& cc, at::Tensor& t) {
      { cc.rank() } -> std::same_as<int>;
      { cc.size() } -> std::same_as<int>;
      c.all_reduce(t, reduce_op::sum);
      c.broadcast(t, 0);
      c.barrier();
    };

/// A communicator that can split a buffer across ranks and gather it back.
template <class C>
concept sharding_communicator = communicator<C> &&
    requires(C& c, const at::Tensor& in, at::Tensor& out) {
      c.reduce_scatter(in, out, reduce_op::sum);
      c.all_gather(in, out);
    };

/// A communicator whose ranks can exchange tensors pairwise.
template <class C>
concept point_to_point_communicator = communicator<C> &&
    requires(C& c, const at::Tensor& in, at::Tensor& out, int peer, int tag) {
      c.send(in, peer, tag);
      c.recv(out, peer, tag);
    };

/// A communicator whose all_reduce can run while the caller goes on computing.
template <class C>
concept async_communicator = communicator<C> && requires(C& c, at::Tensor& t) {
  { c.iall_reduce(t, reduce_op::sum) } -> request;
};

/// A sharding communicator whose reduce_scatter and all_gather can run while the caller
/// goes on computing: prefetching the next ZeRO-3 unit, reducing a gradient shard.
template <class C>
concept async_sharding_communicator = sharding_communicator<C> &&
    requires(C& c, const at::Tensor& in, at::Tensor& out) {
      { c.ireduce_scatter(in, out, reduce_op::sum) } -> request;
      { c.iall_gather(in, out) } -> request;
    };

/// A communicator that can send part i of a buffer to rank i and receive each rank's part
/// for it: in equal parts (`all_to_all(in, out)`), or in parts of per-rank element counts
/// (`all_to_all(in, in_counts, out, out_counts)`, MPI's alltoallv).
template <class C>
concept all_to_all_communicator = communicator<C> &&
    requires(C& c, const at::Tensor& in, at::Tensor& out, std::span<const std::int64_t> counts) {
      c.all_to_all(in, out);
      c.all_to_all(in, counts, out, counts);
    };

/// An all-to-all communicator whose exchanges can run while the caller goes on computing.
template <class C>
concept async_all_to_all_communicator = all_to_all_communicator<C> &&
    requires(C& c, const at::Tensor& in, at::Tensor& out, std::span<const std::int64_t> counts) {
      { c.iall_to_all(in, out) } -> request;
      { c.iall_to_all(in, counts, out, counts) } -> request;
    };

/// Checks each requirement of `communicator` separately, so that a type that misses
/// one gets a single message naming it. Use it in a `static_assert` at your API
/// boundary; paratrain's strategies do.
template <class C>
consteval bool explain_communicator() {
  static_assert(requires(const C& c) { { c.rank() } -> std::same_as<int>; },
                "paratrain: not a communicator: it needs `int rank() const` (this process's index in the group)");
  static_assert(requires(const C& c) { { c.size() } -> std::same_as<int>; },
                "paratrain: not a communicator: it needs `int size() const` (the number of ranks)");
  static_assert(requires(C& c, at::Tensor& t) { c.all_reduce(t, reduce_op::sum); },
                "paratrain: not a communicator: it needs `all_reduce(at::Tensor&, paratrain::reduce_op)` (in place)");
  static_assert(requires(C& c, at::Tensor& t) { c.broadcast(t, 0); },
                "paratrain: not a communicator: it needs `broadcast(at::Tensor&, int root)` (in place)");
  static_assert(requires(C& c) { c.barrier(); },
                "paratrain: not a communicator: it needs `barrier()`");
  static_assert(std::movable<C>, "paratrain: not a communicator: it must be movable (strategies hold it by value)");
  return true;
}

/// Like explain_communicator, for the members `Sharded` needs on top.
template <class C>
consteval bool explain_sharding_communicator() {
  static_assert(explain_communicator<C>());
  static_assert(requires(C& c, const at::Tensor& in, at::Tensor& out) { c.reduce_scatter(in, out, reduce_op::sum); },
                "paratrain: this communicator cannot shard: it needs `reduce_scatter(const at::Tensor& in, "
                "at::Tensor& out, paratrain::reduce_op)`; see docs/communicators.md");
  static_assert(requires(C& c, const at::Tensor& in, at::Tensor& out) { c.all_gather(in, out); },
                "paratrain: this communicator cannot shard: it needs `all_gather(const at::Tensor& in, at::Tensor& out)`;"
                " see docs/communicators.md");
  return true;
}

/// Like explain_communicator, for the all-to-all a mixture of experts routes tokens with.
template <class C>
consteval bool explain_all_to_all_communicator() {
  static_assert(explain_communicator<C>());
  static_assert(requires(C& c, const at::Tensor& in, at::Tensor& out) { c.all_to_all(in, out); },
                "paratrain: this communicator cannot exchange parts: it needs `all_to_all(const at::Tensor& in, "
                "at::Tensor& out)` (size() equal parts); see docs/communicators.md");
  static_assert(requires(C& c, const at::Tensor& in, at::Tensor& out, std::span<const std::int64_t> counts) {
                  c.all_to_all(in, counts, out, counts);
                },
                "paratrain: this communicator cannot exchange uneven parts: it needs `all_to_all(const at::Tensor& "
                "in, std::span<const std::int64_t> in_counts, at::Tensor& out, std::span<const std::int64_t> "
                "out_counts)`; see docs/communicators.md");
  return true;
}

/// Like explain_sharding_communicator, for the non-blocking forms an overlapped
/// sharded strategy needs on top.
template <class C>
consteval bool explain_async_sharding_communicator() {
  static_assert(explain_sharding_communicator<C>());
  static_assert(requires(C& c, const at::Tensor& in, at::Tensor& out) { c.ireduce_scatter(in, out, reduce_op::sum); },
                "paratrain: this communicator cannot overlap sharding: it needs `ireduce_scatter(const at::Tensor& "
                "in, at::Tensor& out, paratrain::reduce_op)` returning a request; see docs/communicators.md");
  static_assert(requires(C& c, const at::Tensor& in, at::Tensor& out) {
                  { c.ireduce_scatter(in, out, reduce_op::sum) } -> request;
                },
                "paratrain: this communicator cannot overlap sharding: its ireduce_scatter must return a request "
                "(a movable handle with `wait()` and `bool test()`); see docs/communicators.md");
  static_assert(requires(C& c, const at::Tensor& in, at::Tensor& out) { c.iall_gather(in, out); },
                "paratrain: this communicator cannot overlap sharding: it needs `iall_gather(const at::Tensor& in, "
                "at::Tensor& out)` returning a request; see docs/communicators.md");
  static_assert(requires(C& c, const at::Tensor& in, at::Tensor& out) {
                  { c.iall_gather(in, out) } -> request;
                },
                "paratrain: this communicator cannot overlap sharding: its iall_gather must return a request "
                "(a movable handle with `wait()` and `bool test()`); see docs/communicators.md");
  return true;
}

}  // namespace paratrain
