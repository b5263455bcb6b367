#pragma once
/// \file
/// ZeRO-3's parameters at rest (Note [Units]): each Unit's buckets held as this rank's
/// shards, gathered around the unit's forward and its backward into pooled slots while the
/// next units are prefetched, replayed by a rank that joins (Note [Joining at stage 3]).

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "paratrain/core/error.hpp"
#include "paratrain/strategy/buckets/bucket_layout.hpp"
#include "paratrain/memory/slot_pool.hpp"
#include "paratrain/strategy/detail/tensor_bytes.hpp"
#include "paratrain/strategy/stores/compute_type_gathers.hpp"
#include "paratrain/strategy/stores/detail/flat_shard.hpp"
#include "paratrain/strategy/stores/sharded_construction.hpp"
#include "paratrain/strategy/unit.hpp"

namespace paratrain {

// Note [Joining at stage 3]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// A rank with no batch must still take part in every gather the others make. Their
// sequence of unit gathers is a function of the model's forward and backward, the
// same every step, so a joined rank replays the sequence of its own last step with
// data: gathers in the same order on the gather communicator, while its (empty)
// gradients are reduce-scattered in bucket order on the other one.

// Note [Two communicators]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// At stage 3 the parameter gathers of backward interleave with the gradient
// reduce-scatters, and where exactly depends on when each rank's gradients become
// ready. MPI requires one order of collectives per communicator, so the gathers use a
// communicator of their own (split once, at construction): each stream is in a fixed
// order on every rank, whatever their interleaving.

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

}  // namespace detail

/// ZeRO-3's residency (Note [Units]): the buckets of each Unit are held as this rank's
/// shards of `shards` (the store's), gathered over `gather` (Note [Two communicators]; a
/// bucket of experts over `expert_gather` where given: Note [Expert buckets])
/// before the unit's forward and again before its backward, released after each, with up
/// to `prefetch` units gathered ahead into a pool of slots (Note [Pooled transients]),
/// each in the type its forward computes in (Note [Gathers in the compute type]).
template <class Comm>
class UnitGathers final : public detail::UnitObserver {
 public:
  UnitGathers(const BucketLayout& layout, std::vector<detail::FlatShard>& shards, std::vector<detail::UnitBase*> units,
              Comm gather, std::optional<Comm> expert_gather, int prefetch,
              std::optional<at::ScalarType> compute_type)
      : layout_(&layout),
        shards_(&shards),
        units_(std::move(units)),
        state_(units_.size()),
        gather_comm_(std::move(gather)),
        expert_gather_(std::move(expert_gather)),
        prefetch_(static_cast<std::size_t>(std::max(0, prefetch))),
        types_(layout, compute_type) {}

  UnitGathers(const UnitGathers&) = delete;
  UnitGathers& operator=(const UnitGathers&) = delete;
  ~UnitGathers() {
    for (auto* u : units_) u->attach(nullptr, 0);
  }

  /// Bucket `b` (not resident) belongs to unit `unit`: at construction, in bucket order.
  void add(std::size_t unit, std::size_t b) {
    state_.at(unit).buckets.push_back(b);
    if (types_.on()) types_.add_views(b, (*shards_)[b]);
  }
  /// After every bucket is added: the pool laid out, the units attached to this.
  void start() {
    lay_out_pool();
    for (std::size_t u = 0; u < units_.size(); ++u) units_[u]->attach(this, u);
  }

  /// Runs `f` with every unit gathered (in the parameters' own type), then frees them.
  /// Collective: every rank calls it.
  template <class F>
  void with_gathered(F&& f) {
    for (std::size_t u = 0; u < units_.size(); ++u) gather(u, types_.own_type());
    f();
    for (std::size_t u = 0; u < units_.size(); ++u) release(u);
  }

  /// Starts a new step's record of gathers (what a rank that joins replays), applying the
  /// ranks' decision on the compute type when nothing is gathered.
  void begin_step() {
    exposed_ = 0;
    if (std::none_of(state_.begin(), state_.end(), [](const UnitState& u) { return u.gathered || !u.inflight.empty(); }) &&
        types_.apply_agreed())
      lay_out_pool();
    sequence_.clear();
    for (auto& u : state_) u.complete = 0;  // a backward that threw midway left counts
  }
  /// Ends a step that had data: its gathers become the ones a joined rank replays.
  void end_step() {
    for (std::size_t u = 0; u < units_.size(); ++u) release(u);  // a prefetch no unit used
    if (!sequence_.empty()) replay_.swap(sequence_);
  }
  /// Note [Joining at stage 3]: the gathers of this rank's last step with data.
  void replay(int rank) {
    if (!units_.empty() && replay_.empty())
      throw error("DataParallel::join", rank,
                  "at ZeRO stage 3 a rank joins by repeating the unit gathers of its last step, and this rank has "
                  "had no step yet; give every rank at least one batch (DistributedSampler does)");
    for (auto [u, type] : replay_) {
      gather(u, type);
      release(u);
    }
  }

  /// Every gradient of bucket `b` is ready: a unit whose buckets are all complete has
  /// finished its backward, and its parameters are freed.
  void on_gradients_complete(std::size_t b) {
    const int unit = layout_->buckets()[b].unit;
    if (unit < 0 || (*shards_)[b].resident) return;
    auto& u = state_[static_cast<std::size_t>(unit)];
    if (++u.complete == static_cast<int>(u.buckets.size())) {
      u.complete = 0;
      release(static_cast<std::size_t>(unit));
    }
  }

  /// After a step: the ranks agree on the compute type while some unit is undecided.
  /// Collective over `comm`.
  template <class C>
  void agree_on_types(C& comm) {
    if (types_.undecided()) types_.agree(comm, *shards_);
  }
  /// Note [Gathers in the compute type]: the parameters so gathered, and whether all are.
  [[nodiscard]] std::pair<double, bool> narrow_parameters() const { return types_.narrow_parameters(*shards_); }
  /// Seconds the step blocked on gathers that were not complete when needed.
  [[nodiscard]] double exposed_seconds() const noexcept { return exposed_; }

  // ---- detail::UnitObserver ---------------------------------------------------------
  void before_forward(std::size_t u) override {
    // Note [Gathers in the compute type]: the type this forward computes in.
    const auto type = types_.forward_type();
    gather(u, type);
    state_[u].forward_type = type;
    for (std::size_t k = 1; k <= prefetch_ && u + k < units_.size(); ++k) prefetch(u + k, type);
  }
  void after_forward(std::size_t u, const at::Tensor& out) override {
    if (types_.undecided() && at::GradMode::is_enabled() && out.requires_grad()) types_.see(state_[u].buckets, out);
    release(u);
  }
  void before_backward(std::size_t u) override {
    gather(u, state_[u].forward_type);
    for (std::size_t k = 1; k <= prefetch_ && k <= u; ++k) prefetch(u - k, state_[u - k].forward_type);
  }

 private:
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

  // Note [Pooled transients]: a unit's buckets side by side in one slot, each in the type
  // forward gathers it in (Note [Gathers in the compute type]); a gather in another type
  // (with_gathered's fp32) takes the allocator's memory where it does not fit.
  void lay_out_pool() {
    std::size_t slot_bytes = 0;
    for (auto& state : state_) {
      std::size_t at = 0;
      state.offsets.clear();
      for (auto b : state.buckets) {
        state.offsets.push_back(at);
        at += (static_cast<std::size_t>((*shards_)[b].full.numel()) * c10::elementSize(types_.slot_type(b)) + 63) / 64 * 64;
      }
      slot_bytes = std::max(slot_bytes, at);
    }
    if (!state_.empty())
      pool_ = memory::SlotPool(slot_bytes, static_cast<int>(1 + prefetch_), layout_->buckets().front().options.device());
  }

  // Gathers unit u in `type` into a pool slot, or (`pooled_only` false) into the
  // allocator's memory when no slot is free; false when it started nothing.
  bool launch(std::size_t u, at::ScalarType type, bool pooled_only = false) {
    auto& state = state_[u];
    const auto own = types_.own_type();
    // The slot as laid out for the compute type; fp32 where it was asked for instead.
    std::size_t bytes = 0;
    bool fits = true;  // an fp32 gather of a bucket laid out narrow does not fit its slot
    for (std::size_t k = 0; k < state.buckets.size() && fits; ++k) {
      const auto b = state.buckets[k];
      fits = type != own || types_.slot_type(b) == own;
      bytes = std::max(bytes, state.offsets[k] + static_cast<std::size_t>((*shards_)[b].full.numel()) *
                                                     c10::elementSize(types_.narrowed(b, type) ? type : own));
    }
    state.slot = fits ? pool_.acquire(bytes) : -1;
    if (state.slot < 0 && pooled_only) return false;
    state.type = type;
    for (std::size_t k = 0; k < state.buckets.size(); ++k) {
      auto& s = (*shards_)[state.buckets[k]];
      const bool narrow = types_.narrowed(state.buckets[k], type);
      auto& full = narrow ? s.compute : s.full;
      if (state.slot >= 0) lend_storage(full, pool_.data(state.slot) + state.offsets[k]);
      else detail::allocate_storage(full);
      auto& sent = narrow ? state.sent.emplace_back(s.shard.to(type)) : s.shard;
      auto& over = expert_gather_ && layout_->buckets()[state.buckets[k]].expert ? *expert_gather_ : gather_comm_;
      state.inflight.push_back(over.iall_gather(sent, full));
    }
    sequence_.emplace_back(u, type);
    return true;
  }

  // A prefetch waits for a free slot rather than growing the process (Note [Pooled transients]).
  void prefetch(std::size_t u, at::ScalarType type) {
    auto& state = state_[u];
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
    const detail::Waiting waiting(exposed_);
    for (auto& r : state.inflight) r.wait();
    state.inflight.clear();
    state.sent.clear();
    state.gathered = true;
    types_.retype(state.buckets, state.type, /*compute=*/true);
  }

  void gather(std::size_t u, at::ScalarType type) {
    auto& state = state_[u];
    if ((state.gathered || !state.inflight.empty()) && state.type != type) release(u);
    if (!state.gathered && state.inflight.empty()) launch(u, type);
    settle(state);
  }

  void release(std::size_t u) {
    auto& state = state_[u];
    settle(state);
    if (!state.gathered) return;
    types_.retype(state.buckets, state.type, /*compute=*/false);
    for (auto b : state.buckets) {
      auto& s = (*shards_)[b];
      detail::release_storage(types_.narrowed(b, state.type) ? s.compute : s.full);
    }
    pool_.release(std::exchange(state.slot, -1));
    state.gathered = false;
  }

  const BucketLayout* layout_;
  std::vector<detail::FlatShard>* shards_;  // the store's
  std::vector<detail::UnitBase*> units_;
  std::vector<UnitState> state_;
  Comm gather_comm_;                   // Note [Two communicators]
  std::optional<Comm> expert_gather_;  // the experts' buckets', where their ranks differ
  std::size_t prefetch_;
  detail::ComputeTypeGathers types_;  // Note [Gathers in the compute type]
  memory::SlotPool pool_;             // Note [Pooled transients]
  std::vector<std::pair<std::size_t, at::ScalarType>> sequence_, replay_;  // Note [Joining at stage 3]
  double exposed_ = 0;  // seconds blocked on gathers since begin_step
};

}  // namespace paratrain
