#pragma once
/// \file
/// paratrain::Mesh — the one owner of the rank layout: named dimensions whose product is
/// the world size, and the communicator of every group of them (Note [Process mesh]).

#include <ATen/ATen.h>

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

#include "paratrain/collectives/agree.hpp"
#include "paratrain/collectives/model_device.hpp"
#include "paratrain/concepts/communicator.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/core/step_result.hpp"

namespace paratrain {

// Note [Process mesh]
// ~~~~~~~~~~~~~~~~~~~
// A run's W ranks form a grid of named dimensions, outermost first:
//
//   pipeline    a Pipeline's ranks: each holds some stages, activations pass between them
//   replicate   data-parallel ranks that hold the same model state (DDP; HSDP's outer dimension)
//   shard       data-parallel ranks that share the model state out (ZeRO, FSDP)
//   context     ranks that share a sequence's positions (context parallelism: cp::attention)
//   expert      ranks that share a layer's experts (expert parallelism: moe::MixtureOfExperts)
//   tensor      ranks that share a layer's matrices (tensor parallelism: paratrain::tp's layers)
//
// with sizes P, R, S, C, E, T (1 where unused) whose product is W. World rank
// ((((p·R + r)·S + s)·C + c)·E + e)·T + t is the rank at coordinates (p, r, s, c, e, t):
// the innermost dimension's ranks are consecutive, which launchers place on one node, so
// the dimension that talks most gets them (tensor parallelism reduces inside every layer,
// then context and expert exchange inside layers, then the data-shard's gathers and
// reduce-scatters); the pipeline, which only passes activations to a neighbour, is outermost
// (torchtitan's ParallelDims orders them alike).
//
// `group(dims)` is the communicator of the ranks that share this rank's coordinates in
// every dimension outside `dims`; its rank is this rank's coordinate in `dims` (flattened,
// outer first). It is split from the world the first time any rank asks for it, so every
// rank asks for the same groups in the same order (the strategies do, at construction), and
// kept: a group whose dimensions cover every dimension of more than one rank is the world
// itself, and no split is made. Each dimension plays some of four roles, and a strategy asks
// for the role, never for a list of dimensions:
//
//   Dims::data()      where the samples differ: replicate, shard and expert (the ranks of an
//                     expert group route different tokens to each other's experts).
//                     `data_shard()` is a rank's place among them; the samplers deal by it.
//   Dims::replicas()  where every parameter is held alike and its gradient averaged: the
//                     data-parallel dimensions and context (its ranks see the same samples,
//                     each its own positions of them: Note [Sequence layouts]). An expert's
//                     replicas are these: its gradient already holds every token of its
//                     expert group (Note [Experts over a group]).
//   Dims::batch()     the ranks that take each step together: the replicas and the expert
//                     dimension. The step is agreed, the samples counted and the parameters
//                     not cut over the expert dimension (the dense ones: a router, attention)
//                     averaged over them.
//   Dims::sharding()  where ZeRO cuts the model's state: data-shard and context, as
//                     torchtitan's dp_shard_cp does (context parallelism's ranks share the
//                     state's memory too), and expert: the ranks of one tensor and pipeline
//                     place that hold a dense parameter alike, but the data-replicate ones
//                     (Note [Hybrid sharding]).
//                     Dims::expert_sharding(), data-shard and context, cuts an expert's
//                     state over the ranks that hold that expert (Note [Expert buckets]).
//
// A context-parallel run averages over data × context what a run without it averages over
// data, and counts each replica's samples once. The tensor dimension plays none of these
// roles: its ranks hold different slices of a layer and see the same tokens. Every strategy
// takes its groups, its replica index and its data shard from here, and no other code
// computes one rank's place from another's: a new dimension changes this file alone.
//
// Today's spellings are shapes: DataParallelOptions::shard_group = G is {replicate W/G,
// shard G} (Note [Hybrid sharding]); a Pipeline of K pipeline ranks is {pipeline K,
// replicate W/K} (its stages' replicas then shard as shard_group says).

/// A dimension of the process mesh, outermost first (Note [Process mesh]).
enum class Dim : std::uint8_t { pipeline, replicate, shard, context, expert, tensor };

/// The number of mesh dimensions.
inline constexpr std::size_t dim_count = 6;

/// A dimension's name, as errors and documents spell it.
[[nodiscard]] constexpr std::string_view dim_name(Dim d) noexcept {
  constexpr std::array<std::string_view, dim_count> names{"pipeline", "data-replicate", "data-shard",
                                                          "context",  "expert",         "tensor"};
  return names[static_cast<std::size_t>(d)];
}

/// A set of mesh dimensions: `Dims{Dim::replicate, Dim::shard}`.
class Dims {
 public:
  constexpr Dims() noexcept = default;
  constexpr Dims(Dim d) noexcept : bits_(bit(d)) {}  // NOLINT: one dimension is a set of one
  constexpr Dims(std::initializer_list<Dim> dims) noexcept {
    for (const auto d : dims) bits_ |= bit(d);
  }
  /// Every dimension.
  [[nodiscard]] static constexpr Dims all() noexcept { return from_bits((1u << dim_count) - 1); }
  /// Where ranks see different samples: replicate, shard and expert (Note [Process mesh]).
  [[nodiscard]] static constexpr Dims data() noexcept { return {Dim::replicate, Dim::shard, Dim::expert}; }
  /// The dimensions whose ranks hold every parameter alike and average its gradient:
  /// replicate, shard and context (Note [Process mesh]).
  [[nodiscard]] static constexpr Dims replicas() noexcept { return {Dim::replicate, Dim::shard, Dim::context}; }
  /// The ranks that take each step together: the replicas and the expert dimension, over
  /// which the parameters not cut over it are averaged (Note [Process mesh]).
  [[nodiscard]] static constexpr Dims batch() noexcept {
    return {Dim::replicate, Dim::shard, Dim::context, Dim::expert};
  }
  /// Where ZeRO cuts the model's state: the data-shard, context and expert dimensions (an
  /// expert's: expert_sharding()).
  [[nodiscard]] static constexpr Dims sharding() noexcept { return {Dim::shard, Dim::context, Dim::expert}; }
  /// Where ZeRO cuts an expert's state: the data-shard and context dimensions.
  [[nodiscard]] static constexpr Dims expert_sharding() noexcept { return {Dim::shard, Dim::context}; }

  [[nodiscard]] constexpr bool contains(Dim d) const noexcept { return (bits_ & bit(d)) != 0; }
  [[nodiscard]] constexpr bool empty() const noexcept { return bits_ == 0; }
  [[nodiscard]] constexpr Dims operator|(Dims o) const noexcept { return from_bits(bits_ | o.bits_); }
  [[nodiscard]] constexpr Dims operator&(Dims o) const noexcept { return from_bits(bits_ & o.bits_); }
  /// The dimensions not in this set.
  [[nodiscard]] constexpr Dims operator~() const noexcept { return from_bits(~bits_ & all().bits_); }
  friend constexpr bool operator==(Dims, Dims) noexcept = default;
  [[nodiscard]] constexpr unsigned bits() const noexcept { return bits_; }

 private:
  static constexpr unsigned bit(Dim d) noexcept { return 1u << static_cast<unsigned>(d); }
  static constexpr Dims from_bits(unsigned b) noexcept {
    Dims d;
    d.bits_ = b;
    return d;
  }
  unsigned bits_ = 0;
};

/// How many ranks each dimension of the mesh has (1: unused); their product is the world
/// size. `replicate = 0` takes what the others leave: `{.shard = 4}` on 8 ranks is 2 × 4.
struct MeshShape {
  int pipeline = 1;
  int replicate = 0;
  int shard = 1;
  int context = 1;
  int expert = 1;
  int tensor = 1;

  [[nodiscard]] constexpr int operator[](Dim d) const noexcept {
    switch (d) {
      case Dim::pipeline: return pipeline;
      case Dim::replicate: return replicate;
      case Dim::shard: return shard;
      case Dim::context: return context;
      case Dim::expert: return expert;
      case Dim::tensor: return tensor;
    }
    return 1;
  }
  /// "pipeline 2 × data-replicate 1 × data-shard 3" (the dimensions of more than one
  /// rank, and those given as 0 or less, as they are).
  [[nodiscard]] std::string str() const {
    std::string s;
    for (std::size_t i = 0; i < dim_count; ++i) {
      const auto d = static_cast<Dim>(i);
      if ((*this)[d] == 1) continue;
      if (!s.empty()) s += " × ";
      s += std::string(dim_name(d)) + " " + std::to_string((*this)[d]);
    }
    return s.empty() ? "one rank" : s;
  }
};

/// One rank's coordinates, a dimension each (Dim order).
using MeshCoordinates = std::array<int, dim_count>;

/// The process mesh over the ranks of `Comm` (Note [Process mesh]). Copies share the
/// groups: a strategy and the parts it hands the mesh to split each group once.
///
/// \code
///   paratrain::Mesh mesh(paratrain::comm::Mpi(), {.replicate = 2, .shard = 4});  // HSDP on 8 ranks
///   auto& shard_group = mesh.group(paratrain::Dim::shard);                       // 4 consecutive ranks
/// \endcode
template <communicator Comm>
class Mesh {
 public:
  /// Collective over `world`. Throws paratrain::error on every rank when the shape does
  /// not fit the world size, or when the ranks were given different shapes, naming them.
  Mesh(Comm world, MeshShape shape) : state_(std::make_shared<State>(std::move(world))) {
    auto& s = *state_;
    const int W = s.world.size(), me = s.world.rank();
    int others = 1;
    for (std::size_t i = 0; i < dim_count; ++i) {
      const auto d = static_cast<Dim>(i);
      if (d != Dim::replicate && shape[d] < 1)
        throw error("Mesh", me,
                    "the " + std::string(dim_name(d)) + " dimension has " + std::to_string(shape[d]) +
                        " ranks; every dimension has at least 1 (the mesh " + shape.str() + ")");
      if (d != Dim::replicate) others *= shape[d];
    }
    if (shape.replicate < 0)
      throw error("Mesh", me,
                  "the data-replicate dimension has " + std::to_string(shape.replicate) +
                      " ranks; give at least 1, or 0 for what the other dimensions leave of the world");
    if (shape.replicate == 0) {
      if (W % others != 0)
        throw error("Mesh", me,
                    "the mesh " + shape.str() + " needs a multiple of " + std::to_string(others) +
                        " ranks, and the world has " + std::to_string(W) + "; launch a multiple of " +
                        std::to_string(others) + " or change the mesh");
      shape.replicate = W / others;
    }
    if (others * shape.replicate != W)
      throw error("Mesh", me,
                  "the mesh " + shape.str() + " has " + std::to_string(others * shape.replicate) +
                      " ranks, and the world has " + std::to_string(W) +
                      "; the dimensions' sizes must multiply to the world size");
    s.shape = shape;
    int stride = 1;
    for (std::size_t i = dim_count; i-- > 0;) {
      s.stride[i] = stride;
      s.at[i] = (me / stride) % shape[static_cast<Dim>(i)];
      stride *= shape[static_cast<Dim>(i)];
    }
    agree_on_shape();
  }

  /// Each dimension's size (the replicate dimension's resolved).
  [[nodiscard]] const MeshShape& shape() const noexcept { return state_->shape; }
  [[nodiscard]] int size(Dim d) const noexcept { return state_->shape[d]; }
  /// The product of the dimensions' sizes: the ranks of group(dims).
  [[nodiscard]] int size(Dims dims) const noexcept {
    int n = 1;
    for (std::size_t i = 0; i < dim_count; ++i)
      if (dims.contains(static_cast<Dim>(i))) n *= size(static_cast<Dim>(i));
    return n;
  }
  /// This rank's coordinate in dimension `d`.
  [[nodiscard]] int index(Dim d) const noexcept { return state_->at[static_cast<std::size_t>(d)]; }
  /// This rank's coordinate in `dims`, flattened (outer first): its rank in group(dims).
  [[nodiscard]] int index(Dims dims) const noexcept { return flatten(state_->at, dims); }
  [[nodiscard]] const MeshCoordinates& coordinates() const noexcept { return state_->at; }
  /// The world rank at `at`.
  [[nodiscard]] int world_rank(const MeshCoordinates& at) const noexcept { return flatten(at, Dims::all()); }
  /// This rank's coordinates with `d` set to `value`, as a world rank: the rank of the
  /// same place in another pipeline stage, replica, ...
  [[nodiscard]] int world_rank(Dim d, int value) const noexcept {
    auto at = state_->at;
    at[static_cast<std::size_t>(d)] = value;
    return world_rank(at);
  }
  /// This rank's coordinates with those in `dims` set to the ones whose flattened index
  /// (index(dims)'s numbering) is `index`, as a world rank: the world rank of rank `index`
  /// of group(dims).
  [[nodiscard]] int world_rank(Dims dims, int index) const noexcept {
    auto at = state_->at;
    for (std::size_t i = dim_count; i-- > 0;)
      if (dims.contains(static_cast<Dim>(i))) {
        at[i] = index % size(static_cast<Dim>(i));
        index /= size(static_cast<Dim>(i));
      }
    return world_rank(at);
  }

  /// The ranks of the world.
  [[nodiscard]] Comm& world() noexcept { return state_->world; }
  [[nodiscard]] int rank() const { return state_->world.rank(); }

  /// The ranks that share this rank's coordinates outside `dims` (Note [Process mesh]).
  /// Collective the first time: every rank asks for the same groups in the same order.
  [[nodiscard]] Comm& group(Dims dims) {
    auto& s = *state_;
    const Dims wide = wider(dims);
    if (wide == wider(Dims::all())) return s.world;
    if (const auto it = s.groups.find(wide.bits()); it != s.groups.end()) return it->second;
    if constexpr (requires(const Comm& c) { { c.split(0, 0) } -> std::same_as<Comm>; }) {
      return s.groups.emplace(wide.bits(), s.world.split(flatten(s.at, ~dims), index(dims))).first->second;
    } else {
      throw error("Mesh", rank(),
                  "this mesh (" + s.shape.str() +
                      ") needs a group of some of the world's ranks, which this communicator cannot make: it needs "
                      "`Comm split(int color, int key) const` (docs/communicators.md)");
    }
  }

  // Note [Gradient communicators]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // A bucket's sum starts in a gradient hook while backward goes on, and the second phase of
  // a two-phase one (hybrid sharding's all-reduce across the replicas, PowerSGD's second
  // product) when this rank sees the first complete: a moment that differs from rank to rank.
  // Layers exchange inside backward too (a tensor group's all-reduce, Ulysses' all-to-all, a
  // mixture's all-to-alls), and MPI and NCCL want one order of collectives per communicator.
  // So gradients are summed over gradient_group(dims): group(dims) itself, which is another
  // communicator than any layer's, unless its ranks are exactly a tensor, context or expert
  // group (every rank of the batch one expert group; a data degree of 1 under context
  // parallelism), where it is a split of its own, made once: Note [Two communicators]'s remedy
  // where the collision can happen, and no extra communicator (an NCCL one costs device
  // memory) where it cannot.

  /// group(dims)'s ranks on a communicator no layer exchanges over: Note [Gradient
  /// communicators]. Collective the first time, as group(dims).
  [[nodiscard]] Comm& gradient_group(Dims dims) {
    auto& s = *state_;
    auto& g = group(dims);
    const Dims wide = wider(dims);
    bool shared = false;
    for (const auto d : {Dim::tensor, Dim::context, Dim::expert}) shared = shared || (size(d) > 1 && wider(d) == wide);
    if constexpr (requires(const Comm& c) { { c.split(0, 0) } -> std::same_as<Comm>; }) {
      if (!shared) return g;
      if (const auto it = s.gradient_groups.find(wide.bits()); it != s.gradient_groups.end()) return it->second;
      return s.gradient_groups.emplace(wide.bits(), g.split(0, g.rank())).first->second;
    } else {
      return g;  // a communicator that cannot split has no layer groups either (group() throws)
    }
  }

  /// Which replica's samples this rank trains on: its place in the data dimensions.
  [[nodiscard]] DataShard data_shard() const noexcept {
    return {.index = index(Dims::data()), .count = size(Dims::data())};
  }

 private:
  struct State {
    explicit State(Comm w) : world(std::move(w)) {}
    Comm world;
    MeshShape shape{};
    MeshCoordinates at{};
    std::array<int, dim_count> stride{};
    std::map<unsigned, Comm> groups;  // by the dimensions of more than one rank they span
    std::map<unsigned, Comm> gradient_groups;  // alike: Note [Gradient communicators]
  };

  // `dims` without its dimensions of one rank: the same group.
  [[nodiscard]] Dims wider(Dims dims) const noexcept {
    Dims out;
    for (std::size_t i = 0; i < dim_count; ++i)
      if (dims.contains(static_cast<Dim>(i)) && size(static_cast<Dim>(i)) > 1) out = out | static_cast<Dim>(i);
    return out;
  }

  [[nodiscard]] int flatten(const MeshCoordinates& at, Dims dims) const noexcept {
    int n = 0;
    for (std::size_t i = 0; i < dim_count; ++i)
      if (dims.contains(static_cast<Dim>(i))) n = n * size(static_cast<Dim>(i)) + at[i];
    return n;
  }

  // Every rank was given the same shape: the largest and the smallest of each size agree.
  void agree_on_shape() {
    auto& s = *state_;
    if (s.world.size() == 1) return;
    auto t = at::empty({2 * static_cast<std::int64_t>(dim_count)}, at::kLong);
    for (std::size_t i = 0; i < dim_count; ++i) {
      t[static_cast<std::int64_t>(i)] = s.shape[static_cast<Dim>(i)];
      t[static_cast<std::int64_t>(dim_count + i)] = -s.shape[static_cast<Dim>(i)];
    }
    detail::all_reduce_on(s.world, t, detail::communicator_device(s.world), reduce_op::max);
    std::string problem;
    for (std::size_t i = 0; i < dim_count && problem.empty(); ++i) {
      const auto most = t[static_cast<std::int64_t>(i)].item<std::int64_t>(),
                 least = -t[static_cast<std::int64_t>(dim_count + i)].item<std::int64_t>();
      if (most != least)
        problem = "the ranks were given different meshes: the " + std::string(dim_name(static_cast<Dim>(i))) +
                  " dimension has from " + std::to_string(least) + " to " + std::to_string(most) +
                  " ranks (this rank: " + s.shape.str() + "); give every rank the same shape";
    }
    if (!problem.empty()) throw error("Mesh", s.world.rank(), problem);
  }

  std::shared_ptr<State> state_;
};

}  // namespace paratrain
