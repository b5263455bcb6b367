#pragma once
/// \file
/// paratrain::cp::all_to_all_attention — attention over a sequence cut across a context group,
/// by all-to-all (DeepSpeed-Ulysses; Note [All-to-all attention]).

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/autograd.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>

#include "paratrain/core/error.hpp"
#include "paratrain/tensor_parallel/group.hpp"
#include "paratrain/tensor_parallel/regions.hpp"

namespace paratrain::cp {

// Note [All-to-all attention]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Context parallelism cuts a sequence of S positions over the cp ranks of a context group:
// rank c holds positions [c·S/cp, (c+1)·S/cp) of every head, and every layer but attention
// works on its positions alone. Attention needs every position. Ulysses (Jacobs et al. 2023)
// trades the cut: one all-to-all turns q, k and v from [B, S/cp, H, D] (this rank's positions,
// every head) into [B, S, H/cp, D] (every position, this rank's heads: heads
// [c·H/cp, (c+1)·H/cp)), attention runs whole on those heads, causal and padding masks as on
// one device, and a second all-to-all turns the result back. Each exchange's backward is the
// reverse exchange, so the gradients of q, k and v arrive at the ranks that hold their
// positions. Each rank sends 3 + 1 tensors of (cp−1)/cp of its activations a layer (and the
// same in backward); the head count must be a multiple of cp. Its activations per rank fall
// as 1/cp: the scores are [B, H/cp, S, S].

/// What attention masks and scales (Note [All-to-all attention]).
struct AttentionOptions {
  bool causal = false;          ///< position i attends to positions <= i only
  at::Tensor key_padding_mask;  ///< [B, S], the whole sequence on every rank: true where a key is padding
  double scale = 0;             ///< the scores' factor; 0: 1 / sqrt(D)
};

namespace detail {

using tensor_parallel::detail::GroupHolder;  // a Group kept by autograd (tensor_parallel/regions.hpp)

// Group::all_to_all(x, scatter, gather), whose backward is the exchange the other way.
struct Exchange : torch::autograd::Function<Exchange> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const tensor_parallel::Group& g, std::int64_t scatter, std::int64_t gather) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(c10::make_intrusive<GroupHolder>(g));
    ctx->saved_data["scatter"] = scatter;
    ctx->saved_data["gather"] = gather;
    return g.all_to_all(x, scatter, gather);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto holder = c10::static_intrusive_pointer_cast<GroupHolder>(ctx->saved_data["group"].toCapsule());
    return {holder->group.all_to_all(grads[0], ctx->saved_data["gather"].toInt(), ctx->saved_data["scatter"].toInt()),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

inline at::Tensor exchange(const at::Tensor& x, const tensor_parallel::Group& g, std::int64_t scatter,
                           std::int64_t gather) {
  return g.size() == 1 ? x : Exchange::apply(x, g, scatter, gather);
}

}  // namespace detail

/// Attention of q, k, v [B, S, H, D] over whole sequences on one device: softmax(q·kᵀ·scale +
/// masks)·v, [B, S, H, D]. What all_to_all_attention computes on each rank's heads.
[[nodiscard]] inline at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          const AttentionOptions& o = {}) {
  const auto S = q.size(1);
  const double scale = o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  auto scores = at::matmul(q.transpose(1, 2), k.transpose(1, 2).transpose(2, 3)) * scale;  // [B, H, S, S]
  const auto lowest = -std::numeric_limits<double>::infinity();
  if (o.causal) scores = scores.masked_fill(at::ones({S, S}, q.options().dtype(at::kBool)).triu(1), lowest);
  if (o.key_padding_mask.defined())
    scores = scores.masked_fill(o.key_padding_mask.to(q.device()).view({q.size(0), 1, 1, S}), lowest);
  return at::matmul(at::softmax(scores, -1), v.transpose(1, 2)).transpose(1, 2);  // [B, S, H, D]
}

/// Attention over sequences cut across `group` (a context group: `tp::Group(mesh,
/// Dim::context)`): q, k, v hold this rank's positions of every head, [B, S/cp, H, D], the
/// result likewise (Note [All-to-all attention]). H must be a multiple of the group's size;
/// `key_padding_mask` is the whole sequence's, [B, S].
[[nodiscard]] inline at::Tensor all_to_all_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const tensor_parallel::Group& group,
                                                     const AttentionOptions& o = {}) {
  if (q.dim() != 4 || k.sizes() != q.sizes() || v.sizes() != q.sizes())
    throw error("cp::all_to_all_attention", group.world_rank(),
                "q, k and v must have the same shape [batch, positions, heads, head width]");
  if (q.size(2) % group.size() != 0)
    throw error("cp::all_to_all_attention", group.world_rank(),
                std::to_string(q.size(2)) + " heads cannot be shared equally by a context group of " +
                    std::to_string(group.size()) + " ranks; all-to-all attention needs a multiple of " +
                    std::to_string(group.size()) + " heads");
  const auto whole = q.size(1) * group.size();
  if (o.key_padding_mask.defined() &&
      (o.key_padding_mask.dim() != 2 || o.key_padding_mask.size(0) != q.size(0) || o.key_padding_mask.size(1) != whole))
    throw error("cp::all_to_all_attention", group.world_rank(),
                "key_padding_mask must be [batch, positions of the whole sequence] = [" + std::to_string(q.size(0)) +
                    ", " + std::to_string(whole) + "]");
  // heads cut, positions gathered: [B, S, H/cp, D]; then back.
  const auto qs = detail::exchange(q, group, 2, 1), ks = detail::exchange(k, group, 2, 1),
             vs = detail::exchange(v, group, 2, 1);
  return detail::exchange(attention(qs, ks, vs, o), group, 1, 2);
}

}  // namespace paratrain::cp
