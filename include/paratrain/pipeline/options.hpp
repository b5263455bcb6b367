#pragma once
/// \file
/// PipelineOptions and PipelineStepStats — how a pipeline runs and what its last step did —
/// and the pipeline ranks its options give (Note [Pipeline layout]).

#include <array>
#include <string>

#include "paratrain/core/error.hpp"
#include "paratrain/pipeline/link.hpp"
#include "paratrain/pipeline/schedule.hpp"
#include "paratrain/strategy/data_parallel_options.hpp"

namespace paratrain {

/// How a pipeline runs: its schedule, and how its stages' replicas synchronise.
struct PipelineOptions {
  /// GPipe, 1F1B (the default: at most K micro-batches' activations per rank),
  /// interleaved 1F1B, or ZB-H1 (docs/pipeline.md).
  pipeline::Kind schedule = pipeline::Kind::one_f_one_b;
  /// Stages per rank, v: with v > 1 (interleaved 1F1B) rank r owns stages r, r + K,
  /// r + 2K, ... where K = stages / v is the number of pipeline ranks.
  int virtual_stages = 1;
  /// For the replicas of each stage (bucketing, broadcast_buffers, join).
  DataParallelOptions data_parallel{};
  /// At ZeRO stage 3, each stage's replicas keep only their shard of each Unit from the
  /// moment it is built, so no rank holds its stage whole (Note [Sharded construction]),
  /// placed as data_parallel.build says; every replica must then draw the same initial
  /// values (checked), and a stage maker must not touch a unit's parameters after building
  /// it (ending with `.to(data_parallel.build's dtype or device)` is fine).
  bool sharded_construction = false;
};

/// What the last step's schedule did on this rank (for measuring the bubble).
struct PipelineStepStats {
  double span_seconds = 0;  ///< from the schedule's start to its last action's end, waits included
  int peak_stashed = 0;     ///< the most micro-batches whose activations were kept at once
  /// Seconds spent in each kind of action (pipeline::Op order: forward, backward,
  /// backward_input, backward_weight) and how many ran: the costs the schedule's
  /// theory (pipeline::theoretical_bubble, simulate) takes.
  std::array<double, 4> seconds{};
  std::array<int, 4> count{};
  /// Seconds computing forward and backward passes, all kinds together.
  [[nodiscard]] double busy_seconds() const { return seconds[0] + seconds[1] + seconds[2] + seconds[3]; }
};

// Note [Pipeline layout]
// A world of W ranks trains a pipeline of S stages with v stages per rank on K = S / v
// pipeline ranks, replicated R = W / K times: the mesh {pipeline K, data R} (Note [Process
// mesh]), the pipeline its outermost dimension, so that a stage's replicas are consecutive
// ranks (one node) and only activations cross between stages. Each replica trains on its
// own shard of the data (data_shard); each stage's R copies average their gradients as
// DataParallel does, over the mesh's data group (ReplicaSteps: Note [Steps of replicas]),
// so Sharded (ZeRO 1-3) shards a stage over its replicas, and hybrid sharding splits them
// as shard_group says. The pipeline ranks of one replica pass activations forward and
// gradients backward.
// With a tensor degree t and a context degree c (data_parallel.tensor_parallel,
// context_parallel), R = W / (K t c): each of a replica's t c pipelines runs every stage on
// its slice of the layers and its positions of the replica's sequences, passing activations
// to the next stage's rank of the same tensor and context coordinates (the pipeline group);
// a stage's gradients are summed over its replicas and its context group together
// (Dims::replicas()), its samples counted once per context group, as DataParallel does.
// With an expert degree e (data_parallel.expert_parallel), the expert dimension is a data
// one: R = W / (K t c e) counts the replicas of one expert coordinate, and each of the e
// replicas of an expert group trains on its own samples. A stage's mixtures of experts cut
// their experts over the expert group: the same stage of the group's replicas, which route
// tokens to each other in every forward and backward, and so run the same schedule on as many
// micro-batches (Note [Same micro-batches]). Their gradients are summed as DataParallel's
// (Note [Experts over a group]); their auxiliary losses join backward in whichever stage they
// are (Note [Auxiliary loss in backward]).

namespace pipeline::detail {

/// K, the pipeline ranks of `S` stages over `world`; or the error, the same on every rank,
/// when the stages do not fit, or the options do not go together (`gathers_in_forward`:
/// the update is ZeRO-3's).
template <class Comm>
int pipeline_ranks(int S, const Comm& world, const PipelineOptions& options, bool gathers_in_forward) {
  const int v = options.virtual_stages, W = world.size();
  if (v < 1 || S % v != 0)
    throw error("Pipeline", world.rank(),
                std::to_string(S) + " stages cannot be dealt out " + std::to_string(v) +
                    " to a rank; set PipelineOptions::virtual_stages to a divisor of the stage count");
  if (v > 1 && options.schedule != pipeline::Kind::interleaved_1f1b)
    throw error("Pipeline", world.rank(),
                "virtual_stages > 1 needs the interleaved 1F1B schedule (PipelineOptions::schedule)");
  if (v > 1 && unbuffered_sends<Comm>())
    throw error("Pipeline", world.rank(),
                "the interleaved 1F1B schedule sends activations around a ring, which a communicator whose sends "
                "wait for their receives (comm::Nccl: Note [NCCL point-to-point]) cannot order without deadlock; "
                "use GPipe, 1F1B or ZB-H1 over it, or comm::Mpi / comm::Gloo");
  if (options.data_parallel.deterministic.shards != 0)
    throw error("Pipeline", world.rank(),
                "deterministic mode (PipelineOptions::data_parallel.deterministic) is for DataParallel: a pipeline "
                "adds each stage's gradients over its micro-batches in its schedule's order, which it does not tie "
                "to virtual shards (docs/deterministic.md)");
  if (options.schedule == pipeline::Kind::zero_bubble_h1 && gathers_in_forward)
    throw error("Pipeline", world.rank(),
                "ZB-H1 computes a stage's weight gradients after ZeRO-3 has freed its gathered parameters; use "
                "1F1B or GPipe with zero::stage3, or ZB-H1 with stages 0-2");
  const int K = S / v;
  if (W % K != 0)
    throw error("Pipeline", world.rank(),
                "a pipeline of " + std::to_string(S) + " stages, " + std::to_string(v) + " per rank, runs on " +
                    std::to_string(K) + " ranks (or a multiple of it, for replicas); this run has " +
                    std::to_string(W) + " ranks: launch a multiple of " + std::to_string(K) +
                    " or change the stage count");
  return K;
}

}  // namespace pipeline::detail
}  // namespace paratrain
