#pragma once
/// \file
/// paratrain::cp::AttentionOptions and cp::attention over whole sequences on one device: what
/// the context-parallel algorithms compute, and the masks they share.

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "paratrain/context/layout.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/tensor_parallel/group.hpp"

namespace paratrain::cp {

/// Which context-parallel attention runs (Note [Ring attention], Note [All-to-all attention]).
enum class Algorithm : std::uint8_t {
  ring,        ///< key and value blocks passed around the group; any head count
  all_to_all,  ///< heads exchanged for positions; heads a multiple of the group's size
};

/// What attention masks and scales, and how a context group runs it.
struct AttentionOptions {
  bool causal = false;          ///< position i attends to positions <= i only
  at::Tensor key_padding_mask;  ///< [B, S], the whole sequence on every rank: true where a key is padding
  double scale = 0;             ///< the scores' factor; 0: 1 / sqrt(D)
  Layout layout = Layout::contiguous;     ///< how q, k and v are cut over the group (Note [Sequence layouts])
  Algorithm algorithm = Algorithm::ring;  ///< for cp::attention over a group
  bool overlap = true;  ///< ring: pass the next block while this one is computed (false: one after the other)
  std::int64_t tile_bytes = std::int64_t{16} << 20;  ///< ring: the most a tile of scores takes (keys cut to fit)
};

namespace detail {

inline constexpr double minus_infinity = -std::numeric_limits<double>::infinity();

[[nodiscard]] inline double scale_of(const AttentionOptions& o, std::int64_t width) {
  return o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(width));
}

// Where queries at positions `pq` [Lq] may not see keys at positions `pk` [Lk]: true where
// hidden, broadcastable to [B, H, Lq, Lk]; undefined where nothing is hidden.
[[nodiscard]] inline at::Tensor hidden(const at::Tensor& pq, const at::Tensor& pk, const AttentionOptions& o,
                                       std::int64_t batch) {
  at::Tensor m;
  if (o.causal) m = pk.view({1, 1, 1, -1}) > pq.view({1, 1, -1, 1});
  if (o.key_padding_mask.defined()) {
    const auto pad = o.key_padding_mask.to(pk.device()).index_select(1, pk).view({batch, 1, 1, -1});
    m = m.defined() ? at::logical_or(m, pad) : pad;
  }
  return m;
}

// softmax(q·kᵀ·scale + masks)·v over q, k, v [B, H, L, D] at positions pq and pk; differentiable.
[[nodiscard]] inline at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                       const at::Tensor& pq, const at::Tensor& pk, const AttentionOptions& o) {
  auto scores = at::matmul(q, k.transpose(2, 3)) * scale_of(o, q.size(3));  // [B, H, Lq, Lk]
  if (const auto m = hidden(pq, pk, o, q.size(0)); m.defined()) scores = scores.masked_fill(m, minus_infinity);
  return at::matmul(at::softmax(scores, -1), v);
}

// Refuses, on every rank alike, q, k, v and a padding mask that the group cannot attend over.
inline void check_shapes(const char* who, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const tensor_parallel::Group& group, const AttentionOptions& o) {
  if (q.dim() != 4 || k.sizes() != q.sizes() || v.sizes() != q.sizes())
    throw error(who, group.world_rank(), "q, k and v must have the same shape [batch, positions, heads, head width]");
  const auto whole = q.size(1) * group.size();
  if (o.key_padding_mask.defined() &&
      (o.key_padding_mask.dim() != 2 || o.key_padding_mask.size(0) != q.size(0) || o.key_padding_mask.size(1) != whole))
    throw error(who, group.world_rank(),
                "key_padding_mask must be [batch, positions of the whole sequence] = [" + std::to_string(q.size(0)) +
                    ", " + std::to_string(whole) + "]");
  if (o.key_padding_mask.defined() && o.key_padding_mask.scalar_type() != at::kBool)
    throw error(who, group.world_rank(),
                std::string("key_padding_mask must be bool, true where a key is padding; this one is ") +
                    c10::toString(o.key_padding_mask.scalar_type()) +
                    " (an additive mask is not taken: pass a bool one, such as mask.to(torch::kBool) for 0/1)");
  (void)chunks(whole, group.rank(), group.size(), o.layout);  // throws where the layout cannot cut it
}

}  // namespace detail

/// Attention of q, k, v [B, S, H, D] over whole sequences on one device: softmax(q·kᵀ·scale +
/// masks)·v, [B, S, H, D]. What the context-parallel algorithms compute, a rank's positions
/// each. A query whose every key is hidden gets NaN, as torch's softmax gives.
[[nodiscard]] inline at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          const AttentionOptions& o = {}) {
  const auto all = at::arange(q.size(1), q.options().dtype(at::kLong));
  return detail::attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), all, all, o).transpose(1, 2);
}

}  // namespace paratrain::cp
