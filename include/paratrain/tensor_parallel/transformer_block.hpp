#pragma once
/// \file
/// paratrain::tp::TransformerBlock — a pre-norm GPT block (attention and MLP, each behind a
/// layer norm and a residual dropout) cut over the tensor group.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>

#include "paratrain/tensor_parallel/context.hpp"
#include "paratrain/tensor_parallel/dropout.hpp"
#include "paratrain/tensor_parallel/layer_norm.hpp"
#include "paratrain/tensor_parallel/mlp.hpp"
#include "paratrain/tensor_parallel/self_attention.hpp"

namespace paratrain::tensor_parallel {

struct TransformerBlockOptions {
  TransformerBlockOptions(std::int64_t hidden, std::int64_t heads) : hidden_(hidden), heads_(heads) {}
  TORCH_ARG(std::int64_t, hidden);
  TORCH_ARG(std::int64_t, heads);
  /// The MLP's inner features; 0: 4 × hidden.
  TORCH_ARG(std::int64_t, ffn) = 0;
  /// Dropout on the attention probabilities and on both residual branches.
  TORCH_ARG(double, dropout) = 0.0;
  TORCH_ARG(std::optional<Context>, context) = std::nullopt;
};

/// x + drop(attention(ln1(x))), then + drop(mlp(ln2(x))): two all-reduces forward and two
/// backward without sequence parallelism; with it, the activations between the regions are
/// this rank's sequence shard, [batch, sequence/t, hidden], and each all-reduce becomes an
/// all-gather and a reduce-scatter (Note [Regions]). Built in the order ln1, attention (q, k,
/// v, out, its dropout), the first residual dropout, ln2, MLP (fc1, fc2), the second.
class TransformerBlockImpl : public torch::nn::Module {
 public:
  explicit TransformerBlockImpl(const TransformerBlockOptions& o)
      : context_(context_for("tp::TransformerBlock", o.context())) {
    const auto h = o.hidden(), ffn = o.ffn() > 0 ? o.ffn() : 4 * h;
    ln1 = register_module("ln1", LayerNorm(h, 1e-5, context_));
    attention = register_module("attention", SelfAttention(h, o.heads(), o.dropout(), context_));
    drop1 = register_module("drop1", Dropout(o.dropout()));
    ln2 = register_module("ln2", LayerNorm(h, 1e-5, context_));
    mlp = register_module("mlp", Mlp(h, ffn, context_));
    drop2 = register_module("drop2", Dropout(o.dropout()));
  }
  TransformerBlockImpl(std::int64_t hidden, std::int64_t heads)
      : TransformerBlockImpl(TransformerBlockOptions(hidden, heads)) {}

  at::Tensor forward(const at::Tensor& x) {
    const auto where = placement(x);
    auto h = x + drop1(attention(ln1(x)), where);
    return h + drop2(mlp(ln2(h)), where);
  }

  /// Where this rank's activations sit in the whole: its sequence shard under sequence
  /// parallelism, else whole.
  [[nodiscard]] Placement placement(const at::Tensor& x) const {
    if (!context_.sequence_parallel) return {};
    const auto s = x.size(sequence_dim);
    return {.dim = sequence_dim, .offset = context_.group.rank() * s, .whole = s * context_.group.size()};
  }

  LayerNorm ln1{nullptr}, ln2{nullptr};
  SelfAttention attention{nullptr};
  Mlp mlp{nullptr};
  Dropout drop1{nullptr}, drop2{nullptr};

 private:
  Context context_;
};
TORCH_MODULE(TransformerBlock);

}  // namespace paratrain::tensor_parallel
