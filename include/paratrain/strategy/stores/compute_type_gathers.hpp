#pragma once
/// \file
/// ZeRO-3's gathers in the compute type (Note [Gathers in the compute type]): which buckets a
/// unit's forward under autocast gathers in bf16, decided from the first forward's graph and
/// agreed by the ranks, and each parameter's views of both buffers.

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "paratrain/collectives/all_reduce_on.hpp"
#include "paratrain/core/reduce_op.hpp"
#include "paratrain/strategy/buckets/bucket_layout.hpp"
#include "paratrain/strategy/stores/detail/flat_shard.hpp"
#include "paratrain/strategy/stores/sharded_construction.hpp"
#include "paratrain/util/torch_compat.hpp"

namespace paratrain {

// Note [Gathers in the compute type]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under autocast to bf16 (Precision::autocast), ZeRO-3 gathers each unit's parameters in
// bf16, as FSDP's MixedPrecision(param_dtype) does: every rank casts its fp32 shard (the
// master weights, which the optimizer steps) to bf16 and the unit is all-gathered in
// bf16 — half the bytes — into a bf16 pool slot; for the unit's forward and backward its
// parameters *are* bf16 views of that slot. Autocast then has nothing to cast (a bf16
// weight is already in its type) and keeps no copy: the products' backward saves the
// parameter itself, whose memory is released after forward and gathered again before
// backward, so the 2 bytes per parameter of autocast's copies (Note [Mixed precision])
// are gone for units. The values are those of autocast's own cast, bitwise: the same fp32
// number rounded to bf16 once, and autograd widens the bf16 gradient to fp32 before it is
// accumulated (an edge's gradient takes the type its destination had when autograd met
// it, fp32), as the cast's backward does on one device. Differences from one device
// remain where autocast runs an operation in fp32 on a unit's weight (layer norm,
// embedding lookups, a loss): it sees the bf16-rounded weight, and its gradient is rounded
// to bf16 once on the way back — FSDP's behaviour too; Precision::gather = at::kFloat
// gathers fp32 instead, autocast then casts as on one device.
//
// Only a bucket all of whose parameters autocast casts to bf16 is gathered so: a weight
// used as it is by an operation autocast leaves alone or runs in fp32 (layer norm's,
// an embedding's) must stay fp32, or that operation would see a rounded weight or fail
// on mixed types. So the first training steps gather fp32, and after each unit's first
// forward with autograd on, the graph behind its output tells which of its parameters
// reach their gradient accumulator only through a cast to bf16 (ToCopyBackward0 of bf16
// type); the ranks agree on it in the first step() (one small all-reduce, the minimum of
// 0 = no, 1 = yes, 2 = not seen yet, repeated until nothing is unseen), and from the next
// step on those buckets are gathered in bf16. Every rank thus takes the same decision,
// which the gathers' sizes need. An MLP's or a convolutional net's buckets all qualify; a
// Transformer layer's bucket, holding its layer norms, stays fp32 unless the norms are a
// unit of their own; so does a unit that recomputes (Unit<Recompute<Layer>> with
// recomputation on), whose forward leaves only the recomputation's node to read.
// Precision::gather = at::kFloat turns it off.
//
// A parameter changes type in place (TensorImpl::shallow_copy_from onto a view of the
// slot, and back onto its fp32 view when released), not through Tensor::set_data: for a
// change of type set_data drops the parameter's gradient accumulator, which carries
// GradientBuckets' hooks and whose fp32 metadata is what widens the gradient. Which type
// a gather uses is decided when the unit's forward starts: bf16 when autocast to bf16 is
// on (training and predict), fp32 otherwise (with_gathered, a forward outside autocast);
// its backward gathers in the type its forward did, and a joined rank replays the types
// with the gathers (Note [Joining at stage 3]).

namespace detail {

/// Which of a sharded model's unit buckets are gathered in the compute type, and the
/// parameters' two faces (Note [Gathers in the compute type]). Inert without a compute type.
class ComputeTypeGathers {
 public:
  ComputeTypeGathers() = default;
  ComputeTypeGathers(const BucketLayout& layout, std::optional<at::ScalarType> type)
      : layout_(&layout), type_(type), narrow_(layout.buckets().size(), 0), seen_(layout.buckets().size(), unseen) {}

  [[nodiscard]] bool on() const noexcept { return type_.has_value(); }
  [[nodiscard]] at::ScalarType own_type() const { return layout_->buckets().front().options.dtype().toScalarType(); }

  /// Bucket b's buffer in the compute type, storage-less like its `full`, and its parameters'
  /// views of both (made while the storages still say their sizes).
  void add_views(std::size_t b, FlatShard& s) {
    s.compute = storage_less(s.full.numel(), s.full.options().dtype(*type_));
    for (auto i : layout_->buckets()[b].params) {
      const auto& p = layout_->params()[i];
      // The parameter's data is its view of `full` (set when it moved into the bucket).
      views_.emplace(i, Views{p.tensor.variable_data(), layout_->view(s.compute, i)});
    }
    release_storage(s.compute);
  }

  /// The type a unit's forward gathers in now: the compute type under autocast to it.
  [[nodiscard]] at::ScalarType forward_type() const {
    if (!type_) return own_type();
    const auto device = layout_->buckets().front().options.device();
    const auto kind = device.is_cuda() ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
    return autocast_enabled(kind) && autocast_dtype(kind) == *type_ ? *type_ : own_type();
  }
  /// Whether bucket b is gathered in `type` other than its own.
  [[nodiscard]] bool narrowed(std::size_t b, at::ScalarType type) const { return type != own_type() && narrow_[b]; }
  /// The type bucket b's pool slot is laid out for.
  [[nodiscard]] at::ScalarType slot_type(std::size_t b) const { return narrow_[b] ? *type_ : own_type(); }
  /// Whether a forward's graph is still to be read and the ranks' decision still to be made.
  [[nodiscard]] bool undecided() const noexcept { return type_.has_value() && !decided_; }

  /// Which of a unit's `buckets` reach their gradient accumulators only through a cast to
  /// the compute type (ToCopyBackward0 of that type), possibly after views of them (linear
  /// casts its weight's transpose, attention slices of its packed weight), read off the
  /// graph behind its output `out`, the first time.
  void see(const std::vector<std::size_t>& buckets, const at::Tensor& out) {
    using torch::autograd::Node;
    if (buckets.empty() || seen_[buckets.front()] != unseen) return;
    const auto& layout = *layout_;
    std::map<const Node*, std::size_t> accumulator;  // -> layout parameter
    for (auto b : buckets)
      for (auto i : layout.buckets()[b].params)
        if (auto a = torch::autograd::impl::try_get_grad_accumulator(layout.params()[i].tensor))
          accumulator.emplace(a.get(), i);
    // Every node behind `out`, and for each the nodes that use its output (its parents here).
    std::map<const Node*, std::vector<const Node*>> users;
    std::vector<Node*> todo{out.grad_fn().get()};
    std::set<const Node*> visited;
    while (!todo.empty()) {
      auto* node = todo.back();
      todo.pop_back();
      if (node == nullptr || !visited.insert(node).second) continue;
      for (const auto& edge : node->next_edges())
        if (edge.function) {
          users[edge.function.get()].push_back(node);
          if (!accumulator.count(edge.function.get())) todo.push_back(edge.function.get());
        }
    }
    const auto type = c10::scalarTypeToTypeMeta(*type_);
    std::map<const Node*, bool> memo;
    // Whether every use of `node`'s output is a cast to the compute type, through views.
    const std::function<bool(const Node*)> only_cast = [&](const Node* node) {
      const auto it = users.find(node);
      if (it == users.end() || it->second.empty()) return false;
      if (const auto m = memo.find(node); m != memo.end()) return m->second;
      bool all = true;
      for (const auto* user : it->second) {
        const auto name = user->name();
        if (name == "ToCopyBackward0" && user->num_inputs() == 1 && user->input_metadata(0).dtype() == type) continue;
        all = all && view_like(name) && only_cast(user);
      }
      return memo[node] = all;
    };
    for (auto b : buckets) {
      bool all = true;
      for (auto i : layout.buckets()[b].params) {
        const auto a = torch::autograd::impl::try_get_grad_accumulator(layout.params()[i].tensor);
        all = all && a && only_cast(a.get());
      }
      seen_[b] = all ? 1 : 0;
    }
  }

  /// The ranks agree on what each saw (minimum of 0 no, 1 yes, 2 unseen; a resident bucket
  /// is no); applied at the next apply_agreed(), when nothing is gathered. Collective over `comm`.
  template <class Comm>
  void agree(Comm& comm, const std::vector<FlatShard>& shards) {
    auto codes = at::empty({static_cast<std::int64_t>(seen_.size())}, at::kInt);
    for (std::size_t b = 0; b < seen_.size(); ++b)
      codes[static_cast<std::int64_t>(b)] = shards[b].resident ? 0 : static_cast<int>(seen_[b]);
    all_reduce_on(comm, codes, layout_->buckets().front().options.device(), reduce_op::min);
    codes = codes.cpu();
    decided_ = true;
    for (std::size_t b = 0; b < seen_.size(); ++b) {
      seen_[b] = static_cast<std::int8_t>(codes[static_cast<std::int64_t>(b)].item<int>());
      decided_ = decided_ && seen_[b] != unseen;
    }
    agreed_ = true;
  }
  /// Applies the ranks' last agreement, if one is waiting; true when it did (the slots'
  /// layout then changes).
  bool apply_agreed() {
    if (!agreed_) return false;
    agreed_ = false;
    for (std::size_t b = 0; b < seen_.size(); ++b) narrow_[b] = seen_[b] == 1 ? 1 : 0;
    return true;
  }

  /// Every narrowed parameter of `buckets` (gathered in `type`) becomes its view of the
  /// compute-type buffer (or back of its own), keeping its autograd identity.
  void retype(const std::vector<std::size_t>& buckets, at::ScalarType type, bool compute) {
    for (auto b : buckets)
      if (narrowed(b, type))
        for (auto i : layout_->buckets()[b].params) {
          const auto& v = views_.at(i);
          layout_->params()[i].tensor.unsafeGetTensorImpl()->shallow_copy_from(
              (compute ? v.compute : v.own).getIntrusivePtr());
        }
  }

  /// The parameters gathered in the compute type, and whether that is every parameter of
  /// every unit.
  [[nodiscard]] std::pair<double, bool> narrow_parameters(const std::vector<FlatShard>& shards) const {
    double n = 0;
    bool all = true;
    for (std::size_t b = 0; b < shards.size(); ++b) {
      if (shards[b].resident) continue;
      if (!narrow_[b]) {
        all = false;
        continue;
      }
      for (auto i : layout_->buckets()[b].params) n += static_cast<double>(layout_->params()[i].tensor.numel());
    }
    return {n, all && n > 0};
  }

 private:
  // A unit's parameter in both types it is gathered in.
  struct Views {
    at::Tensor own;      // its view of its bucket's `full`
    at::Tensor compute;  // its view of the bucket's `compute`
  };

  // Backward nodes of operations that only view their input (same values, same type).
  static bool view_like(const std::string& name) {
    static const std::set<std::string> views{
        "TBackward0",         "TransposeBackward0", "PermuteBackward0",     "ViewBackward0",
        "UnsafeViewBackward0", "ReshapeAliasBackward0", "AliasBackward0",   "ExpandBackward0",
        "SliceBackward0",     "SelectBackward0",    "UnsqueezeBackward0",   "SqueezeBackward0",
        "SqueezeBackward1",   "AsStridedBackward0", "SplitBackward0",       "SplitWithSizesBackward0",
        "UnbindBackward0",    "NarrowBackward0"};
    return views.count(name) > 0;
  }

  static constexpr std::int8_t unseen = 2;
  const BucketLayout* layout_ = nullptr;
  std::optional<at::ScalarType> type_;
  // Per bucket: whether it is gathered in the compute type; what this rank saw of it
  // (unseen until a unit's first forward with autograd). Whether the ranks have decided
  // all, and a decision waiting to be applied.
  std::vector<char> narrow_;
  std::vector<std::int8_t> seen_;
  bool decided_ = false;
  bool agreed_ = false;
  std::map<std::size_t, Views> views_;  // by layout parameter
};

}  // namespace detail
}  // namespace paratrain
