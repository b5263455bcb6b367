#pragma once
/// \file
/// The conjugate pairs of tensor parallelism (Megatron-LM's f and g, and sequence
/// parallelism's all-gather / reduce-scatter): autograd functions over a tp::Group.

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/autograd.h>

#include <cstdint>

#include "paratrain/tensor_parallel/group.hpp"

namespace paratrain::tensor_parallel {

// Note [Regions]
// ~~~~~~~~~~~~~~
// Shoeybi et al. 2019 (Megatron-LM, §3) cut an MLP's first matrix by columns and its second
// by rows, so the block needs one all-reduce forward (g: after the row-parallel matrix) and
// one backward (f: the gradient of the input the column-parallel matrix shares); f and g are
// conjugate: identity one way, all-reduce the other. With sequence parallelism (Korthikanti
// et al. 2022, §4.2.2) the activations between the regions are cut along the sequence: f
// becomes an all-gather forward whose backward is a reduce-scatter, g a reduce-scatter forward
// whose backward is an all-gather; the same bytes, and the layer norms and dropouts between
// them work on 1/t of the tokens. (The column-parallel linears fuse f with their products to
// keep the input as its shard: Note [Sequence-parallel inputs kept as shards].) Each pair is one autograd function below: the forward
// exchange and the backward exchange, over the layer's group, along one dimension.

namespace detail {

enum class Exchange : std::int64_t { identity, all_reduce, all_gather, reduce_scatter, part };

// The group travels with the autograd graph inside a capsule, so that a backward run after
// the layer is gone still has its communicator.
struct GroupHolder : torch::CustomClassHolder {
  explicit GroupHolder(Group g) : group(std::move(g)) {}
  Group group;
};

inline at::Tensor exchange(const Group& g, Exchange e, const at::Tensor& x, std::int64_t dim) {
  switch (e) {
    case Exchange::identity: return x;
    case Exchange::all_reduce: {
      auto t = x.contiguous().clone();
      g.all_reduce(t);
      return t;
    }
    case Exchange::all_gather: return g.all_gather(x, dim);
    case Exchange::reduce_scatter: return g.reduce_scatter(x, dim);
    case Exchange::part: return g.part(x, dim).contiguous();
  }
  return x;
}

struct Region : torch::autograd::Function<Region> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const Group& g,
                            std::int64_t forward, std::int64_t backward, std::int64_t dim) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(c10::make_intrusive<GroupHolder>(g));
    ctx->saved_data["backward"] = backward;
    ctx->saved_data["dim"] = dim;
    auto out = exchange(g, static_cast<Exchange>(forward), x, dim);
    // An identity forward still hands autograd a tensor of its own (a view would do, but a
    // custom function's output must not be its input).
    return out.is_same(x) ? x.view_as(x) : out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto holder = c10::static_intrusive_pointer_cast<GroupHolder>(ctx->saved_data["group"].toCapsule());
    const auto e = static_cast<Exchange>(ctx->saved_data["backward"].toInt());
    return {exchange(holder->group, e, grads[0], ctx->saved_data["dim"].toInt()), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

inline at::Tensor region(const at::Tensor& x, const Group& g, Exchange forward, Exchange backward,
                         std::int64_t dim = -1) {
  if (g.size() == 1) return x;
  return Region::apply(x, g, static_cast<std::int64_t>(forward), static_cast<std::int64_t>(backward), dim);
}

}  // namespace detail

/// f: the input of a column-parallel region, whole on every rank: identity forward,
/// all-reduce of its gradient backward (Note [Regions]). Also what a parameter replicated
/// over the group whose gradients are partial (a layer norm on sequence shards) goes through.
[[nodiscard]] inline at::Tensor copy_to_region(const at::Tensor& x, const Group& g) {
  return detail::region(x, g, detail::Exchange::identity, detail::Exchange::all_reduce);
}
/// g: the partial sums a row-parallel region produced, all-reduced; gradient unchanged.
[[nodiscard]] inline at::Tensor reduce_from_region(const at::Tensor& x, const Group& g) {
  return detail::region(x, g, detail::Exchange::all_reduce, detail::Exchange::identity);
}
/// Every rank's part concatenated along `dim`; backward keeps this rank's part.
[[nodiscard]] inline at::Tensor gather_from_region(const at::Tensor& x, const Group& g, std::int64_t dim) {
  return detail::region(x, g, detail::Exchange::all_gather, detail::Exchange::part, dim);
}
/// This rank's part along `dim`; backward gathers every rank's gradient part.
[[nodiscard]] inline at::Tensor scatter_to_region(const at::Tensor& x, const Group& g, std::int64_t dim) {
  return detail::region(x, g, detail::Exchange::part, detail::Exchange::all_gather, dim);
}
/// Sequence parallelism's f: the sequence shards gathered along `dim`; backward
/// reduce-scatters the gradient back to them.
[[nodiscard]] inline at::Tensor gather_sequence(const at::Tensor& x, const Group& g, std::int64_t dim) {
  return detail::region(x, g, detail::Exchange::all_gather, detail::Exchange::reduce_scatter, dim);
}
/// Sequence parallelism's g: the partial sums reduced and cut along `dim`; backward
/// all-gathers the gradient.
[[nodiscard]] inline at::Tensor reduce_scatter_sequence(const at::Tensor& x, const Group& g, std::int64_t dim) {
  return detail::region(x, g, detail::Exchange::reduce_scatter, detail::Exchange::all_gather, dim);
}

}  // namespace paratrain::tensor_parallel
