#pragma once
/// \file
/// How fit deals a step's samples: the global batch (FitOptions::global_batch_size, or
/// the one a checkpoint was saved with), cut into each replica's micro-batches.

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>

#include "paratrain/concepts/strategy.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/data/deterministic_sampler.hpp"
#include "paratrain/fit/checkpoints.hpp"
#include "paratrain/fit/options.hpp"

namespace paratrain::detail {

// Note [The global batch]
// A step's samples belong to the job, not to a rank: the global batch is G places of the
// epoch's order, FitOptions::global_batch_size (unset: batch_size x accumulation x
// replicas). A checkpoint records G, and a resume keeps it at any number of replicas: at
// R replicas each takes G / R of a step's places, in `accumulation` micro-batches of at most
// batch_size. DistributedSampler deals place p of the order to replica p mod R, so when R
// divides G a step's G places are the same at every R: a run resumed at another world size
// visits exactly the samples the uninterrupted run would have, step for step, and the loop's
// position (FitPosition::position, global places) and its step count (the learning-rate
// schedule's clock) mean the same. A G that R does not divide cannot be dealt so: fit
// refuses it before the first step, on every rank alike, naming the world sizes that can.
// In deterministic mode (DataParallelOptions::deterministic) a step is one batch cut into
// the strategy's virtual shards: fit deals it with data::DeterministicSampler, which gives
// rank r the samples of its shards (ranks may differ by a few), at any R dividing shards.

/// The world sizes from 1 to 8 that divide `g`, for a message: "1, 2, 3, 4, 6, 8".
inline std::string dividing_world_sizes(std::int64_t g) {
  std::string out;
  for (std::int64_t r = 1; r <= 8; ++r)
    if (g % r == 0) out += (out.empty() ? "" : ", ") + std::to_string(r);
  return out;
}

/// A strategy with a deterministic mode (DataParallelOptions::deterministic).
template <class S>
concept deterministic_strategy = requires(S& s) {
  s.options().deterministic.on();
  s.options().deterministic.shards;
};

/// Whether `s` trains in deterministic mode.
template <strategy S>
bool deterministic_mode(S& s) {
  if constexpr (deterministic_strategy<S>) return s.options().deterministic.on();
  else return false;
}

/// The sampler of fit in deterministic mode: `o`'s global batch over the strategy's shards.
template <strategy S>
  requires deterministic_strategy<S>
data::DeterministicSampler deterministic_sampler(S& s, std::int64_t dataset_size, const FitOptions& o) {
  const auto shard = s.data_shard();
  return data::DeterministicSampler(dataset_size, {.global_batch = o.global_batch_size,
                                                   .shards = s.options().deterministic.shards,
                                                   .num_replicas = shard.count,
                                                   .rank = shard.index,
                                                   .shuffle = o.shuffle,
                                                   .seed = o.seed.value_or(0),
                                                   .drop_last = o.drop_last});
}

/// `o` with global_batch_size set to the run's global batch (Note [The global batch]) and
/// batch_size and accumulation to what each replica takes of it: a step's G / R samples in
/// the fewest micro-batches (at least `accumulation`) of at most batch_size, all of one size.
/// With `sharded` (deterministic mode's DeterministicSampler, which gives each rank its
/// shards' samples in one batch a step) only the global batch is settled: batch_size is the
/// sampler's to say. Throws on every rank alike for a global batch that cannot be dealt, or
/// that differs from the checkpoint's.
template <strategy S>
FitOptions dealt(S& s, FitOptions o, const std::optional<ResumePoint>& from, bool sharded) {
  const auto replicas = static_cast<std::int64_t>(s.data_shard().count);
  const std::int64_t saved = from ? from->position.global_batch : 0;
  if (o.global_batch_size < 0)
    throw error("fit", s.rank(), "global_batch_size must be >= 0 (0: batch_size x accumulation x replicas)");
  if (o.global_batch_size > 0 && saved > 0 && o.global_batch_size != saved)
    throw error("fit", s.rank(),
                "global_batch_size is " + std::to_string(o.global_batch_size) + ", but the checkpoint " +
                    from->path.string() + " was saved with a global batch of " + std::to_string(saved) +
                    "; a resumed run keeps its global batch (leave global_batch_size 0 to take the checkpoint's), "
                    "or start afresh in another directory");
  if (o.batch_size < 1 || o.accumulation < 1) return o;  // the Trainer's check of the options says why
  if (sharded && o.accumulation > 1)
    throw error("fit", s.rank(),
                "accumulation is " + std::to_string(o.accumulation) +
                    "; deterministic mode computes each step's global batch in its virtual shards, one batch a "
                    "step: set global_batch_size instead");
  const bool given = o.global_batch_size > 0 || saved > 0;
  o.global_batch_size = o.global_batch_size > 0 ? o.global_batch_size
                        : saved > 0             ? saved
                                                : o.batch_size * o.accumulation * replicas;
  const auto g = o.global_batch_size;
  if (given && !sharded) {
    if (g % replicas != 0)
      throw error("fit", s.rank(),
                  "the global batch of " + std::to_string(g) + " samples cannot be dealt over " +
                      std::to_string(replicas) +
                      " data-parallel replicas (each takes G / replicas of a step); run at a number of replicas that "
                      "divides it (" + dividing_world_sizes(g) +
                      " up to 8), or choose a global_batch_size that every world size of the job divides (24: 1, 2, "
                      "3, 4, 6, 8)");
    const auto share = g / replicas;
    if (share < o.accumulation)
      throw error("fit", s.rank(),
                  "the global batch of " + std::to_string(g) + " samples gives each of " + std::to_string(replicas) +
                      " replicas " + std::to_string(share) + " per step, fewer than the " +
                      std::to_string(o.accumulation) + " micro-batches a step needs here (FitOptions::accumulation)");
    auto a = static_cast<std::int64_t>(o.accumulation);
    while (share % a != 0 || share / a > o.batch_size) ++a;  // ends: a == share gives micro-batches of 1
    o.accumulation = static_cast<int>(a);
    o.batch_size = share / a;
  }
  if (saved > 0 && from->position.replicas != replicas && s.rank() == 0)
    std::printf("fit: resuming at %lld data-parallel replicas, with the checkpoint's global batch of %lld%s\n",
                static_cast<long long>(replicas), static_cast<long long>(g),
                sharded ? ""
                        : (": " + std::to_string(o.accumulation) + " micro-batch(es) of " +
                           std::to_string(o.batch_size) + " per replica per step")
                              .c_str());
  return o;
}

}  // namespace paratrain::detail
