#pragma once
/// \file
/// The parameter side of ZeRO: flat parameter buffers over a BucketLayout, this rank's
/// shard of them, the optimizer over its pieces, and ZeRO-3's gather / free per Unit.

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <chrono>
#include <concepts>
#include <functional>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "paratrain/concepts/checkpointable.hpp"
#include "paratrain/concepts/communicator.hpp"
#include "paratrain/collectives/all_reduce_on.hpp"
#include "paratrain/strategy/detail/tensor_bytes.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/collectives/model_device.hpp"
#include "paratrain/comm/mesh.hpp"
#include "paratrain/strategy/buckets/bucket_layout.hpp"
#include "paratrain/strategy/buckets/gradient_buckets.hpp"
#include "paratrain/strategy/buckets/gradient_storage.hpp"
#include "paratrain/strategy/memory_check.hpp"
#include "paratrain/strategy/stores/parameter_store.hpp"
#include "paratrain/strategy/precision.hpp"
#include "paratrain/util/torch_compat.hpp"
#include "paratrain/strategy/detail/slot_pool.hpp"
#include "paratrain/strategy/detail/state_slices.hpp"
#include "paratrain/strategy/stores/sharded_construction.hpp"
#include "paratrain/strategy/unit.hpp"

namespace paratrain {

// Note [Optimizer on pieces]
// The sharded optimizer is the user's optimizer type, unmodified, constructed over the
// pieces of this rank's shard (Note [Shard layout]): one leaf tensor per parameter that
// overlaps the shard, a view into the flat parameter storage, with a gradient that is a
// view into the reduced gradient. Every torch::optim optimizer (SGD, Adam, AdamW,
// RMSprop, Adagrad and subclasses of them) updates each element from that element's
// gradient and state alone, so stepping the pieces equals stepping the whole parameters
// and keeping this rank's part. Because pieces are per parameter, they keep what a flat
// shard would lose: each parameter's group (different weight decay, learning rate; fit's
// schedule sets every group), and a parameter no rank used this step has no gradient,
// so the optimizer skips it exactly as on one device. An optimizer that couples the
// elements of a parameter (LAMB's trust ratio, Shampoo) would need the whole parameter
// and is not supported sharded.

// Note [Hybrid sharding]
// With DataParallelOptions::shard_group = G (a divisor of the world size W), ZeRO shards
// over groups of G consecutive ranks and replicates across the W/G groups, as FSDP2's
// 2-D mesh (HSDP), ZeRO++'s hpZ and Megatron's distributed-optimizer instances do: the
// sharding traffic (every all-gather, and the reduce-scatter) stays inside a group, a
// node's ranks say, and only each shard's sum crosses groups. Two communicators are split
// once at construction: `group` (the G ranks of this rank's group, rank r at index r % G)
// and `replicas` (the W/G ranks holding the same shard, one per group). A bucket is padded
// to a multiple of G and cut into G shards; its gradients are reduce-scattered in the
// group, then the shard all-reduced across the replicas (one request, started in bucket
// order when the reduce-scatter completes: Note [Bucket order] keeps both streams in
// order on every rank); parameters are all-gathered in the group. Everything that
// involves all ranks (the step agreement, the sample count, clipping's norm of the
// shards: summed over one group, which holds every shard once) is unchanged. Checkpoints
// list each rank's pieces as today; the replicas outside group 0 mark theirs as copies
// (TensorSlice::saved false), so that every element is written once and loaded by all.

// Note [Gathers in the compute type]
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

/// The units of `model` (Note [Units]) in registration order, and for each parameter
/// that requires a gradient the innermost unit that holds it.
struct UnitMap {
  std::vector<UnitBase*> units;
  std::vector<std::string> names;    // each unit's name in the model
  std::map<const void*, int> owner;  // TensorImpl* -> unit
};

inline UnitMap find_units(torch::nn::Module& model) {
  UnitMap map;
  for (const auto& m : model.named_modules(/*name_prefix=*/"", /*include_self=*/true))
    if (auto* u = dynamic_cast<UnitBase*>(m.value().get())) {
      const int index = static_cast<int>(map.units.size());
      map.units.push_back(u);
      map.names.push_back(m.key().empty() ? std::string("(the model)") : m.key());
      for (const auto& p : m.value()->parameters(/*recurse=*/true)) map.owner[p.unsafeGetTensorImpl()] = index;
    }
  return map;
}

/// The bytes of the shards units built inside a ShardedConstruction hold on this rank.
inline double constructed_shard_bytes(torch::nn::Module& model) {
  double n = 0;
  for (const auto& m : model.modules(/*include_self=*/true))
    if (auto* u = dynamic_cast<UnitBase*>(m.get()); u != nullptr && u->constructed())
      for (const auto& t : u->constructed()->shard) n += static_cast<double>(bytes_of(t));
  return n;
}

/// The parameters that units built inside a ShardedConstruction hold as shards only:
/// no rank has them whole (Note [Sharded construction]).
inline std::set<const void*> sharded_at_construction(torch::nn::Module& model) {
  std::set<const void*> out;
  for (const auto& m : model.modules(/*include_self=*/true))
    if (auto* u = dynamic_cast<UnitBase*>(m.get()); u != nullptr && u->constructed())
      for (const auto& p : u->constructed()->layout.params()) out.insert(p.tensor.unsafeGetTensorImpl());
  return out;
}

/// Each parameter's group index in `groups`; throws naming a parameter that is in none.
inline std::map<const void*, std::size_t> group_of(const BucketLayout& layout, const ParamGroups& groups, int rank) {
  std::map<const void*, std::size_t> index;
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (const auto& p : groups[g].params()) index.emplace(p.unsafeGetTensorImpl(), g);
  for (const auto& p : layout.params())
    if (!index.count(p.tensor.unsafeGetTensorImpl()))
      throw error("Sharded", rank,
                  "parameter '" + p.name +
                      "' is in no parameter group; list every parameter that requires a gradient in exactly one "
                      "OptimizerParamGroup");
  return index;
}

}  // namespace detail

/// ZeRO's parameters and optimizer: stage 1/2 keep every parameter whole in flat buffers
/// and all-gather the updated shards after each step; stage 3 keeps only the shard of a
/// Unit's parameters at rest and gathers them around the unit's forward and backward,
/// prefetching the next unit's while one computes.
template <class Comm, class Optim, int Stage>
class ShardedParameters final : public detail::UnitObserver {
 public:
  using optimizer_type = Optim;
  /// Stages 2 and 3 keep only this rank's shard of the summed gradients.
  using gradient_storage = std::conditional_t<(Stage >= 2), ShardedGradients, WholeGradients>;
  /// At stage 3 forward gathers each Unit's parameters: Note [Unusable batches].
  static constexpr bool gathers_in_forward = Stage == 3;
  static constexpr plan::stage planned_stage = static_cast<plan::stage>(Stage);

  /// `build()`, placed as `options.build` says (default: the communicator's device); at
  /// stage 3 inside a ShardedConstruction over the data-shard ranks, so that each Unit keeps
  /// only this rank's shard from the moment it is built (Note [Sharded construction]).
  template <class Build>
  static auto construct(Build& build, Mesh<Comm>& mesh, const StoreOptions& options) {
    const auto device = detail::communicator_device(mesh.world());
    if constexpr (Stage < 3) return detail::build_placed(build, options.build, device);
    else
      return detail::build_placed(build, options.build, device,
                                  detail::ShardOf{mesh.index(Dim::shard), mesh.size(Dim::shard)},
                                  options.bucketing.cap_bytes);
  }

  /// The memory plan of `model` sharded so over the mesh's data-shard ranks (Note [Checking
  /// the plan]): its buckets as the store will lay them out.
  template <class OptimOptions>
  static plan::Model plan(torch::nn::Module& model, Mesh<Comm>& mesh, const StoreOptions& options,
                          const OptimOptions& optimizer, const PlanInputs& inputs) {
    detail::UnitMap units;
    if constexpr (Stage == 3) units = detail::find_units(model);
    const BucketLayout probe(model, padded(options, mesh), unit_of(units), mesh.rank());
    return detail::plan_of(model, mesh.size(Dim::shard), detail::largest_bucket(probe), options.prefetch, optimizer,
                           inputs.autocast, inputs.narrow_reduce, inputs.activation_bytes);
  }

  /// Buckets `model`'s parameters, padded to the number of ranks (Note [Shard layout]),
  /// each Unit's in buckets of its own at stage 3 (Note [Units]); moves them into the flat
  /// buffers and builds the optimizer over this rank's pieces. Collective (stage 3 splits
  /// off the communicator its gathers use: Note [Two communicators]).
  template <class OptimOptions>
  ShardedParameters(torch::nn::Module& model, Mesh<Comm>& mesh, const StoreOptions& options,
                    const ParamGroups& groups, OptimOptions defaults)
      : ShardedParameters(units_of(model, mesh.rank()), model, mesh, options, groups, std::move(defaults)) {}

  ShardedParameters(const ShardedParameters&) = delete;
  ShardedParameters& operator=(const ShardedParameters&) = delete;
  ~ShardedParameters() {
    for (auto* u : units_) u->attach(nullptr, 0);
  }

  [[nodiscard]] const BucketLayout& layout() const noexcept { return layout_; }
  [[nodiscard]] Optim& optimizer() noexcept { return *optimizer_; }
  /// Stages 2 and 3 keep this rank's shard of the summed gradients, summed over the ranks it
  /// shards with, then (hybrid sharding) across those holding the same shard in the other
  /// groups (Note [Hybrid sharding]); stage 1 keeps the whole sum, over every data rank.
  [[nodiscard]] gradient_storage gradients() const {
    if constexpr (Stage >= 2) return ShardedGradients(layout_, group_.rank());
    else return WholeGradients(layout_);
  }
  [[nodiscard]] Comm& gradient_group() noexcept { return Stage >= 2 ? group_ : *data_; }
  [[nodiscard]] Comm* gradient_replicas() noexcept { return Stage >= 2 && replicas_ ? &*replicas_ : nullptr; }
  /// The sums are cut along the data-shard dimension from stage 2 on.
  [[nodiscard]] Dims partitions() const noexcept { return Stage >= 2 ? Dims(Dim::shard) : Dims(); }

  /// Steps this rank's pieces with the reduced gradients in `grads`, then rebuilds the
  /// whole parameters that stay resident (stages 1 and 2; stage 3's root parameters).
  template <class Storage>
  void step(const GradientBuckets<Comm, Storage>& grads) {
    for (auto& piece : pieces_) {
      auto& g = piece.tensor.mutable_grad();
      const auto b = piece.bucket;
      if (grads.used_anywhere(piece.param))  // this rank's shard, from its sum whole or sharded
        g = grads.output(b).narrow(0, shard_begin(b) - grads.output_offset(b) + piece.begin, piece.tensor.numel());
      else
        g = at::Tensor();
    }
    optimizer_->step();
    std::vector<GatherRequest> gathers;
    for (auto& s : shards_)
      if (s.resident) gathers.push_back(group_.iall_gather(s.shard, s.full));
    {
      const Waiting waiting(exposed_);
      for (auto& r : gathers) r.wait();
    }
    if (gather_type_ && !decided_) agree_on_narrow_buckets();
  }

  /// Runs `f` with every unit's parameters gathered (stage 3), then frees them again.
  /// Collective at stage 3: every rank calls it.
  template <class F>
  void with_gathered(F&& f) {
    for (std::size_t u = 0; u < units_.size(); ++u) gather(u, own_type());
    f();
    for (std::size_t u = 0; u < units_.size(); ++u) release(u);
  }

  /// Starts a new step's record of unit gathers (what a rank that joins replays).
  void begin_step() {
    exposed_ = 0;
    if (agreed_ && std::none_of(units_state_.begin(), units_state_.end(),
                                [](const UnitState& u) { return u.gathered || !u.inflight.empty(); }))
      apply_narrow_buckets();
    sequence_.clear();
    for (auto& u : units_state_) u.complete = 0;  // a backward that threw midway left counts
  }
  /// Ends a step that had data: its gathers become the ones a joined rank replays.
  void end_step() {
    for (std::size_t u = 0; u < units_.size(); ++u) release(u);  // a prefetch no unit used
    if (!sequence_.empty()) replay_.swap(sequence_);
  }

  // Note [Joining at stage 3]
  // A rank with no batch must still take part in every gather the others make. Their
  // sequence of unit gathers is a function of the model's forward and backward, the
  // same every step, so a joined rank replays the sequence of its own last step with
  // data: gathers in the same order on the gather communicator, while its (empty)
  // gradients are reduce-scattered in bucket order on the other one.
  void replay_gathers(int rank) {
    if (!units_.empty() && replay_.empty())
      throw error("DataParallel::join", rank,
                  "at ZeRO stage 3 a rank joins by repeating the unit gathers of its last step, and this rank has "
                  "had no step yet; give every rank at least one batch (DistributedSampler does)");
    for (auto [u, type] : replay_) {
      gather(u, type);
      release(u);
    }
  }

  /// Called when every gradient of bucket `b` is ready: a stage-3 unit whose buckets are
  /// all complete has finished its backward, and its parameters are freed.
  void on_gradients_complete(std::size_t b) {
    const int unit = layout_.buckets()[b].unit;
    if (Stage < 3 || unit < 0) return;
    auto& u = units_state_[static_cast<std::size_t>(unit)];
    if (++u.complete == static_cast<int>(u.buckets.size())) {
      u.complete = 0;
      release(static_cast<std::size_t>(unit));
    }
  }

  /// Seconds this step has blocked on parameter gathers: ZeRO-3's gathers of units that
  /// were not complete when needed, and stages 1-2's gathers of the updated shards.
  [[nodiscard]] double exposed_seconds() const noexcept { return exposed_; }

  /// The parameters gathered in the compute type under autocast (Note [Gathers in the
  /// compute type]), and whether that is every parameter of every unit.
  [[nodiscard]] std::pair<double, bool> narrow_parameters() const {
    double n = 0;
    bool all = !units_state_.empty();
    for (std::size_t b = 0; b < shards_.size(); ++b) {
      if (shards_[b].resident) continue;
      if (!narrow_[b]) {
        all = false;
        continue;
      }
      for (auto i : layout_.buckets()[b].params) n += static_cast<double>(layout_.params()[i].tensor.numel());
    }
    return {n, all && n > 0};
  }

  /// The plan once the strategy runs: at stage 3 under autocast, from the step on which the
  /// ranks agreed which units are gathered in bf16 (Note [Gathers in the compute type]), the
  /// units so gathered count in bf16; before, fp32 gathers and every autocast copy.
  [[nodiscard]] plan::Model planned(plan::Model m) const {
    if constexpr (Stage == 3) {
      const auto [narrow, all] = narrow_parameters();
      m.narrow_parameters = narrow;
      if (all) m.gather_bytes = 2.0;
    }
    return m;
  }

  /// The bytes held between steps (stage 3: only the shards of unit parameters).
  [[nodiscard]] ModelStateBytes bytes() const {
    ModelStateBytes out;
    for (const auto& s : shards_) out.parameters += s.resident ? detail::bytes_of(s.full) : detail::bytes_of(s.shard);
    out.optimizer_state = detail::optimizer_state_bytes(*optimizer_);
    return out;
  }

  /// This rank's slices (paratrain::checkpointable): the optimizer's pieces; parameters
  /// whole where they stay resident, else (stage 3 units) this rank's pieces of them.
  [[nodiscard]] CheckpointLayout checkpoint_layout(const torch::nn::Module& model) const {
    CheckpointLayout out;
    std::map<const void*, std::size_t> index;  // TensorImpl -> layout param
    for (std::size_t i = 0; i < layout_.params().size(); ++i)
      index.emplace(layout_.params()[i].tensor.unsafeGetTensorImpl(), i);
    std::map<std::size_t, const Piece*> piece_of;  // layout param -> this rank's piece (one at most)
    for (const auto& piece : pieces_) piece_of.emplace(piece.param, &piece);
    const auto slice_of = [&](const std::string& name, const at::Tensor& whole, std::size_t i) {
      TensorSlice s{name, whole.sizes().vec(), 0, at::empty({0}, whole.options()), /*replicated=*/false};
      s.saved = !replicas_ || replicas_->rank() == 0;  // Note [Hybrid sharding]
      if (auto it = piece_of.find(i); it != piece_of.end()) {
        const auto& piece = *it->second;
        s.begin = shard_begin(piece.bucket) + piece.begin - layout_.params()[i].offset;
        s.tensor = piece.tensor;
      }
      return s;
    };
    for (const auto& p : model.named_parameters(/*recurse=*/true)) {
      const auto it = index.find(p.value().unsafeGetTensorImpl());
      if (it != index.end() && !shards_[layout_.params()[it->second].bucket].resident)
        out.model.push_back(slice_of(p.key(), p.value(), it->second));
      else
        out.model.push_back(detail::whole_slice(p.key(), p.value()));
    }
    detail::add_buffers(model, out);
    for (const auto& piece : pieces_) {
      const auto& p = layout_.params()[piece.param];
      out.optimized.push_back(slice_of(p.name, p.tensor, piece.param));
    }
    return out;
  }

  // ---- detail::UnitObserver (stage 3) ---------------------------------------------
  void before_forward(std::size_t u) override {
    // Note [Gathers in the compute type]: the type this forward computes in.
    const auto type = forward_type();
    gather(u, type);
    units_state_[u].forward_type = type;
    for (std::size_t k = 1; k <= prefetch_ && u + k < units_.size(); ++k) prefetch(u + k, type);
  }
  void after_forward(std::size_t u, const at::Tensor& out) override {
    if (gather_type_ && !decided_ && at::GradMode::is_enabled() && out.requires_grad()) see_casts(u, out);
    release(u);
  }
  void before_backward(std::size_t u) override {
    gather(u, units_state_[u].forward_type);
    for (std::size_t k = 1; k <= prefetch_ && k <= u; ++k) prefetch(u - k, units_state_[u - k].forward_type);
  }

 private:
  // Units matter at stage 3 only (Note [Units]); below, every parameter is resident.
  static detail::UnitMap units_of(torch::nn::Module& model, int rank) {
    if constexpr (Stage < 3) {
      return {};
    } else {
      auto units = detail::find_units(model);
      if (units.units.empty())
        throw error("DataParallel", rank,
                    "ZeRO stage 3 gathers parameters unit by unit, and this model declares no unit: declare its "
                    "layers or blocks as paratrain::Unit<Layer> (Note [Units], docs/sharding.md), or use stage 2");
      return units;
    }
  }
  // Each bucket padded to a multiple of the ranks it is sharded over: Note [Shard layout].
  static BucketOptions padded(const StoreOptions& options, Mesh<Comm>& mesh) {
    auto bucketing = options.bucketing;
    bucketing.pad_to = mesh.size(Dim::shard);
    return bucketing;
  }
  // The unit that holds each parameter (Note [Units]); -1: none.
  static auto unit_of(const detail::UnitMap& units) {
    return [&units](auto&, const at::Tensor& p) {
      const auto it = units.owner.find(p.unsafeGetTensorImpl());
      return it != units.owner.end() ? it->second : -1;
    };
  }

  template <class OptimOptions>
  ShardedParameters(detail::UnitMap units, torch::nn::Module& model, Mesh<Comm>& mesh, const StoreOptions& options,
                    const ParamGroups& groups, OptimOptions defaults)
      : layout_(model, padded(options, mesh), unit_of(units), mesh.rank()),
        data_(&mesh.group(Dims::data())),
        group_(mesh.group(Dim::shard)),
        replicas_(mesh.size(Dim::replicate) > 1 ? std::optional<Comm>(mesh.group(Dim::replicate)) : std::nullopt),
        gather_comm_(gather_communicator(group_)),
        units_(std::move(units.units)),
        prefetch_(static_cast<std::size_t>(std::max(0, options.prefetch))),
        gather_type_(Stage == 3 ? options.gather : std::nullopt) {
    const auto& layout = layout_;
    const auto rank = mesh.rank();
    const auto& buckets = layout.buckets();
    c10::NoGradGuard no_grad;
    // Note [Sharded construction]: units built sharded hand over their buckets.
    std::vector<std::shared_ptr<detail::ConstructedUnit>> constructed;
    for (auto* u : units_) constructed.push_back(u->take_constructed());
    std::vector<std::size_t> adopted(units_.size(), 0);
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      auto& s = shards_.emplace_back();
      const int unit = buckets[b].unit;
      s.resident = Stage < 3 || unit < 0;
      if (!s.resident) units_state_.at(static_cast<std::size_t>(unit)).buckets.push_back(b);
      if (!s.resident && constructed[static_cast<std::size_t>(unit)]) {
        const auto& built = *constructed[static_cast<std::size_t>(unit)];
        const auto k = adopted[static_cast<std::size_t>(unit)]++;
        check_adoptable(built, k, b, units.names[static_cast<std::size_t>(unit)]);
        s.full = built.full[k];
        s.shard = built.shard[k];
      } else {
        s.full = layout.zeros(b);
        for (auto i : buckets[b].params) {
          const auto& p = layout.params()[i];
          auto view = layout.view(s.full, i);
          view.copy_(p.tensor.detach());
          p.tensor.set_data(view);  // the parameter now lives in the flat buffer
        }
        const auto n = layout.shard_numel(b);
        const auto at = group_.rank() * n;  // this rank's shard in its group: Note [Hybrid sharding]
        s.shard = s.resident ? s.full.narrow(0, at, n) : s.full.narrow(0, at, n).clone();
        if (!s.resident) detail::release_storage(s.full);
      }
      if (!s.resident && gather_type_) add_compute_views(b);
    }
    check_same_initialisation(constructed, units.names);
    narrow_.assign(shards_.size(), 0);
    seen_.assign(shards_.size(), unseen);
    lay_out_pool();
    make_pieces();
    // Note [Optimizer on pieces]: the user's groups and options, over this rank's pieces.
    const auto group = detail::group_of(layout, groups, rank);
    std::vector<std::vector<at::Tensor>> pieces_of(groups.size());
    for (const auto& piece : pieces_)
      pieces_of[group.at(layout.params()[piece.param].tensor.unsafeGetTensorImpl())].push_back(piece.tensor);
    ParamGroups shard_groups;
    for (std::size_t g = 0; g < groups.size(); ++g) {
      // A group with nothing in this shard still exists, so that group indices and the
      // learning-rate schedule mean the same on every rank; its one empty tensor never
      // has a gradient, so the optimizer skips it.
      if (pieces_of[g].empty()) pieces_of[g].push_back(at::empty({0}, buckets.front().options));
      if (groups[g].has_options())
        shard_groups.emplace_back(pieces_of[g], groups[g].options().clone());
      else
        shard_groups.emplace_back(pieces_of[g]);
    }
    optimizer_ = std::make_unique<Optim>(std::move(shard_groups), std::move(defaults));
    for (std::size_t u = 0; u < units_.size(); ++u) units_[u]->attach(this, u);
  }

  struct Shard {
    at::Tensor full;   // the whole bucket, padded; stage 3 units: storage only while gathered
    at::Tensor shard;  // this rank's part: a view of `full` when resident, else its own storage
    bool resident = true;
    at::Tensor compute;  // stage 3 with gathers in the compute type: the bucket in that type
  };
  // A unit's parameter in both types it is gathered in: Note [Gathers in the compute type].
  struct Views {
    at::Tensor own;      // its view of its bucket's `full`
    at::Tensor compute;  // its view of the bucket's `compute`
  };
  struct Piece {
    at::Tensor tensor;      // a view into its bucket's shard: what the optimizer steps
    std::size_t param = 0;  // in the layout
    std::size_t bucket = 0;
    std::int64_t begin = 0;  // offset in the shard
  };
  using GatherRequest = decltype(std::declval<Comm&>().iall_gather(std::declval<const at::Tensor&>(),
                                                                   std::declval<at::Tensor&>()));
  struct UnitState {
    std::vector<std::size_t> buckets;
    std::vector<std::size_t> offsets;  // of each bucket in a pool slot, in bytes
    std::vector<GatherRequest> inflight;
    std::vector<at::Tensor> sent;  // the shards in the compute type, while their gathers are in flight
    int slot = -1;  // the pool's slot its buckets are gathered into; -1: the allocator's
    bool gathered = false;
    at::ScalarType type = at::kFloat;          // what it is gathered in (while gathered or in flight)
    at::ScalarType forward_type = at::kFloat;  // what its last forward computed in
    int complete = 0;
  };

  // Note [Two communicators]
  // At stage 3 the parameter gathers of backward interleave with the gradient
  // reduce-scatters, and where exactly depends on when each rank's gradients become
  // ready. MPI requires one order of collectives per communicator, so the gathers use a
  // communicator of their own (split once, at construction): each stream is in a fixed
  // order on every rank, whatever their interleaving.
  static Comm gather_communicator(Comm& comm) {
    if constexpr (Stage == 3) return comm.split(0, comm.rank());
    else return comm;
  }

  [[nodiscard]] std::int64_t shard_begin(std::size_t b) const {
    return group_.rank() * layout_.shard_numel(b);
  }

  void make_pieces() {
    for (std::size_t b = 0; b < shards_.size(); ++b) {
      const auto begin = shard_begin(b), end = begin + layout_.shard_numel(b);
      for (auto i : layout_.buckets()[b].params) {
        const auto& p = layout_.params()[i];
        const auto lo = std::max(begin, p.offset), hi = std::min(end, p.offset + p.tensor.numel());
        if (lo >= hi) continue;
        pieces_.push_back({shards_[b].shard.narrow(0, lo - begin, hi - lo), i, b, lo - begin});
      }
    }
  }

  /// Bucket `b` of the layout is bucket `k` of a unit built sharded, parameter for parameter.
  void check_adoptable(const detail::ConstructedUnit& built, std::size_t k, std::size_t b, const std::string& name) const {
    const auto& want = layout_.buckets()[b];
    bool same = k < built.full.size() && built.layout.buckets()[k].params.size() == want.params.size() &&
                built.layout.buckets()[k].padded == want.padded;
    for (std::size_t j = 0; same && j < want.params.size(); ++j)
      same = built.layout.params()[built.layout.buckets()[k].params[j]].tensor.unsafeGetTensorImpl() ==
             layout_.params()[want.params[j]].tensor.unsafeGetTensorImpl();
    if (!same)
      throw error("DataParallel", data_->rank(),
                  "unit '" + name +
                      "' was built sharded, but the model lays its parameters out differently from the unit alone "
                      "(a parameter it shares with another part of the model, or one of an inner unit between its "
                      "own); build such a model whole and pass it to the strategy instead");
  }

  /// Every rank's units built sharded came from the same initial values: one all-reduce
  /// of their hashes (Note [Sharded construction]). Collective.
  void check_same_initialisation(const std::vector<std::shared_ptr<detail::ConstructedUnit>>& constructed,
                                 const std::vector<std::string>& names) {
    const auto n = static_cast<std::int64_t>(constructed.size());
    if (std::none_of(constructed.begin(), constructed.end(), [](const auto& c) { return c != nullptr; })) return;
    auto h = at::zeros({2 * n}, at::kLong);
    for (std::int64_t u = 0; u < n; ++u) {
      const auto v = constructed[static_cast<std::size_t>(u)] ? constructed[static_cast<std::size_t>(u)]->checksum : 0;
      h[u] = v;
      h[n + u] = -v;
    }
    detail::all_reduce_on(*data_, h, layout_.buckets().front().options.device(), reduce_op::max);
    for (std::int64_t u = 0; u < n; ++u)
      if (h[u].item<std::int64_t>() != -h[n + u].item<std::int64_t>())
        throw error("DataParallel", data_->rank(),
                    "the ranks built unit '" + names[static_cast<std::size_t>(u)] +
                        "' with different initial values; a model built sharded is never broadcast from rank 0, so "
                        "every rank must draw the same values: seed every rank alike before building it "
                        "(torch::manual_seed(seed) with the same seed), or build the model whole and pass it instead");
  }

  [[nodiscard]] at::ScalarType own_type() const { return layout_.buckets().front().options.dtype().toScalarType(); }

  // The type a unit's forward gathers in now: Note [Gathers in the compute type].
  [[nodiscard]] at::ScalarType forward_type() const {
    if (!gather_type_) return own_type();
    const auto device = layout_.buckets().front().options.device();
    const auto kind = device.is_cuda() ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
    return detail::autocast_enabled(kind) && detail::autocast_dtype(kind) == *gather_type_ ? *gather_type_ : own_type();
  }

  // Bucket b in the compute type, storage-less like its `full`, and its parameters' views
  // of both (made while the storages still say their sizes).
  void add_compute_views(std::size_t b) {
    auto& s = shards_[b];
    s.compute = detail::storage_less(s.full.numel(), s.full.options().dtype(*gather_type_));
    for (auto i : layout_.buckets()[b].params) {
      const auto& p = layout_.params()[i];
      // The parameter's data is its view of `full` (set when it moved into the bucket).
      views_.emplace(i, Views{p.tensor.variable_data(), layout_.view(s.compute, i)});
    }
    detail::release_storage(s.compute);
  }

  // Note [Pooled transients]: a unit's buckets side by side in one slot, each in the type
  // forward gathers it in (Note [Gathers in the compute type]); a gather in another type
  // (with_gathered's fp32) takes the allocator's memory where it does not fit.
  void lay_out_pool() {
    std::size_t slot_bytes = 0;
    for (auto& state : units_state_) {
      std::size_t at = 0;
      state.offsets.clear();
      for (auto b : state.buckets) {
        state.offsets.push_back(at);
        const auto type = narrow_[b] ? *gather_type_ : own_type();
        at += (static_cast<std::size_t>(shards_[b].full.numel()) * c10::elementSize(type) + 63) / 64 * 64;
      }
      slot_bytes = std::max(slot_bytes, at);
    }
    if (!units_state_.empty())
      unit_pool_ = detail::SlotPool(slot_bytes, static_cast<int>(1 + prefetch_),
                                    layout_.buckets().front().options.device());
  }

  // Whether bucket b is gathered in `type` other than its own: Note [Gathers in the compute type].
  [[nodiscard]] bool narrowed(std::size_t b, at::ScalarType type) const { return type != own_type() && narrow_[b]; }

  // Note [Gathers in the compute type]: which parameters of unit u reach their gradient
  // accumulator only through a cast to the compute type (ToCopyBackward0 of that type),
  // possibly after views of them (linear casts its weight's transpose, attention slices of
  // its packed weight), read off the graph behind `out`.
  void see_casts(std::size_t u, const at::Tensor& out) {
    using torch::autograd::Node;
    const auto& state = units_state_[u];
    if (state.buckets.empty() || seen_[state.buckets.front()] != unseen) return;
    std::map<const Node*, std::size_t> accumulator;  // -> layout parameter
    for (auto b : state.buckets)
      for (auto i : layout_.buckets()[b].params)
        if (auto a = torch::autograd::impl::try_get_grad_accumulator(layout_.params()[i].tensor))
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
    const auto type = c10::scalarTypeToTypeMeta(*gather_type_);
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
    for (auto b : state.buckets) {
      bool all = true;
      for (auto i : layout_.buckets()[b].params) {
        const auto a = torch::autograd::impl::try_get_grad_accumulator(layout_.params()[i].tensor);
        all = all && a && only_cast(a.get());
      }
      seen_[b] = all ? 1 : 0;
    }
  }

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

  // The ranks agree on what each saw (minimum of 0 no, 1 yes, 2 unseen); applied at the
  // next begin_step, when nothing is gathered. Collective, in step().
  void agree_on_narrow_buckets() {
    auto codes = at::empty({static_cast<std::int64_t>(seen_.size())}, at::kInt);
    for (std::size_t b = 0; b < seen_.size(); ++b)
      codes[static_cast<std::int64_t>(b)] = shards_[b].resident ? 0 : static_cast<int>(seen_[b]);
    detail::all_reduce_on(*data_, codes, layout_.buckets().front().options.device(), reduce_op::min);
    codes = codes.cpu();
    decided_ = true;
    for (std::size_t b = 0; b < seen_.size(); ++b) {
      seen_[b] = static_cast<std::int8_t>(codes[static_cast<std::int64_t>(b)].item<int>());
      decided_ = decided_ && seen_[b] != unseen;
    }
    agreed_ = true;
  }

  void apply_narrow_buckets() {
    agreed_ = false;
    for (std::size_t b = 0; b < seen_.size(); ++b) narrow_[b] = seen_[b] == 1 ? 1 : 0;
    lay_out_pool();
  }

  // Every narrowed parameter of unit `state` becomes its view of `compute` (or back of
  // `own`), keeping its autograd identity: Note [Gathers in the compute type].
  void retype(const UnitState& state, bool compute) {
    for (auto b : state.buckets)
      if (narrowed(b, state.type))
        for (auto i : layout_.buckets()[b].params) {
          const auto& v = views_.at(i);
          layout_.params()[i].tensor.unsafeGetTensorImpl()->shallow_copy_from(
              (compute ? v.compute : v.own).getIntrusivePtr());
        }
  }

  // Gathers unit u in `type` into a pool slot, or (`pooled_only` false) into the
  // allocator's memory when no slot is free; false when it started nothing.
  bool launch(std::size_t u, at::ScalarType type, bool pooled_only = false) {
    auto& state = units_state_[u];
    // The slot as laid out for the compute type; fp32 where it was asked for instead.
    std::size_t bytes = 0;
    bool fits = true;  // an fp32 gather of a bucket laid out narrow does not fit its slot
    for (std::size_t k = 0; k < state.buckets.size() && fits; ++k) {
      const auto b = state.buckets[k];
      fits = type != own_type() || !narrow_[b];
      bytes = std::max(bytes, state.offsets[k] + static_cast<std::size_t>(shards_[b].full.numel()) *
                                                     c10::elementSize(narrowed(b, type) ? type : own_type()));
    }
    state.slot = fits ? unit_pool_.acquire(bytes) : -1;
    if (state.slot < 0 && pooled_only) return false;
    state.type = type;
    for (std::size_t k = 0; k < state.buckets.size(); ++k) {
      auto& s = shards_[state.buckets[k]];
      const bool narrow = narrowed(state.buckets[k], type);
      auto& full = narrow ? s.compute : s.full;
      if (state.slot >= 0) lend_storage(full, unit_pool_.data(state.slot) + state.offsets[k]);
      else detail::allocate_storage(full);
      auto& sent = narrow ? state.sent.emplace_back(s.shard.to(type)) : s.shard;
      state.inflight.push_back(gather_comm_.iall_gather(sent, full));
    }
    sequence_.emplace_back(u, type);
    return true;
  }

  // A prefetch waits for a free slot rather than growing the process (Note [Pooled transients]).
  void prefetch(std::size_t u, at::ScalarType type) {
    auto& state = units_state_[u];
    if (!state.gathered && state.inflight.empty()) launch(u, type, /*pooled_only=*/true);
  }

  // The bucket's storage points into a pool slot (not owned: the pool keeps it).
  static void lend_storage(at::Tensor& full, char* data) {
    auto* s = full.storage().unsafeGetStorageImpl();
    s->set_data_ptr_noswap(at::DataPtr(data, full.device()));
    s->set_nbytes(detail::bytes_of(full));
  }

  // Completes a gather in flight (a prefetch): the unit is then gathered, its parameters
  // in the type it was gathered in.
  void settle(UnitState& state) {
    if (state.inflight.empty()) return;
    const Waiting waiting(exposed_);
    for (auto& r : state.inflight) r.wait();
    state.inflight.clear();
    state.sent.clear();
    state.gathered = true;
    retype(state, /*compute=*/true);
  }

  void gather(std::size_t u, at::ScalarType type) {
    auto& state = units_state_[u];
    if ((state.gathered || !state.inflight.empty()) && state.type != type) release(u);
    if (!state.gathered && state.inflight.empty()) launch(u, type);
    settle(state);
  }

  void release(std::size_t u) {
    auto& state = units_state_[u];
    settle(state);
    if (!state.gathered) return;
    retype(state, /*compute=*/false);
    for (auto b : state.buckets) detail::release_storage(narrowed(b, state.type) ? shards_[b].compute : shards_[b].full);
    unit_pool_.release(std::exchange(state.slot, -1));
    state.gathered = false;
  }

  // Adds the seconds of its lifetime to `total`: the time a wait blocked.
  struct Waiting {
    explicit Waiting(double& total) : total_(total) {}
    Waiting(const Waiting&) = delete;
    Waiting& operator=(const Waiting&) = delete;
    ~Waiting() { total_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }
    double& total_;
    std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  };

  BucketLayout layout_;  // first: everything below is laid out by it
  Comm* data_;                    // every data-parallel rank (the mesh's, which outlives the store)
  Comm group_;                    // the ranks this one shards with: Note [Hybrid sharding]
  std::optional<Comm> replicas_;  // hybrid only: the ranks holding the same shard
  Comm gather_comm_;
  std::vector<detail::UnitBase*> units_;
  std::vector<UnitState> units_state_ = std::vector<UnitState>(units_.size());
  std::size_t prefetch_ = 1;
  std::optional<at::ScalarType> gather_type_;  // Note [Gathers in the compute type]
  detail::SlotPool unit_pool_;  // Note [Pooled transients]
  std::vector<Shard> shards_;
  std::map<std::size_t, Views> views_;  // by layout parameter; gathers in the compute type only
  std::vector<Piece> pieces_;
  std::unique_ptr<Optim> optimizer_;
  std::vector<std::pair<std::size_t, at::ScalarType>> sequence_, replay_;
  double exposed_ = 0;  // seconds blocked on gathers since begin_step
  // Note [Gathers in the compute type]: per bucket, whether it is gathered in the compute
  // type; what this rank saw of it (unseen until a unit's first forward with autograd);
  // whether the ranks have decided all, and a decision to apply at the next begin_step.
  static constexpr std::int8_t unseen = 2;
  std::vector<char> narrow_;
  std::vector<std::int8_t> seen_;
  bool decided_ = false;
  bool agreed_ = false;
};

}  // namespace paratrain
