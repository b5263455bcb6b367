#pragma once
/// \file
/// Building a ZeRO-3 model without any rank holding it whole: each paratrain::Unit keeps
/// this rank's shard of its parameters as soon as it is constructed (Note [Sharded construction]).

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <set>
#include <vector>

#include "paratrain/core/error.hpp"
#include "paratrain/strategy/buckets/bucket_layout.hpp"
#include "paratrain/memory/allocator.hpp"
#include "paratrain/strategy/detail/tensor_bytes.hpp"
#include "paratrain/tensor_parallel/sharding.hpp"
#include "paratrain/util/fnv1a.hpp"

namespace paratrain {

// Note [Sharded construction]
// At ZeRO stage 3 a rank keeps 1/N of each Unit's parameters; building the model whole
// first (`Strategy s(Net(), ...)`) needs the whole model's bytes on every rank before
// any of it is sharded, so a model larger than one rank could not even be built. Given a
// function that builds the model instead (`Strategy s([] { return Net(); }, ...)`), the
// strategy calls it inside a ShardedConstruction, and every Unit, the moment its own
// constructor has finished (a member initialised after its layer's base: Note [Units]),
// lays out its parameters in the unit's buckets, copies them into flat buffers, keeps
// this rank's shard and frees the rest, before the model's constructor goes on to build
// the next unit. DeepSpeed's zero.Init does this by intercepting parameter creation; a
// meta device (FSDP2) would need every layer to re-run its initialisation per shard,
// which LibTorch's C++ layers cannot (their reset() draws the whole tensor). Here each
// unit is initialised exactly as plain construction initialises it, from the same
// random stream in the same order, so with the same seed the shards are slices of the
// parameters a plain construction makes (tests compare them).
//
// What this costs and bounds: while unit u is built, a rank holds the shards of units
// 0..u-1 and u's parameters as its layer made them; each shard is copied straight from
// the parameters, so the whole unit is never copied: the shards plus one unit (a layer
// that makes temporaries while it initialises may add its own). A unit's buckets depend on the unit alone (its
// parameters in reverse order, cut at the bucket cap, padded to N: Note [Shard layout]),
// so the strategy's layout, built later over the whole model, finds exactly these
// buckets and adopts them.
//
// Plain construction starts every rank from rank 0's parameters (a broadcast); sharded
// construction cannot broadcast what no rank holds, so it checks instead that every rank
// drew the same initial values: each unit hashes its flat buffers before freeing them,
// and the ranks compare the hashes in one all-reduce (max of h and of -h) when the
// strategy adopts the shards; a difference is an error on every rank naming the unit
// (seed every rank alike: torch::manual_seed). Under expert parallelism a unit's experts and
// dense parameters are hashed apart (their buckets are: Note [Expert buckets]): its experts
// compared over their replicas, which hold the same ones, its dense parameters over the
// expert group too, which plain construction broadcasts them over. Parameters outside units,
// and buffers, are whole on every rank and broadcast from rank 0 as always.
//
// The one rule for a model built this way: once a unit's constructor has returned, its
// parameters hold no memory on any rank until the strategy gathers them, so the model's
// constructor must not read or write them afterwards (a whole-model initialisation pass
// over parameters(), say; LibTorch does not check a storage's size, so that crashes).
// Initialise a unit's parameters inside the unit (a block whose constructor initialises
// its layers), or build the model whole and pass it to the strategy.

namespace detail {

/// What a Unit built under a ShardedConstruction keeps: its buckets, each a flat buffer
/// without storage (the parameters are views of it) and this rank's shard of it.
struct ConstructedUnit {
  BucketLayout layout;
  std::vector<at::Tensor> full;   ///< per bucket: padded, storage released
  std::vector<at::Tensor> shard;  ///< per bucket: this rank's elements, storage of its own
  std::int64_t checksum = 0;         ///< of its dense buckets' values: Note [Sharded construction]
  std::int64_t expert_checksum = 0;  ///< of its experts' buckets' values
};

/// What a ShardedConstruction shards over (Note [Expert buckets]): this rank's index among
/// the `size` ranks a dense bucket is cut over, and among the `expert_size` an expert's is.
struct ShardOf {
  int index = 0;
  int size = 1;
  int expert_index = 0;
  int expert_size = 1;
};

// The storage of a stage-3 bucket comes and goes; the parameters (views of it, saved
// for backward by autograd) keep pointing at the same StorageImpl.
inline void allocate_storage(at::Tensor& full) {
  auto* s = full.storage().unsafeGetStorageImpl();
  if (s->data() != nullptr) return;
  const auto bytes = bytes_of(full);
  s->set_data_ptr_noswap(s->allocator()->allocate(bytes));
  s->set_nbytes(bytes);
}
inline void release_storage(at::Tensor& full) {
  auto* s = full.storage().unsafeGetStorageImpl();
  s->set_data_ptr_noswap(at::DataPtr(nullptr, full.device()));
  s->set_nbytes(0);
}

/// A flat tensor of `numel` elements whose storage says its size but holds no memory (its
/// data is allocated when a gather needs it: allocate_storage).
inline at::Tensor storage_less(std::int64_t numel, const at::TensorOptions& options) {
  const auto bytes = static_cast<std::size_t>(numel) * options.dtype().itemsize();
  at::Storage storage(at::Storage::use_byte_size_t(), bytes, at::DataPtr(nullptr, options.device()),
                      at::GetAllocator(options.device().type()), /*resizable=*/false);
  return at::empty({0}, options).set_(storage, 0, {numel}, {1});
}

/// Mixes a flat buffer's bytes into `h`, a bounded chunk at a time (copied to the CPU
/// first where the buffer is elsewhere).
inline void hash_values(Fnv1a& h, const at::Tensor& flat) {
  constexpr std::int64_t chunk_bytes = std::int64_t{16} << 20;
  const auto bytes = flat.view(at::kByte);
  for (std::int64_t at = 0; at < bytes.numel(); at += chunk_bytes) {
    const auto part = bytes.narrow(0, at, std::min(chunk_bytes, bytes.numel() - at)).to(at::kCPU).contiguous();
    const auto* p = part.data_ptr<std::uint8_t>();
    const auto n = static_cast<std::size_t>(part.numel());
    std::size_t i = 0;
    for (; i + 8 <= n; i += 8) {
      std::uint64_t w;
      std::memcpy(&w, p + i, 8);
      h.mix(w);
    }
    for (; i < n; ++i) h.mix(std::uint64_t{p[i]});
  }
}

}  // namespace detail

/// Where and in which type a model the strategy builds is placed (DataParallelOptions::build).
struct BuildOptions {
  /// Default: the communicator's GPU for comm::Nccl, else the CPU.
  std::optional<at::Device> device;
  /// Default: as the layers make them (float). Set, each unit is converted as it is built,
  /// so that a build function or stage maker may end with `.to(dtype)` (then a no-op on
  /// the shards, which hold no memory to convert).
  std::optional<at::ScalarType> dtype;
};

/// While one exists on this thread, every paratrain::Unit constructed keeps only this
/// rank's shard of its parameters (Note [Sharded construction]). The strategies make one
/// around a build function at ZeRO stage 3; scopes do not nest.
class ShardedConstruction {
 public:
  /// Shards as `shards` says, in buckets of about `cap_bytes`, each unit moved to `device`
  /// (and converted to `dtype`, where given) first.
  ShardedConstruction(detail::ShardOf shards, std::size_t cap_bytes, at::Device device,
                      std::optional<at::ScalarType> dtype = {})
      : shards_(shards), cap_bytes_(cap_bytes), device_(device), dtype_(dtype), outer_(current_) {
    if (outer_ != nullptr)
      throw error("ShardedConstruction", shards.index, "a model is already being built sharded on this thread");
    current_ = this;
  }
  ShardedConstruction(const ShardedConstruction&) = delete;
  ShardedConstruction& operator=(const ShardedConstruction&) = delete;
  ~ShardedConstruction() { current_ = outer_; }

  /// The scope in effect on this thread, or null.
  [[nodiscard]] static ShardedConstruction* current() noexcept { return current_; }

  /// Called by a Unit whose constructor has finished: moves it to the device, lays its
  /// parameters out in its buckets, keeps this rank's shards. Null when the unit has no
  /// parameter left to shard (none requires a gradient, or an inner unit holds them all).
  std::shared_ptr<detail::ConstructedUnit> shard(torch::nn::Module& unit) {
    c10::NoGradGuard no_grad;
    if (dtype_) unit.to(device_, *dtype_);
    else unit.to(device_);
    bool any = false;
    for (const auto& p : unit.parameters(/*recurse=*/true)) any = any || (p.requires_grad() && !sharded_.count(p.unsafeGetTensorImpl()));
    if (!any) return nullptr;
    auto out = std::make_shared<detail::ConstructedUnit>(detail::ConstructedUnit{
        BucketLayout(unit,
                     {.cap_bytes = cap_bytes_, .first_cap_bytes = cap_bytes_, .pad_to = shards_.size,
                      .expert_pad_to = shards_.expert_size},
                     [&](auto&, const at::Tensor& p) {
                       return sharded_.count(p.unsafeGetTensorImpl()) ? BucketLayout::excluded : 0;
                     },
                     shards_.index, tp::parameters_cut_over(unit, Dim::expert)),
        {}, {}, 0});
    detail::Fnv1a dense_hash, expert_hash;
    const auto& layout = out->layout;
    for (std::size_t b = 0; b < layout.buckets().size(); ++b) {
      // This rank's shard straight from the parameters, and the whole bucket a tensor
      // without memory: the unit is never copied whole.
      const auto& bucket = layout.buckets()[b];
      const auto n = layout.shard_numel(b), begin = (bucket.expert ? shards_.expert_index : shards_.index) * n;
      auto shard = at::zeros({n}, bucket.options);
      auto full = detail::storage_less(bucket.padded, bucket.options);
      for (auto i : bucket.params) {
        const auto& p = layout.params()[i];
        const auto flat = p.tensor.detach().reshape({-1});
        detail::hash_values(bucket.expert ? expert_hash : dense_hash, flat.contiguous());
        const auto lo = std::max(begin, p.offset), hi = std::min(begin + n, p.offset + p.tensor.numel());
        if (lo < hi) shard.narrow(0, lo - begin, hi - lo).copy_(flat.narrow(0, lo - p.offset, hi - lo));
        p.tensor.set_data(layout.view(full, i));  // frees the layer's own storage
        sharded_.insert(p.tensor.unsafeGetTensorImpl());
      }
      detail::release_storage(full);
      out->shard.push_back(std::move(shard));
      out->full.push_back(std::move(full));
    }
    out->checksum = dense_hash.value62();
    out->expert_checksum = expert_hash.value62();
    return out;
  }

 private:
  detail::ShardOf shards_;
  std::size_t cap_bytes_;
  at::Device device_;
  std::optional<at::ScalarType> dtype_;
  memory::MappedLargeBlocks mapped_;  // Note [Mapped construction]
  ShardedConstruction* outer_;
  std::set<const void*> sharded_;  // parameters a unit built earlier (an inner one) holds
  static inline thread_local ShardedConstruction* current_ = nullptr;
};

namespace detail {

/// After a sharded construction: moves what units did not shard (parameters outside
/// units, frozen ones, buffers) to `device`, tensor by tensor (Module::to would read the
/// sharded parameters, which have no storage).
inline void move_whole_parameters(torch::nn::Module& model, at::Device device, std::optional<at::ScalarType> dtype) {
  c10::NoGradGuard no_grad;
  for (auto& p : model.parameters(/*recurse=*/true))
    if (p.device() != device || (dtype && p.is_floating_point() && p.scalar_type() != *dtype))
      p.set_data(dtype && p.is_floating_point() ? p.to(device, *dtype) : p.to(device));
  for (auto& b : model.buffers(/*recurse=*/true))
    if (b.device() != device || (dtype && b.is_floating_point() && b.scalar_type() != *dtype))
      b.set_data(dtype && b.is_floating_point() ? b.to(device, *dtype) : b.to(device));
}

/// The model `build()` returns, built inside a ShardedConstruction over `shards` where
/// given (Note [Sharded construction]), then placed as `options` says (default: `fallback`,
/// the communicator's device): what a parameter store's construct() does.
template <class Build>
auto build_placed(Build& build, const BuildOptions& options, const at::Device& fallback,
                  std::optional<ShardOf> shards = std::nullopt, std::size_t cap_bytes = 0) {
  const auto device = options.device ? *options.device : fallback;
  std::optional<ShardedConstruction> scope;
  if (shards) scope.emplace(*shards, cap_bytes, device, options.dtype);
  auto model = build();
  scope.reset();
  move_whole_parameters(*model, device, options.dtype);
  return model;
}

}  // namespace detail

}  // namespace paratrain
