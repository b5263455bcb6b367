#pragma once
// A GPT-style decoder of paratrain::tp layers: token and position embeddings, pre-norm
// blocks (causal attention and an MLP, their matrices cut over the tensor group), a final
// layer norm and an untied head whose vocabulary is cut too. At tensor degree 1 it is the
// plain model; at degree t each rank holds 1/t of every matrix (docs/tensor-parallelism.md).
// With Config::experts > 0 each block's MLP is a mixture of that many experts
// (moe::MixtureOfExperts), cut over the strategy's expert group (docs/experts.md). With
// Config::context each block's attention is cp::SelfAttention, the sequences cut over the
// strategy's context group (ring or all-to-all attention: docs/context-parallelism.md).
#include <torch/torch.h>

#include <string>
#include <vector>

#include "paratrain/context/layout.hpp"
#include "paratrain/context/self_attention.hpp"
#include "paratrain/experts/mixture_of_experts.hpp"
#include "paratrain/strategy/unit.hpp"
#include "paratrain/tensor_parallel/column_parallel_linear.hpp"
#include "paratrain/tensor_parallel/embeddings.hpp"
#include "paratrain/tensor_parallel/dropout.hpp"
#include "paratrain/tensor_parallel/layer_norm.hpp"
#include "paratrain/tensor_parallel/mlp.hpp"
#include "paratrain/tensor_parallel/self_attention.hpp"
#include "paratrain/tensor_parallel/transformer_block.hpp"

namespace gpt {

// The default sizes are small and every degree of 1-4 divides them (12 heads of 4 features,
// 96 inner features and tokens, sequences of 12), so that the example runs at t = 3 as well;
// the tests train this model too (tests/support/gpt_reference.hpp).
struct Config {
  std::int64_t vocabulary = 96, positions = 12, hidden = 48, heads = 12, ffn = 96, layers = 2;
  double dropout = 0.1;
  int experts = 0;                ///< > 0: each block's MLP a mixture of this many experts (of ffn inner features)
  int top_k = 2;                  ///< experts per token
  double capacity_factor = 1.25;  ///< 0: dropless
  /// Context-parallel attention (cp::SelfAttention, no dropout on its probabilities) over the
  /// strategy's context group, the sequences cut in `layout`; false: tp::SelfAttention.
  bool context = false;
  paratrain::cp::Algorithm algorithm = paratrain::cp::Algorithm::ring;
  paratrain::cp::Layout layout = paratrain::cp::Layout::zigzag;
};

// A block with a mixture of experts or context-parallel attention:
// x + drop(attention(ln1(x))), then + drop(ffn(ln2(x))). The attention is tp::SelfAttention,
// or cp::SelfAttention with Config::context; the ffn a tensor-parallel MLP, or a mixture of
// experts with Config::experts > 0. The experts see whole sequences (no sequence parallelism:
// the tensor ranks must route the same tokens), join the strategy's expert group, and are held
// whole on every tensor rank.
struct MoeBlockImpl : torch::nn::Module {
  explicit MoeBlockImpl(const Config& c) {
    namespace tp = paratrain::tp;
    ln1 = register_module("ln1", tp::LayerNorm(c.hidden));
    if (c.context)
      context_attention = register_module(
          "attention", paratrain::cp::SelfAttention(c.hidden, c.heads,
                                                    paratrain::cp::AttentionOptions{
                                                        .causal = true, .layout = c.layout, .algorithm = c.algorithm}));
    else
      attention = register_module("attention", tp::SelfAttention(c.hidden, c.heads, c.dropout));
    drop1 = register_module("drop1", tp::Dropout(c.dropout));
    ln2 = register_module("ln2", tp::LayerNorm(c.hidden));
    if (c.experts > 0)
      experts = register_module("experts", paratrain::moe::MixtureOfExperts(paratrain::moe::Options{
                                               .model = c.hidden,
                                               .hidden = c.ffn,
                                               .experts = c.experts,
                                               .top_k = c.top_k,
                                               .capacity_factor = c.capacity_factor}));
    else
      mlp = register_module("mlp", tp::Mlp(c.hidden, c.ffn));
    drop2 = register_module("drop2", tp::Dropout(c.dropout));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    const auto a = ln1(x);
    auto h = x + drop1(context_attention ? context_attention(a) : attention(a));
    const auto b = ln2(h);
    return h + drop2(experts ? experts(b) : mlp(b));
  }
  paratrain::tp::LayerNorm ln1{nullptr}, ln2{nullptr};
  paratrain::tp::SelfAttention attention{nullptr};
  paratrain::cp::SelfAttention context_attention{nullptr};
  paratrain::moe::MixtureOfExperts experts{nullptr};
  paratrain::tp::Mlp mlp{nullptr};
  paratrain::tp::Dropout drop1{nullptr}, drop2{nullptr};
};
TORCH_MODULE(MoeBlock);

struct GptImpl : torch::nn::Module {
  explicit GptImpl(const Config& c = {}) : context_(c.context), layout_(c.layout), group_(paratrain::tp::context_group()) {
    namespace tp = paratrain::tp;
    embeddings = register_module("embeddings", tp::Embeddings(c.vocabulary, c.positions, c.hidden, c.dropout));
    for (std::int64_t i = 0; i < c.layers; ++i) {
      const auto name = "block" + std::to_string(i);
      if (c.experts > 0 || c.context)
        moe_blocks.push_back(register_module(name, paratrain::Unit<MoeBlock>(c)));
      else
        blocks.push_back(register_module(name, paratrain::Unit<tp::TransformerBlock>(
                                                   tp::TransformerBlockOptions(c.hidden, c.heads).ffn(c.ffn).dropout(c.dropout))));
    }
    ln = register_module("ln", tp::LayerNorm(c.hidden));
    head = register_module("head",
                           tp::ColumnParallelLinear(tp::ColumnParallelLinearOptions(c.hidden, c.vocabulary).bias(false)));
  }
  /// Token ids [batch, sequence] → this rank's part of the logits [batch, sequence, vocabulary / t]
  /// (with Config::context, of this rank's positions: [batch, sequence / cp, vocabulary / t],
  /// in the layout's order, as cp::shard cuts the targets).
  torch::Tensor forward(torch::Tensor ids) {
    auto x = context_ ? embeddings->at_positions(
                            paratrain::cp::shard(ids, 1, group_, layout_),
                            paratrain::cp::positions(ids.size(1), group_.rank(), group_.size(), layout_))
                      : embeddings(ids);
    for (auto& b : blocks) x = b(x);
    for (auto& b : moe_blocks) x = b(x);
    return head(ln(x));
  }
  /// The last forward's auxiliary load-balancing losses, summed over the blocks (0 without experts).
  torch::Tensor aux_loss() const {
    auto sum = torch::zeros({});
    for (const auto& b : moe_blocks) sum = sum + b->experts->aux_loss();
    return sum;
  }
  paratrain::tp::Embeddings embeddings{nullptr};
  std::vector<paratrain::Unit<paratrain::tp::TransformerBlock>> blocks;
  std::vector<paratrain::Unit<MoeBlock>> moe_blocks;
  paratrain::tp::LayerNorm ln{nullptr};
  paratrain::tp::ColumnParallelLinear head{nullptr};

 private:
  bool context_;
  paratrain::cp::Layout layout_;
  paratrain::tp::Group group_;  // the context group the model was built in
};
TORCH_MODULE(Gpt);

}  // namespace gpt
