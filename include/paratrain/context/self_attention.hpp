#pragma once
/// \file
/// paratrain::cp::SelfAttention — tp::SelfAttention's projections (heads cut over the tensor
/// group) around cp::attention over the context group: a GPT block's attention on a rank's
/// positions of every sequence.

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <cstdint>
#include <optional>
#include <string>

#include "paratrain/context/ring_attention.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/tensor_parallel/column_parallel_linear.hpp"
#include "paratrain/tensor_parallel/context.hpp"
#include "paratrain/tensor_parallel/row_parallel_linear.hpp"

namespace paratrain::cp {

/// Self-attention over `heads` heads of `hidden / heads` features whose sequences are cut over
/// the context group (tp::Context::context: the strategy's, DataParallelOptions::
/// context_parallel) and whose heads are cut over the tensor group: q, k and v three
/// tp::ColumnParallelLinear(hidden, hidden), cp::attention(q, k, v, context group, `options`)
/// on this rank's heads, the output a tp::RowParallelLinear(hidden, hidden). Its input is this
/// rank's positions of each sequence, [batch, sequence / cp, hidden], in `options.layout`'s
/// order (cp::shard); at a context group of one it is the whole sequence and the attention one
/// device's. Built in the order q, k, v, out: the weights of a single-device model built as four
/// torch::nn::Linear. No dropout on the probabilities (no context-parallel algorithm keeps them).
class SelfAttentionImpl : public torch::nn::Module {
 public:
  SelfAttentionImpl(std::int64_t hidden, std::int64_t heads, AttentionOptions options = {.causal = true},
                    std::optional<tensor_parallel::Context> context = std::nullopt)
      : context_(tensor_parallel::context_for("cp::SelfAttention", context)), options_(std::move(options)) {
    const auto name = "cp::SelfAttention(" + std::to_string(hidden) + ", " + std::to_string(heads) + ")";
    if (heads <= 0 || hidden % heads != 0)
      throw error(name, context_.group.world_rank(),
                  "its hidden size (" + std::to_string(hidden) + ") is not a multiple of its heads (" +
                      std::to_string(heads) + ")");
    if (context_.sequence_parallel && context_.context.size() > 1)
      throw error(name, context_.group.world_rank(),
                  "sequence parallelism cuts the sequence over the tensor group too, and this attention's sequence "
                  "is cut over the context group already: use one of the two");
    local_heads_ = tensor_parallel::divided(name, "attention heads", heads, context_.group);
    head_dim_ = hidden / heads;
    const auto column = tensor_parallel::ColumnParallelLinearOptions(hidden, hidden).context(context_);
    q = register_module("q", tensor_parallel::ColumnParallelLinear(column));
    k = register_module("k", tensor_parallel::ColumnParallelLinear(column));
    v = register_module("v", tensor_parallel::ColumnParallelLinear(column));
    out = register_module("out", tensor_parallel::RowParallelLinear(
                                     tensor_parallel::RowParallelLinearOptions(hidden, hidden).context(context_)));
  }

  /// [batch, sequence / cp, hidden], this rank's positions → the same.
  at::Tensor forward(const at::Tensor& x) {
    const auto qkv = tensor_parallel::column_parallel({q.get(), k.get(), v.get()}, x);
    const auto b = qkv[0].size(0), s = qkv[0].size(1);
    const auto split = [&](const at::Tensor& t) { return t.view({b, s, local_heads_, head_dim_}); };
    const auto& group = context_.context;
    const auto mixed = group.size() > 1 ? attention(split(qkv[0]), split(qkv[1]), split(qkv[2]), group, options_)
                                        : attention(split(qkv[0]), split(qkv[1]), split(qkv[2]), options_);
    return out(mixed.reshape({b, s, local_heads_ * head_dim_}));
  }

  [[nodiscard]] const AttentionOptions& options() const noexcept { return options_; }
  /// The group its sequences are cut over.
  [[nodiscard]] const tensor_parallel::Group& context_group() const noexcept { return context_.context; }

  tensor_parallel::ColumnParallelLinear q{nullptr}, k{nullptr}, v{nullptr};
  tensor_parallel::RowParallelLinear out{nullptr};

 private:
  tensor_parallel::Context context_;
  AttentionOptions options_;
  std::int64_t local_heads_ = 0, head_dim_ = 0;
};
TORCH_MODULE(SelfAttention);

}  // namespace paratrain::cp
