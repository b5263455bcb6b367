#pragma once
// A GPT-style decoder of paratrain::tp layers: token and position embeddings, pre-norm
// blocks (causal attention and an MLP, their matrices cut over the tensor group), a final
// layer norm and an untied head whose vocabulary is cut too. At tensor degree 1 it is the
// plain model; at degree t each rank holds 1/t of every matrix (docs/tensor-parallelism.md).
#include <torch/torch.h>

#include <string>
#include <vector>

#include "paratrain/strategy/unit.hpp"
#include "paratrain/tensor_parallel/column_parallel_linear.hpp"
#include "paratrain/tensor_parallel/embeddings.hpp"
#include "paratrain/tensor_parallel/layer_norm.hpp"
#include "paratrain/tensor_parallel/transformer_block.hpp"

namespace gpt {

// The default sizes are small and every degree of 1-4 divides them (12 heads of 4 features,
// 96 inner features and tokens, sequences of 12), so that the example runs at t = 3 as well;
// the tests train this model too (tests/support/gpt_reference.hpp).
struct Config {
  std::int64_t vocabulary = 96, positions = 12, hidden = 48, heads = 12, ffn = 96, layers = 2;
  double dropout = 0.1;
};

struct GptImpl : torch::nn::Module {
  explicit GptImpl(const Config& c = {}) {
    namespace tp = paratrain::tp;
    embeddings = register_module("embeddings", tp::Embeddings(c.vocabulary, c.positions, c.hidden, c.dropout));
    for (std::int64_t i = 0; i < c.layers; ++i)
      blocks.push_back(register_module(
          "block" + std::to_string(i),
          paratrain::Unit<tp::TransformerBlock>(tp::TransformerBlockOptions(c.hidden, c.heads).ffn(c.ffn).dropout(c.dropout))));
    ln = register_module("ln", tp::LayerNorm(c.hidden));
    head = register_module("head",
                           tp::ColumnParallelLinear(tp::ColumnParallelLinearOptions(c.hidden, c.vocabulary).bias(false)));
  }
  /// Token ids [batch, sequence] → this rank's part of the logits [batch, sequence, vocabulary / t].
  torch::Tensor forward(torch::Tensor ids) {
    auto x = embeddings(ids);
    for (auto& b : blocks) x = b(x);
    return head(ln(x));
  }
  paratrain::tp::Embeddings embeddings{nullptr};
  std::vector<paratrain::Unit<paratrain::tp::TransformerBlock>> blocks;
  paratrain::tp::LayerNorm ln{nullptr};
  paratrain::tp::ColumnParallelLinear head{nullptr};
};
TORCH_MODULE(Gpt);

}  // namespace gpt
