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
#include "paratrain/strategy/detail/state_slices.hpp"
#include "paratrain/strategy/stores/detail/flat_shard.hpp"
#include "paratrain/strategy/stores/sharded_construction.hpp"
#include "paratrain/strategy/stores/unit_gathers.hpp"
#include "paratrain/strategy/unit.hpp"
#include "paratrain/tensor_parallel/sharding.hpp"

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
// node's ranks say, and only each shard's sum crosses groups. The groups are the mesh's
// (Note [Process mesh]): G is its data-shard dimension and W/G its data-replicate one, so
// a bucket's `group` is the mesh's group(Dims::sharding()) (the G ranks of this rank's
// group, times the context ranks and the expert group where there are some) and `replicas`
// its group(Dim::replicate) (the W/G ranks holding the same shard, one per group); an
// expert's bucket's group is group(Dims::expert_sharding()), without the expert group,
// whose ranks hold other experts (Note [Expert buckets]). The store computes no rank layout
// itself. A bucket is padded to a multiple of its group's size and cut into as many shards;
// its gradients are reduce-scattered in the group, then the shard all-reduced across the
// replicas (one request, started in bucket order when the reduce-scatter completes: Note
// [Bucket order] keeps both streams in order on every rank); parameters are all-gathered
// in the group. Everything that involves all ranks (the step agreement, the sample count,
// clipping's norm of the shards: summed over the sharding ranks, which hold every shard of
// both kinds once) is unchanged. Checkpoints list each rank's pieces as today; the replicas
// outside group 0 mark theirs as copies (TensorSlice::saved false), so that every element
// is written once and loaded by all.
//
// The replicas' all-reduce starts when this rank sees its reduce-scatter complete, a moment
// that differs from rank to rank while backward goes on, so every sum runs over a
// communicator no layer exchanges over (Note [Gradient communicators]). A dense shard once
// summed across replicate × expert over the expert group's own communicator, and met the
// mixtures' backward all-to-alls in different orders on different ranks (the watchdog ended
// the GPT example's ZeRO-3 runs at ep 2 and 4; ctest example.gpt_moe_losses_agree runs them).

namespace detail {

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
class ShardedParameters {
 public:
  using optimizer_type = Optim;
  /// Stages 2 and 3 keep only this rank's shard of the summed gradients.
  using gradient_storage = std::conditional_t<(Stage >= 2), ShardedGradients, WholeGradients>;
  /// At stage 3 forward gathers each Unit's parameters: Note [Unusable batches].
  static constexpr bool gathers_in_forward = Stage == 3;
  static constexpr plan::stage planned_stage = static_cast<plan::stage>(Stage);

  /// `build()`, placed as `options.build` says (default: the communicator's device); at
  /// stage 3 inside a ShardedConstruction over the sharding ranks (an expert's: the expert
  /// sharding ranks), so that each Unit keeps only this rank's shard from the moment it is
  /// built (Note [Sharded construction]).
  template <class Build>
  static auto construct(Build& build, Mesh<Comm>& mesh, const StoreOptions& options) {
    const auto device = detail::communicator_device(mesh.world());
    if constexpr (Stage < 3) return detail::build_placed(build, options.build, device);
    else
      return detail::build_placed(build, options.build, device,
                                  detail::ShardOf{.index = mesh.index(Dims::sharding()),
                                                  .size = mesh.size(Dims::sharding()),
                                                  .expert_index = mesh.index(Dims::expert_sharding()),
                                                  .expert_size = mesh.size(Dims::expert_sharding())},
                                  options.bucketing.cap_bytes);
  }

  /// The memory plan of `model` sharded so over the mesh's sharding ranks (Note [Checking
  /// the plan]): its buckets as the store will lay them out; its experts, which this rank
  /// holds 1/ep of, sharded over the expert sharding ranks (Note [Tensor-parallel memory]).
  template <class OptimOptions>
  static plan::Model plan(torch::nn::Module& model, Mesh<Comm>& mesh, const StoreOptions& options,
                          const OptimOptions& optimizer, const PlanInputs& inputs) {
    detail::UnitMap units;
    if constexpr (Stage == 3) units = detail::find_units(model);
    const auto experts = tp::parameters_cut_over(model, Dim::expert);
    const BucketLayout probe(model, padded(options, mesh), unit_of(units), mesh.rank(), experts);
    auto m = detail::plan_of(model, mesh.size(Dims::expert_sharding()), detail::largest_bucket(probe), options.prefetch,
                             optimizer, inputs.autocast, inputs.narrow_reduce, inputs.activation_bytes);
    if (const auto ep = mesh.size(Dim::expert); ep > 1) {
      // This rank's experts are 1/ep of a mixture's: the plan's Ψ counts them ep times.
      double held = 0;
      for (const auto& p : probe.params())
        if (p.expert) held += static_cast<double>(p.tensor.numel());
      m.expert = ep;
      m.expert_parameters = held * ep;
      m.parameters += held * (ep - 1);
    }
    return m;
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

  [[nodiscard]] const BucketLayout& layout() const noexcept { return layout_; }
  [[nodiscard]] Optim& optimizer() noexcept { return *optimizer_; }
  /// Stages 2 and 3 keep this rank's shard of the summed gradients, summed over the ranks it
  /// shards with, then (hybrid sharding) across those holding the same shard in the other
  /// groups (Note [Hybrid sharding]); stage 1 keeps the whole sum, over every data rank.
  [[nodiscard]] gradient_storage gradients() const {
    if constexpr (Stage >= 2) {
      std::vector<int> index;
      for (std::size_t b = 0; b < layout_.buckets().size(); ++b) index.push_back(group_of(b).rank());
      return ShardedGradients(layout_, std::move(index));
    } else {
      return WholeGradients(layout_);
    }
  }
  /// Each bucket summed over the ranks that hold it (Note [Expert buckets]): at stage 1 all
  /// of them (Ranks::holders: a dense bucket's Dims::batch(), an experts' Dims::replicas()),
  /// from stage 2 on reduce-scattered over the ranks it shards with, then its shard
  /// all-reduced across the replicas.
  [[nodiscard]] SumRanks<Comm> gradient_ranks(std::size_t bucket) {
    Comm* over = ranks_of(layout_.buckets().at(bucket).expert).sums;
    if constexpr (Stage >= 2) return {over, replicas_};
    else return {over};
  }
  /// The sums are cut along the sharding dimensions (data-shard, context, expert) from
  /// stage 2 on: an expert's bucket over fewer, but its ranks in the expert group hold other
  /// experts, so every part of the model's gradient is on one of them.
  [[nodiscard]] Dims partitions() const noexcept { return Stage >= 2 ? Dims::sharding() : Dims(); }

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
    for (std::size_t b = 0; b < shards_.size(); ++b)
      if (auto& s = shards_[b]; s.resident) gathers.push_back(group_of(b).iall_gather(s.shard, s.full));
    {
      const detail::Waiting waiting(exposed_);
      for (auto& r : gathers) r.wait();
    }
    // Over every rank a dense unit is gathered with (its sharding ranks span the expert group).
    if (units_) units_->agree_on_types(*dense_.holders);
  }

  /// Runs `f` with every parameter whole: at stage 3 every unit gathered for it, then freed
  /// again (collective: every rank calls it); below, at once.
  template <class F>
  void with_gathered(F&& f) {
    if (units_) units_->with_gathered(std::forward<F>(f));
    else std::forward<F>(f)();
  }

  /// A new step: its record of unit gathers starts (what a rank that joins replays).
  void begin_step() {
    exposed_ = 0;
    if (units_) units_->begin_step();
  }
  /// Ends a step that had data: its gathers become the ones a joined rank replays.
  void end_step() {
    if (units_) units_->end_step();
  }
  /// A step in which this rank ran no forward: Note [Joining at stage 3].
  void replay_gathers(int rank) {
    if (units_) units_->replay(rank);
  }
  /// Every gradient of bucket `b` is ready: at stage 3 its unit may be freed.
  void on_gradients_complete(std::size_t b) {
    if (units_) units_->on_gradients_complete(b);
  }

  /// Seconds this step has blocked on parameter gathers: ZeRO-3's gathers of units that
  /// were not complete when needed, and the gathers of the updated shards after the step.
  [[nodiscard]] double exposed_seconds() const noexcept {
    return exposed_ + (units_ ? units_->exposed_seconds() : 0.0);
  }

  /// The plan once the strategy runs: at stage 3 under autocast, from the step on which the
  /// ranks agreed which units are gathered in bf16 (Note [Gathers in the compute type]), the
  /// units so gathered count in bf16; before, fp32 gathers and every autocast copy.
  [[nodiscard]] plan::Model planned(plan::Model m) const {
    if constexpr (Stage == 3) {
      const auto [narrow, all] = units_->narrow_parameters();
      // `narrow` are this rank's; under experts, counted of Ψ as plan() counts it (its experts
      // ep times), never more than Ψ (a rounding of narrow × Ψ / held).
      m.narrow_parameters = narrow;
      if (const double held = plan::rank_parameters(m); m.expert > 1 && held > 0)
        m.narrow_parameters = std::min(m.parameters, narrow * m.parameters / held);
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
  // Stage 3's residency, over communicators of its own (Note [Two communicators]): one for
  // the dense buckets, one for the experts' where their ranks differ; none below.
  static std::optional<UnitGathers<Comm>> unit_gathers(const BucketLayout& layout, std::vector<detail::FlatShard>& shards,
                                                       const detail::UnitMap& units, Comm& group, Comm& expert_group,
                                                       const StoreOptions& options) {
    if constexpr (Stage == 3)
      return std::optional<UnitGathers<Comm>>(
          std::in_place, layout, shards, units.units, group.split(0, group.rank()),
          &expert_group != &group ? std::optional<Comm>(expert_group.split(0, expert_group.rank())) : std::nullopt,
          options.prefetch, options.gather);
    else
      return std::nullopt;
  }

  // Each bucket padded to a multiple of the ranks it is sharded over: Note [Shard layout].
  static BucketOptions padded(const StoreOptions& options, Mesh<Comm>& mesh) {
    auto bucketing = options.bucketing;
    bucketing.pad_to = mesh.size(Dims::sharding());
    bucketing.expert_pad_to = mesh.size(Dims::expert_sharding());
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
      : layout_(model, padded(options, mesh), unit_of(units), mesh.rank(),
                tp::parameters_cut_over(model, Dim::expert)),
        dense_(ranks_over(mesh, Dims::batch(), Dims::sharding())),
        experts_(ranks_over(mesh, Dims::replicas(), Dims::expert_sharding())),
        replicas_(mesh.size(Dim::replicate) > 1 ? &mesh.gradient_group(Dim::replicate) : nullptr),
        units_(unit_gathers(layout_, shards_, units, *dense_.shards, *experts_.shards, options)) {
    const auto& layout = layout_;
    const auto rank = mesh.rank();
    const auto& buckets = layout.buckets();
    c10::NoGradGuard no_grad;
    // Note [Sharded construction]: units built sharded hand over their buckets.
    std::vector<std::shared_ptr<detail::ConstructedUnit>> constructed;
    for (auto* u : units.units) constructed.push_back(u->take_constructed());
    std::vector<std::size_t> adopted(units.units.size(), 0);
    for (std::size_t b = 0; b < buckets.size(); ++b) {
      auto& s = shards_.emplace_back();
      const int unit = buckets[b].unit;
      s.resident = Stage < 3 || unit < 0;
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
        const auto at = shard_begin(b);  // this rank's shard in its group: Note [Hybrid sharding]
        s.shard = s.resident ? s.full.narrow(0, at, n) : s.full.narrow(0, at, n).clone();
        if (!s.resident) detail::release_storage(s.full);
      }
      if (!s.resident) units_->add(static_cast<std::size_t>(unit), b);
    }
    check_same_initialisation(constructed, units.names);
    if (units_) units_->start();
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
  }

  struct Piece {
    at::Tensor tensor;      // a view into its bucket's shard: what the optimizer steps
    std::size_t param = 0;  // in the layout
    std::size_t bucket = 0;
    std::int64_t begin = 0;  // offset in the shard
  };
  using GatherRequest = decltype(std::declval<Comm&>().iall_gather(std::declval<const at::Tensor&>(),
                                                                   std::declval<at::Tensor&>()));

  // The communicators of one kind of bucket, dense or experts' (Note [Expert buckets]), all
  // the mesh's, which outlives the store: `holders`, every rank that holds the same
  // parameters (a dense bucket's: Dims::batch(), the expert group too; an experts':
  // Dims::replicas()); `shards`, those it is cut over (Note [Hybrid sharding]); `sums`,
  // what its gradients are summed over (Note [Gradient communicators]): from stage 2 on
  // the shards' gradient group, below it the holders'.
  struct Ranks {
    Comm* holders;
    Comm* shards;
    Comm* sums;
  };
  static Ranks ranks_over(Mesh<Comm>& mesh, Dims holders, Dims shards) {
    return {&mesh.group(holders), &mesh.group(shards), &mesh.gradient_group(Stage >= 2 ? shards : holders)};
  }
  [[nodiscard]] const Ranks& ranks_of(bool expert) const noexcept { return expert ? experts_ : dense_; }
  // The ranks bucket b is sharded over.
  [[nodiscard]] Comm& group_of(std::size_t b) const { return *ranks_of(layout_.buckets()[b].expert).shards; }
  [[nodiscard]] std::int64_t shard_begin(std::size_t b) const {
    return group_of(b).rank() * layout_.shard_numel(b);
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
      throw error("DataParallel", experts_.holders->rank(),
                  "unit '" + name +
                      "' was built sharded, but the model lays its parameters out differently from the unit alone "
                      "(a parameter it shares with another part of the model, or one of an inner unit between its "
                      "own); build such a model whole and pass it to the strategy instead");
  }

  /// Every rank's units built sharded came from the same initial values: one all-reduce
  /// of their hashes (Note [Sharded construction]); under expert parallelism their dense
  /// parameters' over every rank that holds them, their experts' over those experts'
  /// replicas. Collective.
  void check_same_initialisation(const std::vector<std::shared_ptr<detail::ConstructedUnit>>& constructed,
                                 const std::vector<std::string>& names) {
    if (std::none_of(constructed.begin(), constructed.end(), [](const auto& c) { return c != nullptr; })) return;
    compare_checksums(constructed, names, *dense_.holders, &detail::ConstructedUnit::checksum, "");
    if (dense_.holders != experts_.holders)
      compare_checksums(constructed, names, *experts_.holders, &detail::ConstructedUnit::expert_checksum,
                        " (its experts, across the ranks that hold the same ones)");
  }
  void compare_checksums(const std::vector<std::shared_ptr<detail::ConstructedUnit>>& constructed,
                         const std::vector<std::string>& names, Comm& over,
                         std::int64_t detail::ConstructedUnit::*checksum, const std::string& what) {
    const auto n = static_cast<std::int64_t>(constructed.size());
    auto h = at::zeros({2 * n}, at::kLong);
    for (std::int64_t u = 0; u < n; ++u) {
      const auto& c = constructed[static_cast<std::size_t>(u)];
      const auto v = c ? (*c).*checksum : 0;
      h[u] = v;
      h[n + u] = -v;
    }
    detail::all_reduce_on(over, h, layout_.buckets().front().options.device(), reduce_op::max);
    for (std::int64_t u = 0; u < n; ++u)
      if (h[u].item<std::int64_t>() != -h[n + u].item<std::int64_t>())
        throw error("DataParallel", over.rank(),
                    "the ranks built unit '" + names[static_cast<std::size_t>(u)] + "' with different initial values" +
                        what +
                        "; a model built sharded is never broadcast from rank 0, so every rank must draw the same "
                        "values: seed every rank alike before building it (torch::manual_seed(seed) with the same "
                        "seed), or build the model whole and pass it instead");
  }

  BucketLayout layout_;  // first: everything below is laid out by it
  Ranks dense_;     // a dense bucket's ranks
  Ranks experts_;   // an experts' bucket's
  Comm* replicas_;  // hybrid only: the ranks holding the same shard (null elsewhere)
  std::vector<detail::FlatShard> shards_;
  std::optional<UnitGathers<Comm>> units_;  // stage 3: Note [Units]
  std::vector<Piece> pieces_;
  std::unique_ptr<Optim> optimizer_;
  double exposed_ = 0;  // seconds blocked on the step's gathers since begin_step
};

}  // namespace paratrain
