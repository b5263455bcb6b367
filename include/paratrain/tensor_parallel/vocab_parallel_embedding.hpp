#pragma once
/// \file
/// paratrain::tp::VocabParallelEmbedding — an embedding whose vocabulary is cut over the
/// tensor group (Megatron-LM's vocabulary-parallel embedding).

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "paratrain/tensor_parallel/column_parallel_linear.hpp"
#include "paratrain/tensor_parallel/context.hpp"
#include "paratrain/tensor_parallel/init.hpp"
#include "paratrain/tensor_parallel/regions.hpp"
#include "paratrain/tensor_parallel/sharding.hpp"

namespace paratrain::tensor_parallel {

/// torch::nn::Embedding(count, dim) with rows [r·count/t, (r+1)·count/t) of the table on rank
/// r, drawn as LibTorch draws the whole (normal, mean 0, std 1: Note [Initialising a slice]).
/// Each rank looks up the tokens of its rows, zeros for the others, and the group sums the
/// lookups (Note [Regions]); under sequence parallelism the sum is reduce-scattered along the
/// sequence, each rank keeping its shard of the tokens.
class VocabParallelEmbeddingImpl : public torch::nn::Module, public ShardedLayer {
 public:
  VocabParallelEmbeddingImpl(std::int64_t count, std::int64_t dim, std::optional<Context> context = std::nullopt)
      : count_(count), context_(context_for("tp::VocabParallelEmbedding", context)) {
    const auto& g = context_.group;
    part_ = divided("tp::VocabParallelEmbedding(" + std::to_string(count) + ", " + std::to_string(dim) + ")",
                    "vocabulary", count, g);
    weight = register_parameter("weight", embedding_weight_slice(count, dim, g.rank() * part_, part_));
  }

  /// `tokens` [batch, sequence] (integers in [0, count)) → [batch, sequence, dim], or this
  /// rank's sequence shard of it under sequence parallelism.
  at::Tensor forward(const at::Tensor& tokens) {
    const auto& g = context_.group;
    at::Tensor looked;
    if (g.size() == 1) {
      looked = at::embedding(weight, tokens);
    } else {
      const auto first = g.rank() * part_;
      const auto outside = tokens.lt(first).logical_or(tokens.ge(first + part_));
      looked = at::embedding(weight, (tokens - first).masked_fill(outside, 0));
      looked = looked.masked_fill(outside.unsqueeze(-1), 0.0);
    }
    return context_.sequence_parallel ? reduce_scatter_sequence(looked, g, sequence_dim)
                                      : reduce_from_region(looked, g);
  }

  [[nodiscard]] std::vector<ShardedParameter> slices() const override {
    return {{"weight", 0, context_.group.rank() * part_, count_}};
  }
  [[nodiscard]] const Group& slice_group() const override { return context_.group; }
  [[nodiscard]] const Context& context() const noexcept { return context_; }

  at::Tensor weight;

 private:
  std::int64_t count_;
  Context context_;
  std::int64_t part_ = 0;
};
TORCH_MODULE(VocabParallelEmbedding);

}  // namespace paratrain::tensor_parallel
