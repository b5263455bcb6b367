#pragma once
/// \file
/// paratrain::cp::all_to_all_attention — attention over a sequence cut across a context group,
/// by all-to-all (DeepSpeed-Ulysses; Note [All-to-all attention]).

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/autograd.h>

#include <cstdint>
#include <string>
#include <vector>

#include "paratrain/context/attention.hpp"
#include "paratrain/context/layout.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/tensor_parallel/group.hpp"
#include "paratrain/tensor_parallel/regions.hpp"

namespace paratrain::cp {

// Note [All-to-all attention]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Context parallelism cuts a sequence of S positions over the cp ranks of a context group
// (Note [Sequence layouts]): each rank holds S/cp positions of every head, and every layer
// but attention works on its positions alone. Attention needs every position. Ulysses
// (Jacobs et al. 2023) trades the cut: one all-to-all turns q, k and v from [B, S/cp, H, D]
// (this rank's positions, every head) into [B, S, H/cp, D] (every position, this rank's
// heads: heads [c·H/cp, (c+1)·H/cp)), attention runs whole on those heads, causal and
// padding masks as on one device (by the positions the ranks hold, in the order the exchange
// gathers them: any layout), and a second all-to-all turns the result back. Each exchange's
// backward is the reverse exchange, so the gradients of q, k and v arrive at the ranks that
// hold their positions. Each rank sends 3 + 1 tensors of (cp−1)/cp of its activations a
// layer (and the same in backward); the head count must be a multiple of cp. Its activations
// per rank fall as 1/cp: the scores are [B, H/cp, S, S].

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

/// Attention over sequences cut across `group` (a context group: `tp::Group(mesh,
/// Dim::context)`): q, k, v hold this rank's positions of every head, [B, S/cp, H, D], the
/// result likewise (Note [All-to-all attention]). H must be a multiple of the group's size;
/// `key_padding_mask` is the whole sequence's, [B, S].
[[nodiscard]] inline at::Tensor all_to_all_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     const tensor_parallel::Group& group,
                                                     const AttentionOptions& o = {}) {
  detail::check_shapes("cp::all_to_all_attention", q, k, v, group, o);
  if (q.size(2) % group.size() != 0)
    throw error("cp::all_to_all_attention", group.world_rank(),
                std::to_string(q.size(2)) + " heads cannot be shared equally by a context group of " +
                    std::to_string(group.size()) + " ranks; all-to-all attention needs a multiple of " +
                    std::to_string(group.size()) + " heads");
  const auto whole = q.size(1) * group.size();
  // The positions the exchange gathers, in rank order, each rank's in its layout's order.
  std::vector<at::Tensor> order;
  for (int r = 0; r < group.size(); ++r)
    order.push_back(positions(whole, r, group.size(), o.layout, q.options().dtype(at::kLong)));
  const auto gathered = at::cat(order);
  // heads cut, positions gathered: [B, H/cp, S, D]; then back.
  const auto across = [&](const at::Tensor& x) { return detail::exchange(x, group, 2, 1).transpose(1, 2); };
  const auto out = cp::detail::attend(across(q), across(k), across(v), gathered, gathered, o);
  return detail::exchange(out.transpose(1, 2), group, 1, 2);
}

}  // namespace paratrain::cp
