#pragma once
/// \file
/// paratrain::tp::Embeddings — a GPT's input: token embeddings cut over the vocabulary,
/// learned positions, dropout.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>
#include <string>

#include "paratrain/tensor_parallel/context.hpp"
#include "paratrain/tensor_parallel/dropout.hpp"
#include "paratrain/tensor_parallel/init.hpp"
#include "paratrain/tensor_parallel/regions.hpp"
#include "paratrain/tensor_parallel/vocab_parallel_embedding.hpp"

namespace paratrain::tensor_parallel {

/// drop(tokens' embeddings + positions' embeddings): the tokens through a
/// VocabParallelEmbedding(vocabulary, hidden), the positions a [positions, hidden] table
/// whole on every rank (drawn as torch::nn::Embedding(positions, hidden) draws it), built in
/// that order, then the dropout. Under sequence parallelism each rank adds the positions of
/// its sequence shard, and their table's gradient is summed over the group (Note [Regions]).
class EmbeddingsImpl : public torch::nn::Module {
 public:
  EmbeddingsImpl(std::int64_t vocabulary, std::int64_t positions, std::int64_t hidden, double dropout = 0.0,
                 std::optional<Context> context = std::nullopt)
      : context_(context_for("tp::Embeddings", context)) {
    tokens = register_module("tokens", VocabParallelEmbedding(vocabulary, hidden, context_));
    position = register_parameter("position", embedding_weight_slice(positions, hidden, 0, positions));
    drop = register_module("drop", Dropout(dropout));
  }

  /// `ids` [batch, sequence] → [batch, sequence, hidden] (this rank's sequence shard under
  /// sequence parallelism).
  at::Tensor forward(const at::Tensor& ids) {
    if (ids.size(1) > position.size(0))
      throw error("tp::Embeddings", context_.group.world_rank(),
                  "a sequence of " + std::to_string(ids.size(1)) + " tokens, and the table has " +
                      std::to_string(position.size(0)) + " positions");
    auto e = tokens(ids);
    const auto s = e.size(sequence_dim);
    if (!context_.sequence_parallel) return drop(e + position.narrow(0, 0, s));
    const auto& g = context_.group;
    const auto where = Placement{.dim = sequence_dim, .offset = g.rank() * s, .whole = s * g.size()};
    return drop(e + copy_to_region(position, g).narrow(0, where.offset, s), where);
  }

  /// forward(), for `ids` [batch, n] at the given `positions` [n] of their sequences (under
  /// context parallelism, this rank's: cp::positions) → [batch, n, hidden]. Without sequence
  /// parallelism. (Not an overload of forward: a module holder calls a forward of one kind.)
  /// The dropout's masks are keyed by the n places given here, not by the positions: train
  /// with dropout 0 to compare context degrees (Note [Keyed dropout]).
  at::Tensor at_positions(const at::Tensor& ids, const at::Tensor& positions) {
    if (context_.sequence_parallel)
      throw error("tp::Embeddings", context_.group.world_rank(),
                  "positions given under sequence parallelism: the sequence is cut over the tensor group already");
    if (positions.dim() != 1 || positions.size(0) != ids.size(1))
      throw error("tp::Embeddings", context_.group.world_rank(),
                  "positions of shape " + std::to_string(positions.dim() == 1 ? positions.size(0) : -1) + " for " +
                      std::to_string(ids.size(1)) + " tokens a sequence; give one position a token, 1-D");
    // Under context parallelism the whole sequence's length first, alike on every rank: each
    // context rank holds other positions, and one whose own are in range would go on into
    // attention's exchanges while another threw.
    if (const auto cp = context_.context.size(); cp > 1 && ids.size(1) * cp > position.size(0))
      throw error("tp::Embeddings", context_.group.world_rank(),
                  "sequences of " + std::to_string(ids.size(1) * cp) + " positions (" + std::to_string(ids.size(1)) +
                      " on each of " + std::to_string(cp) + " context ranks), and the table has " +
                      std::to_string(position.size(0)) +
                      "; build the embeddings with as many positions as the longest sequence");
    if (positions.numel() > 0) {
      const auto [low, high] = at::aminmax(positions);
      const auto first = low.item<std::int64_t>(), last = high.item<std::int64_t>();
      if (first < 0 || last >= position.size(0))
        throw error("tp::Embeddings", context_.group.world_rank(),
                    "a position of " + std::to_string(first < 0 ? first : last) + ", and the table has " +
                        std::to_string(position.size(0)) + " positions (0.." + std::to_string(position.size(0) - 1) +
                        ")");
    }
    return drop(tokens(ids) + position.index_select(0, positions.to(position.device())));
  }

  VocabParallelEmbedding tokens{nullptr};
  at::Tensor position;
  Dropout drop{nullptr};

 private:
  Context context_;
};
TORCH_MODULE(Embeddings);

}  // namespace paratrain::tensor_parallel
