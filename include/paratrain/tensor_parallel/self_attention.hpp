#pragma once
/// \file
/// paratrain::tp::SelfAttention — causal multi-head self-attention with its heads cut over
/// the tensor group (Megatron-LM's parallel attention).

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>

#include "paratrain/tensor_parallel/column_parallel_linear.hpp"
#include "paratrain/tensor_parallel/context.hpp"
#include "paratrain/tensor_parallel/dropout.hpp"
#include "paratrain/tensor_parallel/row_parallel_linear.hpp"

namespace paratrain::tensor_parallel {

/// Causal self-attention over `heads` heads of `hidden / heads` features: q, k and v three
/// ColumnParallelLinear(hidden, hidden) (rank r computes heads [r·heads/t, (r+1)·heads/t)),
/// the output a RowParallelLinear(hidden, hidden); one all-reduce forward and one backward
/// (Note [Regions]). The attention probabilities drop with keyed dropout, placed by head
/// (Note [Keyed dropout]). Built in the order q, k, v, out, dropout, so that a single-device
/// model built as three torch::nn::Linear, one more and a tp::Dropout draws the same weights.
class SelfAttentionImpl : public torch::nn::Module {
 public:
  SelfAttentionImpl(std::int64_t hidden, std::int64_t heads, double dropout = 0.0,
                    std::optional<Context> context = std::nullopt)
      : context_(context_for("tp::SelfAttention", context)), heads_(heads) {
    const auto name = "tp::SelfAttention(" + std::to_string(hidden) + ", " + std::to_string(heads) + ")";
    if (heads <= 0 || hidden % heads != 0)
      throw error(name, context_.group.world_rank(),
                  "its hidden size (" + std::to_string(hidden) + ") is not a multiple of its heads (" +
                      std::to_string(heads) + ")");
    local_heads_ = divided(name, "attention heads", heads, context_.group);
    head_dim_ = hidden / heads;
    const auto column = ColumnParallelLinearOptions(hidden, hidden).context(context_);
    q = register_module("q", ColumnParallelLinear(column));
    k = register_module("k", ColumnParallelLinear(column));
    v = register_module("v", ColumnParallelLinear(column));
    out = register_module("out", RowParallelLinear(RowParallelLinearOptions(hidden, hidden).context(context_)));
    drop = register_module("drop", Dropout(dropout));
  }

  /// [batch, sequence, hidden] (under sequence parallelism, this rank's sequence shard) → the same.
  at::Tensor forward(const at::Tensor& x) {
    const auto qkv = column_parallel({q.get(), k.get(), v.get()}, x);  // one region for the three: Note [Regions]
    const auto b = qkv[0].size(0), s = qkv[0].size(1);
    const auto split = [&](const at::Tensor& t) { return t.view({b, s, local_heads_, head_dim_}).transpose(1, 2); };
    const auto Q = split(qkv[0]), K = split(qkv[1]), V = split(qkv[2]);
    auto scores = at::matmul(Q, K.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim_));
    const auto future = at::ones({s, s}, x.options().dtype(at::kBool)).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
    auto probs = drop(scores.softmax(-1),
                      Placement{.dim = 1, .offset = context_.group.rank() * local_heads_, .whole = heads_});
    const auto mixed = at::matmul(probs, V).transpose(1, 2).reshape({b, s, local_heads_ * head_dim_});
    return out(mixed);
  }

  ColumnParallelLinear q{nullptr}, k{nullptr}, v{nullptr};
  RowParallelLinear out{nullptr};
  Dropout drop{nullptr};

 private:
  Context context_;
  std::int64_t heads_, local_heads_ = 0, head_dim_ = 0;
};
TORCH_MODULE(SelfAttention);

}  // namespace paratrain::tensor_parallel
