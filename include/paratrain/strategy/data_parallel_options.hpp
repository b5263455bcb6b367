#pragma once
/// \file
/// paratrain::DataParallelOptions — how DataParallel buckets, overlaps and synchronises,
/// and the mesh its options spell (Note [Process mesh]).

#include <torch/nn/pimpl.h>

#include <concepts>
#include <cstddef>
#include <string>
#include <type_traits>

#include "paratrain/comm/mesh.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/strategy/deterministic.hpp"
#include "paratrain/strategy/memory_check.hpp"
#include "paratrain/strategy/precision.hpp"
#include "paratrain/strategy/stores/sharded_construction.hpp"

namespace paratrain {

/// What a step does when an averaged gradient holds NaN or Inf (DataParallelOptions).
enum class NonFinite {
  apply,  ///< nothing: the optimizer applies it, as PyTorch does
  skip,   ///< every rank skips the optimizer step alike (StepResult::skipped), as AMP's scaler does
  stop,   ///< every rank throws paratrain::error naming the step and the parameter
};

/// How DataParallel buckets, overlaps and synchronises; the defaults are PyTorch DDP's.
struct DataParallelOptions {
  /// Gradients are all-reduced in buckets of about this size (the first one smaller,
  /// so that communication starts early in backward). Note [Bucket order].
  std::size_t bucket_cap_bytes = std::size_t{25} << 20;
  std::size_t first_bucket_cap_bytes = std::size_t{1} << 20;
  /// Allow parameters that receive no gradient in a step (a branch not taken, a frozen
  /// head). Off, such a parameter is an error that names it, on every rank.
  bool find_unused_parameters = false;
  /// Copy rank 0's buffers (batch-norm running statistics, ...) to every rank before
  /// each step, as PyTorch does, so that all replicas evaluate alike.
  bool broadcast_buffers = true;
  /// Let ranks with fewer batches keep matching the others' collectives (`join`)
  /// instead of hanging them. Off, differing batch counts are an error on every rank.
  bool join = true;
  /// Clip the gradients so that their global 2-norm is at most this before each
  /// optimizer step, exactly as torch::nn::utils::clip_grad_norm_ on the whole model
  /// (also when sharded); 0: off. StepResult::grad_norm reports the norm before clipping.
  double max_grad_norm = 0;
  /// NaN or Inf in the averaged gradients: apply, skip the step, or stop. Checking (skip,
  /// stop) reads every gradient once, and needs one 2-element all-reduce per step where the
  /// gradients are sharded (ZeRO 2, 3) or split into pipeline stages: the one clipping
  /// makes there, when max_grad_norm is set too.
  NonFinite nonfinite_gradients = NonFinite::apply;
  /// Mixed precision: forward under autocast (bf16), gradients summed in bf16; the
  /// parameters and the optimizer's state stay fp32. Note [Mixed precision].
  Precision precision{};
  /// ZeRO: shard over groups of this many consecutive ranks and replicate across the
  /// world size / shard_group groups (hybrid sharding: FSDP2's HSDP, ZeRO++'s hpZ), so that
  /// the sharding traffic stays inside a group; it must divide the world size. 0: shard
  /// over every rank. Note [Hybrid sharding].
  int shard_group = 0;
  /// ZeRO-3: how many units are gathered ahead of the one computing, in forward and in
  /// backward (FSDP's limit_all_gathers with a depth): more hides more of the gathers'
  /// time behind compute, and holds that many more units whole (Note [Pooled transients]).
  int prefetch = 1;
  /// Where and in which type a model the strategy builds (the constructors that take a
  /// build function) is placed, unit by unit at ZeRO stage 3: Note [Sharded construction].
  /// A model built already must be there (or these be unset).
  BuildOptions build{};
  /// Check at construction that paratrain::plan::peak fits the memory this process may
  /// still use (Note [Checking the plan]); off by default.
  MemoryCheck memory{};
  /// The same bits at every world size and stage: each global batch cut into this many
  /// virtual shards, their gradients summed in shard order (Note [Deterministic training]).
  /// Off by default; `{.shards = 12}` covers 1-4 ranks.
  Deterministic deterministic{};
  /// Tensor parallelism: the model's tensor-parallel layers (paratrain::tp) cut their
  /// matrices over groups of this many consecutive ranks, and the data dimensions take the
  /// world size / tensor_parallel ranks that remain (the mesh's tensor dimension: Note
  /// [Process mesh]). The strategy builds the model in a tp::Construction over that group
  /// (Note [Building a tensor-parallel model]). 1: off.
  int tensor_parallel = 1;
  /// With tensor_parallel: the activations between the tensor-parallel regions are cut
  /// along the sequence (Korthikanti et al. 2022): layer norms and dropouts on 1/t of the
  /// tokens, all-gathers and reduce-scatters instead of all-reduces (Note [Regions]).
  bool sequence_parallel = false;
  /// Context parallelism: the model's sequences are cut over groups of this many ranks (the
  /// mesh's context dimension, inside the data ones: Note [Process mesh]), which see the same
  /// samples and average their gradients with the data ranks; ZeRO shards over them too. The
  /// strategy builds the model in a tp::Construction whose Context::context is that group,
  /// for its attention (cp::attention). 1: off.
  int context_parallel = 1;
  /// Expert parallelism: the experts of the model's moe::MixtureOfExperts layers are cut over
  /// groups of this many ranks (the mesh's expert dimension, inside the context one: Note
  /// [Process mesh]), which see different samples and route their tokens to each other's
  /// experts. The strategy builds the model in a tp::Construction whose Context::expert is
  /// that group (tp::expert_group()); dense parameters are averaged over data × expert ranks,
  /// experts over the data ranks that hold them (Note [Experts over a group]). 1: off.
  int expert_parallel = 1;
};

/// A function that builds a `Model` (not a model itself: a module holder is callable too,
/// so that is ruled out first). Note [Sharded construction].
template <class F, class Model>
concept model_builder = !std::is_base_of_v<torch::detail::ModuleHolderIndicator, std::remove_cvref_t<F>> &&
                        std::invocable<F&> && std::same_as<std::invoke_result_t<F&>, Model>;

/// The data dimensions `shard_group` spells over `data_ranks` data-parallel ranks (Note
/// [Process mesh]): {replicate data_ranks / G, shard G}, or every rank in the shard
/// dimension for 0. Throws, the same on every rank, for a group that does not divide them.
[[nodiscard]] inline MeshShape data_mesh(int shard_group, int data_ranks, int rank) {
  if (data_ranks < 1)
    throw error("DataParallel", rank, "no data-parallel ranks remain (" + std::to_string(data_ranks) + ")");
  if (shard_group < 0 || (shard_group > 0 && data_ranks % shard_group != 0))
    throw error("DataParallel", rank,
                "DataParallelOptions::shard_group is " + std::to_string(shard_group) + " but the world has " +
                    std::to_string(data_ranks) +
                    " ranks; ZeRO shards over groups of shard_group ranks and replicates across them, so it must "
                    "divide the world size (0: shard over every rank)");
  const int g = shard_group > 0 ? shard_group : data_ranks;
  return {.replicate = data_ranks / g, .shard = g};
}

/// The mesh DataParallelOptions spell over `ranks` ranks: the data dimensions of
/// data_mesh() over what the tensor, expert and context dimensions (tensor_parallel,
/// expert_parallel, context_parallel) leave. Throws, the same on every rank, where a degree
/// does not divide the world.
[[nodiscard]] inline MeshShape options_mesh(int shard_group, int tensor_parallel, int context_parallel,
                                            int expert_parallel, int ranks, int rank) {
  if (tensor_parallel < 1 || ranks % tensor_parallel != 0)
    throw error("DataParallel", rank,
                "DataParallelOptions::tensor_parallel is " + std::to_string(tensor_parallel) + " but the world has " +
                    std::to_string(ranks) + " ranks; the tensor degree must be at least 1 and divide the world size");
  if (context_parallel < 1 || (ranks / tensor_parallel) % context_parallel != 0)
    throw error("DataParallel", rank,
                "DataParallelOptions::context_parallel is " + std::to_string(context_parallel) + " but " +
                    std::to_string(ranks / tensor_parallel) +
                    " ranks remain beside the tensor dimension; the context degree must be at least 1 and divide them");
  const int left = ranks / tensor_parallel / context_parallel;
  if (expert_parallel < 1 || left % expert_parallel != 0)
    throw error("DataParallel", rank,
                "DataParallelOptions::expert_parallel is " + std::to_string(expert_parallel) + " but " +
                    std::to_string(left) +
                    " ranks remain beside the tensor and context dimensions; the expert degree must be at least 1 "
                    "and divide them");
  auto shape = data_mesh(shard_group, left / expert_parallel, rank);
  shape.tensor = tensor_parallel;
  shape.context = context_parallel;
  shape.expert = expert_parallel;
  return shape;
}

}  // namespace paratrain
