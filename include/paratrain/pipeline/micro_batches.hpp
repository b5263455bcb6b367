#pragma once
/// \file
/// The check that begins every pipeline step: the ranks of one replica were given the same
/// micro-batches, each one usable (Note [Same micro-batches]).

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <span>
#include <string>

#include "paratrain/collectives/all_reduce_on.hpp"
#include "paratrain/core/batch.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/util/fnv1a.hpp"

namespace paratrain::pipeline::detail {

// Note [Same micro-batches]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// The ranks of one replica run one schedule on one set of micro-batches: given different
// counts they would run different schedules whose messages never match (a hang until the
// watchdog's timeout), and given different sizes the last stage's loss would fail on one
// rank only. So each step begins with one MAX all-reduce over the world of 5 numbers per
// replica: each rank fills its replica's (count, -count, h, -h, bad), h a hash of the
// sizes (under context parallelism of every input's and the targets' whole shape too: the
// replica's context ranks cut the same sequences; detail::mix_micro_batch) and bad 1 when a
// micro-batch is malformed (detail::batch_problem), and the lowest
// value elsewhere. A replica whose ranks disagree, or a malformed micro-batch anywhere,
// makes every rank throw; replicas may differ from each other (the last, short batch; join),
// except under expert parallelism: each stage's mixtures of experts exchange tokens with the
// same stage of the other replicas of their expert group (`expert` consecutive replicas: the
// expert dimension is the innermost data one) in every forward and backward, so those replicas
// need as many micro-batches, none of them empty (a sixth number, minus the smallest size);
// a group whose every replica has none (join) runs no forward, and exchanges nothing.

/// Note [Same micro-batches]: throws on every rank of `world` when a replica's ranks were
/// given different micro-batches, or one a micro-batch it cannot use; this rank trains
/// replica `replica` of `replicas`. Collective over `world`.
template <class Comm>
void check_same_micro_batches(Comm& world, std::span<const Batch> micro, int replica, int replicas,
                              const at::Device& device, int expert = 1, bool context = false) {
  std::string problem;  // first: Batch::size() itself throws on a scalar input
  for (std::size_t i = 0; i < micro.size() && problem.empty(); ++i)
    if (auto p = paratrain::detail::batch_problem(micro[i]); !p.empty())
      problem = "micro-batch " + std::to_string(i) + ": " + p;
  paratrain::detail::Fnv1a sizes;
  if (problem.empty())
    for (const auto& b : micro) paratrain::detail::mix_micro_batch(sizes, b, /*shapes=*/context);
  const auto m = static_cast<std::int64_t>(micro.size()), hash = sizes.value62();
  std::int64_t smallest = 0;  // an empty step counts as an empty micro-batch
  if (problem.empty() && m > 0) {
    smallest = micro.front().size();
    for (const auto& b : micro) smallest = std::min(smallest, b.size());
  }
  constexpr int n = 6;
  auto t = at::full({replicas, n}, std::numeric_limits<std::int64_t>::min(), at::kLong);
  t[replica].copy_(at::tensor({m, -m, hash, -hash, problem.empty() ? 0L : 1L, -smallest}, at::kLong));
  paratrain::detail::all_reduce_on(world, t, device, reduce_op::max);
  const auto* v = t.data_ptr<std::int64_t>();
  if (!problem.empty()) throw error("Pipeline::step", world.rank(), problem);
  for (int r = 0; r < replicas; ++r)
    if (v[n * r + 4] > 0)
      throw error("Pipeline::step", world.rank(),
                  "a rank of pipeline replica " + std::to_string(r) +
                      " was given a micro-batch it cannot use (see its message)");
  for (int r = 0; r < replicas; ++r)
    if (const auto* w = v + n * r; w[0] != -w[1] || w[2] != -w[3])
      throw error("Pipeline::step", world.rank(),
                  "the ranks of pipeline replica " + std::to_string(r) + " were given different micro-batches (" +
                      (v[n * r] != -v[n * r + 1]
                           ? "from " + std::to_string(-v[n * r + 1]) + " to " + std::to_string(v[n * r]) + " of them"
                           : std::string(context ? "as many, of different sizes or shapes"
                                                 : "as many, of different sizes")) +
                      "): every stage of one replica runs on the same micro-batches (fit gives them so; Note "
                      "[Same micro-batches])");
  if (expert <= 1) return;
  for (int first = 0; first < replicas; first += expert) {
    std::int64_t least = std::numeric_limits<std::int64_t>::max(), most = 0;
    std::int64_t smallest_micro = least;  // of the group's micro-batches
    for (int r = first; r < first + expert; ++r) {
      least = std::min(least, v[n * r]), most = std::max(most, v[n * r]);
      smallest_micro = std::min(smallest_micro, -v[n * r + 5]);
    }
    const auto group = "the expert group of pipeline replicas " + std::to_string(first) + " to " +
                       std::to_string(first + expert - 1);
    if (least != most)
      throw error("Pipeline::step", world.rank(),
                  group + " was given from " + std::to_string(least) + " to " + std::to_string(most) +
                      " micro-batches; under expert parallelism each stage exchanges tokens with the same stage of the "
                      "group's other replicas in every forward and backward: give them as many (Note [Same "
                      "micro-batches])");
    if (least > 0 && smallest_micro == 0)  // a group that runs no forward at all (every replica joined) exchanges nothing
      throw error("Pipeline::step", world.rank(),
                  group +
                      " has an empty micro-batch; under expert parallelism every replica of an expert group routes "
                      "tokens to the others' experts in every forward: give each of them samples in every micro-batch "
                      "(a DistributedSampler with drop_last does)");
  }
}

}  // namespace paratrain::pipeline::detail
