#pragma once
/// \file
/// paratrain::tp::Group — the ranks that share a layer's matrices, as the tensor-parallel
/// layers see them: any sharding communicator behind one small type (Note [Tensor groups]).

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "paratrain/comm/mesh.hpp"
#include "paratrain/concepts/communicator.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/core/reduce_op.hpp"

namespace paratrain::tensor_parallel {

// Note [Tensor groups]
// ~~~~~~~~~~~~~~~~~~~~
// A tensor-parallel layer is a torch::nn::Module like any other: users name it in their
// model without a template argument for the communicator, and it must survive clone(),
// pipelines and ZeRO's units. So the layer holds a Group, a communicator of any type behind
// a virtual interface (std::function's trick), kept alive by the Mesh it came from: the
// tensor dimension's group, split once by the strategy at construction (Note [Process mesh]).
// The collectives a layer needs are the communicator's own (all-reduce, all-gather and
// reduce-scatter, which already check their arguments, fingerprint, and answer to the
// watchdog), applied along a dimension of an activation: the dimension moved first,
// made contiguous, exchanged flat, moved back. A Group of one rank (the default) makes
// every collective the identity without touching a communicator: a tensor-parallel model
// at degree 1 is the plain model.
//
// Every collective counts the bytes it handles (Traffic): the whole tensor an all-reduce
// reduces, the whole tensor an all-gather produces, the whole tensor a reduce-scatter
// reduces; bus_bytes() is what each rank sends on a ring for them (nccl-tests' convention:
// 2(t−1)/t of an all-reduce, (t−1)/t of the others). In those units Megatron's count
// holds: per Transformer block, two all-reduces of b·s·h elements forward and two backward
// without sequence parallelism, and with it two all-gathers and two reduce-scatters each
// way, the same bus bytes (Korthikanti et al. 2022, §4.2.2), and two all-gathers more in
// backward (Note [Sequence-parallel inputs kept as shards]). all_gather_async and
// reduce_scatter_async start the same exchanges over the communicator's non-blocking calls
// (Note [Overlapping the regions' exchanges]). all_to_all counts the tensor it sends, of
// which each rank sends (t−1)/t on the wire: the same factor. A group is any dimensions of the
// mesh (the tensor dimension by default): the context and expert dimensions' exchanges go
// through the same counters. shift_async passes a tensor one place along the group's ring (ring
// attention's key and value blocks): an all-to-all(v) whose only part goes to the next rank,
// so it is validated, fingerprinted and watched as every collective is; it counts the tensor,
// all of which each rank sends.

/// Bytes a tensor group's collectives moved, by kind (Note [Tensor groups]).
struct Traffic {
  std::int64_t all_reduce_bytes = 0;
  std::int64_t all_gather_bytes = 0;
  std::int64_t reduce_scatter_bytes = 0;
  std::int64_t all_to_all_bytes = 0;
  std::int64_t shift_bytes = 0;  ///< what shift_async sent: all of it goes on the wire
  std::int64_t calls = 0;
  int ranks = 1;  ///< the group's size
  /// What each rank sends on a ring for these collectives (Note [Tensor groups]).
  [[nodiscard]] double bus_bytes() const noexcept {
    const double f = static_cast<double>(ranks - 1) / ranks;
    return f * (2.0 * static_cast<double>(all_reduce_bytes) + static_cast<double>(all_gather_bytes) +
                static_cast<double>(reduce_scatter_bytes) + static_cast<double>(all_to_all_bytes)) +
           (ranks > 1 ? static_cast<double>(shift_bytes) : 0.0);
  }
};

/// A collective along a dimension in flight (Group::all_gather_async, reduce_scatter_async):
/// `wait()` completes it and returns its result, `test()` makes progress and says whether it
/// is complete. Over a communicator without non-blocking collectives, or a group of one, the
/// operation completed when it was started. Destroyed in flight, it waits.
class Pending {
 public:
  Pending() = default;
  Pending(Pending&&) noexcept = default;
  Pending& operator=(Pending&& o) noexcept {
    if (this != &o) {
      finish();
      request_ = std::move(o.request_);
      input_ = std::move(o.input_);
      out_ = std::move(o.out_);
      dim_ = o.dim_;
      counts_ = std::move(o.counts_);
    }
    return *this;
  }
  ~Pending() { finish(); }

  /// The result, once the operation is complete (blocks until it is).
  [[nodiscard]] at::Tensor wait() {
    request_.wait();
    request_ = {};
    input_.reset();
    return dim_ == 0 ? out_ : out_.movedim(0, dim_);
  }
  [[nodiscard]] bool test() { return request_.test(); }

 private:
  friend class Group;
  void finish() noexcept {
    try {
      request_.wait();
    } catch (...) {  // the communicator reports its failure on its own (the watchdog); nothing to add here
    }
    request_ = {};
  }
  AnyRequest request_;  // default: complete
  at::Tensor input_;    // kept alive until the operation completes
  at::Tensor out_;      // the result, the exchanged dimension first
  std::int64_t dim_ = 0;
  std::vector<std::int64_t> counts_;  // an all-to-all's element counts, read until it completes
};

/// The ranks that share a layer's matrices (Note [Tensor groups]). Copies share the
/// communicator and the counters. Default: one rank, every collective the identity.
class Group {
 public:
  Group() : counters_(std::make_shared<Traffic>()) {}

  /// The group of `dims` of `mesh` (default: its tensor dimension), split now if it was
  /// not: collective the first time any rank asks (Note [Process mesh]).
  template <communicator Comm>
  explicit Group(Mesh<Comm> mesh, Dims dims = Dim::tensor) : Group() {
    if (mesh.size(dims) == 1) return;
    if constexpr (sharding_communicator<Comm>) {
      impl_ = std::make_shared<Model<Comm>>(std::move(mesh), dims);
    } else {
      throw error("tp::Group", mesh.rank(),
                  "tensor parallelism gathers and reduce-scatters activations, and this communicator cannot: it "
                  "needs reduce_scatter and all_gather (docs/communicators.md)");
    }
  }

  [[nodiscard]] int rank() const { return impl_ ? impl_->rank() : 0; }
  [[nodiscard]] int size() const { return impl_ ? impl_->size() : 1; }
  /// The world rank of this process, for messages (0 for a group of one).
  [[nodiscard]] int world_rank() const { return impl_ ? impl_->world_rank() : 0; }

  /// Reduces `t` in place over the group.
  void all_reduce(at::Tensor& t, reduce_op op = reduce_op::sum) const {
    if (!impl_) return;
    count(counters_->all_reduce_bytes, t);
    impl_->all_reduce(t, op);
  }
  /// Every rank's `x`, concatenated along `dim` in rank order.
  [[nodiscard]] at::Tensor all_gather(const at::Tensor& x, std::int64_t dim) const {
    return exchange(x, dim, /*gather=*/true, /*started=*/false).wait();
  }
  /// The sum over the group of `x`, cut along `dim` into size() equal parts: this rank's part.
  [[nodiscard]] at::Tensor reduce_scatter(const at::Tensor& x, std::int64_t dim) const {
    return exchange(x, dim, /*gather=*/false, /*started=*/false).wait();
  }
  /// This rank's part of `x` cut along `dim` into size() equal parts (no communication).
  [[nodiscard]] at::Tensor part(const at::Tensor& x, std::int64_t dim) const {
    if (!impl_) return x;
    dim = at::maybe_wrap_dim(dim, x.dim());
    check_divides("part", x, dim);
    const auto n = x.size(dim) / size();
    return x.narrow(dim, rank() * n, n);
  }

  /// `x` cut along `scatter_dim` into size() equal parts, part i sent to rank i; what the
  /// ranks sent this rank, concatenated along `gather_dim` in rank order. With scatter_dim
  /// the heads and gather_dim the sequence, the exchange of all-to-all attention (Ulysses).
  [[nodiscard]] at::Tensor all_to_all(const at::Tensor& x, std::int64_t scatter_dim, std::int64_t gather_dim) const {
    if (!impl_) return x;
    scatter_dim = at::maybe_wrap_dim(scatter_dim, x.dim());
    gather_dim = at::maybe_wrap_dim(gather_dim, x.dim());
    check_divides("all_to_all", x, scatter_dim);
    auto sizes = x.sizes().vec();
    const auto part = sizes[static_cast<std::size_t>(scatter_dim)] / size();
    auto moved = x.movedim(scatter_dim, 0);
    auto in_sizes = moved.sizes().vec();
    in_sizes[0] = part;
    in_sizes.insert(in_sizes.begin(), size());
    const auto in = moved.contiguous().view(in_sizes);
    auto out = at::empty_like(in);
    count(counters_->all_to_all_bytes, in);
    impl_->all_to_all(in, {}, out, {});
    std::vector<at::Tensor> parts;
    for (int i = 0; i < size(); ++i) parts.push_back(out.select(0, i).movedim(0, scatter_dim));
    return at::cat(parts, gather_dim);
  }
  /// The rows of `x` (dimension 0), in_rows[i] of them sent to rank i in order; the rows the
  /// ranks sent this rank, out_rows[i] from rank i, in rank order: the dispatch and combine
  /// of a mixture of experts. What rank i sends rank j must be what rank j expects from
  /// rank i (checked under the communicator's validation).
  [[nodiscard]] at::Tensor all_to_all(const at::Tensor& x, std::span<const std::int64_t> in_rows,
                                      std::span<const std::int64_t> out_rows) const {
    if (!impl_) return x;
    std::int64_t row = 1;  // elements a row: from the sizes, which a tensor of no rows still has
    for (std::int64_t d = 1; d < x.dim(); ++d) row *= x.size(d);
    std::vector<std::int64_t> in_counts, out_counts;
    std::int64_t rows = 0;
    for (const auto r : in_rows) in_counts.push_back(r * row);
    for (const auto r : out_rows) out_counts.push_back(r * row), rows += r;
    auto sizes = x.sizes().vec();
    sizes[0] = rows;
    const auto in = x.contiguous();
    auto out = at::empty(sizes, in.options());
    count(counters_->all_to_all_bytes, in);
    impl_->all_to_all(in, in_counts, out, out_counts);
    return out;
  }

  /// all_gather(x, dim), started: the caller computes meanwhile (Note [Overlapping the
  /// regions' exchanges]) and takes the result from wait().
  [[nodiscard]] Pending all_gather_async(const at::Tensor& x, std::int64_t dim) const {
    return exchange(x, dim, /*gather=*/true, /*started=*/true);
  }
  /// reduce_scatter(x, dim), started; the result from wait().
  [[nodiscard]] Pending reduce_scatter_async(const at::Tensor& x, std::int64_t dim) const {
    return exchange(x, dim, /*gather=*/false, /*started=*/true);
  }

  /// `x` sent to the rank `offset` places on along the group's ring (rank (r + offset) mod
  /// size()), started; wait() returns what the rank `offset` places back sent this one, of
  /// the same shape on every rank: a ring's step (Note [Ring attention]). A group of one
  /// returns `x`.
  [[nodiscard]] Pending shift_async(const at::Tensor& x, int offset = 1) const {
    Pending p;
    if (!impl_) {
      p.out_ = x;
      return p;
    }
    const auto n = size();
    const auto to = static_cast<std::size_t>(((rank() + offset) % n + n) % n);
    const auto from = static_cast<std::size_t>(((rank() - offset) % n + n) % n);
    p.input_ = x.contiguous();
    p.out_ = at::empty_like(p.input_);
    p.counts_.assign(2 * static_cast<std::size_t>(n), 0);
    p.counts_[to] = p.input_.numel();
    p.counts_[static_cast<std::size_t>(n) + from] = p.input_.numel();
    count(counters_->shift_bytes, p.input_);
    const std::span<const std::int64_t> counts(p.counts_);
    p.request_ = impl_->iall_to_all(p.input_, counts.first(static_cast<std::size_t>(n)), p.out_,
                                    counts.last(static_cast<std::size_t>(n)));
    return p;
  }

  /// What this group's collectives moved since it was made (or reset_traffic()).
  [[nodiscard]] Traffic traffic() const {
    auto t = *counters_;
    t.ranks = size();
    return t;
  }
  void reset_traffic() const { *counters_ = {}; }

 private:
  struct Concept {
    virtual ~Concept() = default;
    [[nodiscard]] virtual int rank() const = 0;
    [[nodiscard]] virtual int size() const = 0;
    [[nodiscard]] virtual int world_rank() const = 0;
    virtual void all_reduce(at::Tensor& t, reduce_op op) = 0;
    virtual void all_gather(const at::Tensor& in, at::Tensor& out) = 0;
    virtual void reduce_scatter(const at::Tensor& in, at::Tensor& out) = 0;
    // Started; complete already where the communicator has no non-blocking form.
    virtual AnyRequest iall_gather(const at::Tensor& in, at::Tensor& out) = 0;
    virtual AnyRequest ireduce_scatter(const at::Tensor& in, at::Tensor& out) = 0;
    virtual void all_to_all(const at::Tensor& in, std::span<const std::int64_t> in_counts, at::Tensor& out,
                            std::span<const std::int64_t> out_counts) = 0;
    virtual AnyRequest iall_to_all(const at::Tensor& in, std::span<const std::int64_t> in_counts, at::Tensor& out,
                                   std::span<const std::int64_t> out_counts) = 0;
  };
  template <class Comm>
  struct Model final : Concept {
    Model(Mesh<Comm> m, Dims dims) : mesh(std::move(m)), comm(&mesh.group(dims)) {}
    [[nodiscard]] int rank() const override { return comm->rank(); }
    [[nodiscard]] int size() const override { return comm->size(); }
    [[nodiscard]] int world_rank() const override { return mesh.rank(); }
    void all_reduce(at::Tensor& t, reduce_op op) override { comm->all_reduce(t, op); }
    void all_gather(const at::Tensor& in, at::Tensor& out) override { comm->all_gather(in, out); }
    void reduce_scatter(const at::Tensor& in, at::Tensor& out) override {
      comm->reduce_scatter(in, out, reduce_op::sum);
    }
    AnyRequest iall_gather(const at::Tensor& in, at::Tensor& out) override {
      if constexpr (async_sharding_communicator<Comm>) return comm->iall_gather(in, out);
      all_gather(in, out);
      return {};
    }
    AnyRequest ireduce_scatter(const at::Tensor& in, at::Tensor& out) override {
      if constexpr (async_sharding_communicator<Comm>) return comm->ireduce_scatter(in, out, reduce_op::sum);
      reduce_scatter(in, out);
      return {};
    }
    void all_to_all(const at::Tensor& in, std::span<const std::int64_t> in_counts, at::Tensor& out,
                    std::span<const std::int64_t> out_counts) override {
      if constexpr (all_to_all_communicator<Comm>) {
        comm->all_to_all(in, in_counts, out, out_counts);
      } else {
        throw error("Group::all_to_all", mesh.rank(),
                    "this communicator has no all_to_all, which all-to-all attention and experts need "
                    "(docs/communicators.md)");
      }
    }
    AnyRequest iall_to_all(const at::Tensor& in, std::span<const std::int64_t> in_counts, at::Tensor& out,
                           std::span<const std::int64_t> out_counts) override {
      if constexpr (async_all_to_all_communicator<Comm>) return comm->iall_to_all(in, in_counts, out, out_counts);
      all_to_all(in, in_counts, out, out_counts);
      return {};
    }
    Mesh<Comm> mesh;  // keeps the group alive
    Comm* comm;
  };

  // The exchange along `dim`, blocking or started: its dimension moved first, flat, into a
  // result that grows (all-gather) or shrinks (reduce-scatter) t times along it.
  [[nodiscard]] Pending exchange(const at::Tensor& x, std::int64_t dim, bool gather, bool started) const {
    Pending p;
    if (!impl_) {
      p.out_ = x;
      return p;
    }
    p.dim_ = at::maybe_wrap_dim(dim, x.dim());
    if (!gather) check_divides("reduce_scatter", x, p.dim_);
    p.input_ = x.movedim(p.dim_, 0).contiguous();
    auto sizes = p.input_.sizes().vec();
    sizes[0] = gather ? sizes[0] * size() : sizes[0] / size();
    p.out_ = at::empty(sizes, p.input_.options());
    count(gather ? counters_->all_gather_bytes : counters_->reduce_scatter_bytes, gather ? p.out_ : p.input_);
    if (!started) {
      gather ? impl_->all_gather(p.input_, p.out_) : impl_->reduce_scatter(p.input_, p.out_);
    } else {
      p.request_ = gather ? impl_->iall_gather(p.input_, p.out_) : impl_->ireduce_scatter(p.input_, p.out_);
    }
    return p;
  }
  void count(std::int64_t& bytes, const at::Tensor& t) const {
    bytes += static_cast<std::int64_t>(t.numel()) * static_cast<std::int64_t>(t.element_size());
    ++counters_->calls;
  }
  void check_divides(const char* what, const at::Tensor& x, std::int64_t dim) const {
    if (x.size(dim) % size() != 0)
      throw error(std::string("tp::Group::") + what, world_rank(),
                  "dimension " + std::to_string(dim) + " of a tensor of shape " + shape_of(x) + " has " +
                      std::to_string(x.size(dim)) + " elements, which the " + std::to_string(size()) +
                      " ranks of the tensor group cannot share equally");
  }
  static std::string shape_of(const at::Tensor& x) {
    std::string s = "[";
    for (std::int64_t d = 0; d < x.dim(); ++d) s += (d ? ", " : "") + std::to_string(x.size(d));
    return s + "]";
  }

  std::shared_ptr<Concept> impl_;
  std::shared_ptr<Traffic> counters_;
};

}  // namespace paratrain::tensor_parallel

namespace paratrain {
/// Tensor parallelism's short name: `paratrain::tp::ColumnParallelLinear`.
namespace tp = tensor_parallel;
}  // namespace paratrain
