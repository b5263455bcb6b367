#pragma once
/// \file
/// paratrain::BucketLayout — where each parameter lives in the flat buffers that DDP
/// all-reduces and ZeRO shards: the layer every data-parallel strategy stands on.

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "paratrain/strategy/detail/tensor_bytes.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain {

// Note [Bucket order]
// Parameters are packed into buckets in reverse registration order (the order
// backward produces their gradients in most models), each bucket one flat buffer of
// one dtype. Every parameter's .grad is a view into its bucket, so autograd
// accumulates straight into the buffer that is communicated and nothing is copied.
// A bucket is launched as soon as its last gradient is ready *and* every bucket
// before it has been launched: ranks may see gradients in different orders (an
// unused parameter, a data-dependent branch), but they always launch buckets
// 0, 1, 2, ... so their collectives match without any coordination.

// Note [Shard layout]
// Each bucket is padded to a multiple of the number of ranks N and cut into N equal,
// contiguous shards: rank r owns elements [r*S, (r+1)*S) of every bucket (FSDP's flat
// layout), so one reduce-scatter gives each rank its shard of the gradients and one
// in-place all-gather rebuilds the parameters. A shard may begin or end inside a
// parameter; the part of parameter p that falls into rank r's shard is one contiguous
// *piece*, and the sharded optimizer steps those pieces (Note [Optimizer on pieces]).

// Note [Expert buckets]
// ~~~~~~~~~~~~~~~~~~~~~
// Under expert parallelism a parameter is held alike by one of two sets of ranks (Note
// [Experts over a group]): an expert by its replicas (Dims::replicas()), and every other
// parameter, dense, by the replicas and the expert group together (Dims::batch()). Its
// gradient is summed over the ranks that hold it, so a bucket never mixes experts and dense
// parameters: each is summed, as it fills in backward, over its own ranks in one reduction.
// ZeRO shards each over its own ranks too (Note [Hybrid sharding]): a dense bucket over the
// sharding ranks and the expert group, an expert's over the sharding ranks alone, so each
// is padded to its own multiple (BucketOptions::pad_to, expert_pad_to) and cut into as many
// shards (Bucket::shards).

/// How a strategy wants its parameters bucketed.
struct BucketOptions {
  /// A bucket closes once it holds about this many bytes; the first one sooner, so that
  /// communication starts early in backward.
  std::size_t cap_bytes = std::size_t{25} << 20;
  std::size_t first_cap_bytes = std::size_t{1} << 20;
  /// Each bucket is padded to a multiple of this and cut into as many shards (the number of
  /// ranks it is sharded over; 1: whole).
  std::int64_t pad_to = 1;
  /// The same for a bucket of experts, whose ranks differ (Note [Expert buckets]); 0: pad_to.
  std::int64_t expert_pad_to = 0;
};


/// The parameters that require a gradient, bucketed: Note [Bucket order], Note [Shard layout].
/// A pure description (names, offsets, sizes); the buffers belong to whoever uses it.
class BucketLayout {
 public:
  struct Param {
    std::string name;
    at::Tensor tensor;
    int unit = -1;            ///< the innermost paratrain::Unit holding it; -1: none
    bool expert = false;      ///< cut over the expert dimension: Note [Expert buckets]
    std::size_t bucket = 0;
    std::int64_t offset = 0;  ///< in the bucket's flat buffer
  };
  struct Bucket {
    std::vector<std::size_t> params{};  ///< indices into params(), in layout order
    std::int64_t numel = 0;           ///< real elements
    std::int64_t padded = 0;          ///< numel rounded up to a multiple of shards
    std::int64_t shards = 1;          ///< the shards it is cut into: pad_to, or expert_pad_to for experts
    int unit = -1;
    bool expert = false;              ///< holds experts, or dense parameters: Note [Expert buckets]
    at::TensorOptions options;        ///< dtype and device of its parameters
  };

  /// unit_of's answer for a parameter that is not to be laid out.
  static constexpr int excluded = -2;

  /// `unit_of(name, tensor)` assigns a parameter to a unit (-1: none; `excluded`: leave it
  /// out); `experts` are the parameters cut over the expert dimension (their TensorImpls).
  /// Buckets never mix units, experts and dense parameters, dtypes or devices. A unit's
  /// buckets are cut at `cap_bytes` wherever they fall (never at the first bucket's cap), so
  /// that they depend on the unit alone: Note [Sharded construction].
  template <class UnitOf>
  BucketLayout(const torch::nn::Module& model, BucketOptions options, UnitOf&& unit_of, int rank,
               const std::set<const void*>& experts = {}) {
    const auto pad_to = std::max<std::int64_t>(options.pad_to, 1);
    const auto expert_pad_to = options.expert_pad_to > 0 ? options.expert_pad_to : pad_to;
    // A parameter shared by two modules (tied weights) is one tensor: bucket it once.
    std::set<const void*> seen;
    for (const auto& item : model.named_parameters(/*recurse=*/true))
      if (const auto* impl = item.value().unsafeGetTensorImpl(); item.value().requires_grad() && seen.insert(impl).second)
        if (const int unit = unit_of(item.key(), item.value()); unit != excluded)
          params_.push_back({item.key(), item.value(), unit, experts.count(impl) > 0});
    if (params_.empty()) throw error("DataParallel", rank, "the model has no parameter that requires a gradient");
    std::reverse(params_.begin(), params_.end());
    std::size_t cap = options.first_cap_bytes, bytes = 0;
    for (std::size_t i = 0; i < params_.size(); ++i) {
      auto& p = params_[i];
      const bool fits = !buckets_.empty() && bytes < cap && buckets_.back().unit == p.unit &&
                        buckets_.back().expert == p.expert && buckets_.back().options.dtype() == p.tensor.dtype() &&
                        buckets_.back().options.device() == p.tensor.device();
      if (!fits) {
        if (!buckets_.empty() || p.unit >= 0) cap = options.cap_bytes;
        buckets_.push_back({.unit = p.unit, .expert = p.expert, .options = p.tensor.options().requires_grad(false)});
        bytes = 0;
      }
      auto& b = buckets_.back();
      p.bucket = buckets_.size() - 1;
      p.offset = b.numel;
      b.params.push_back(i);
      b.numel += p.tensor.numel();
      bytes += detail::bytes_of(p.tensor);
    }
    for (auto& b : buckets_) {
      b.shards = b.expert ? expert_pad_to : pad_to;
      b.padded = (b.numel + b.shards - 1) / b.shards * b.shards;
    }
  }

  [[nodiscard]] const std::vector<Param>& params() const noexcept { return params_; }
  [[nodiscard]] const std::vector<Bucket>& buckets() const noexcept { return buckets_; }
  /// Elements of one rank's shard of bucket `b`.
  [[nodiscard]] std::int64_t shard_numel(std::size_t b) const { return buckets_.at(b).padded / buckets_.at(b).shards; }

  /// The view of `flat` (a bucket's buffer) that is parameter `i`, shaped like it.
  [[nodiscard]] at::Tensor view(const at::Tensor& flat, std::size_t i) const {
    const auto& p = params_[i];
    return flat.narrow(0, p.offset, p.tensor.numel()).view(p.tensor.sizes());
  }

  /// A zero-filled buffer for bucket `b`, padded.
  [[nodiscard]] at::Tensor zeros(std::size_t b) const { return at::zeros({buckets_[b].padded}, buckets_[b].options); }

  /// The parameter names of bucket `b`, in layout order.
  [[nodiscard]] std::vector<std::string> names(std::size_t b) const {
    std::vector<std::string> out;
    for (auto i : buckets_.at(b).params) out.push_back(params_[i].name);
    return out;
  }

 private:
  std::vector<Param> params_;
  std::vector<Bucket> buckets_;
};

}  // namespace paratrain
