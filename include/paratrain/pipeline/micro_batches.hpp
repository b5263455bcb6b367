#pragma once
/// \file
/// The check that begins every pipeline step: the ranks of one replica were given the same
/// micro-batches, each one usable (Note [Same micro-batches]).

#include <ATen/ATen.h>

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
// sizes and bad 1 when a micro-batch is malformed (detail::batch_problem), and the lowest
// value elsewhere. A replica whose ranks disagree, or a malformed micro-batch anywhere,
// makes every rank throw; replicas may differ from each other (the last, short batch; join).

/// Note [Same micro-batches]: throws on every rank of `world` when a replica's ranks were
/// given different micro-batches, or one a micro-batch it cannot use; this rank trains
/// replica `replica` of `replicas`. Collective over `world`.
template <class Comm>
void check_same_micro_batches(Comm& world, std::span<const Batch> micro, int replica, int replicas,
                              const at::Device& device) {
  std::string problem;  // first: Batch::size() itself throws on a scalar input
  for (std::size_t i = 0; i < micro.size() && problem.empty(); ++i)
    if (auto p = paratrain::detail::batch_problem(micro[i]); !p.empty())
      problem = "micro-batch " + std::to_string(i) + ": " + p;
  paratrain::detail::Fnv1a sizes;
  if (problem.empty())
    for (const auto& b : micro) sizes.mix(static_cast<std::uint64_t>(b.size()));
  const auto m = static_cast<std::int64_t>(micro.size()), hash = sizes.value62();
  auto t = at::full({replicas, 5}, std::numeric_limits<std::int64_t>::min(), at::kLong);
  t[replica].copy_(at::tensor({m, -m, hash, -hash, problem.empty() ? 0L : 1L}, at::kLong));
  paratrain::detail::all_reduce_on(world, t, device, reduce_op::max);
  const auto* v = t.data_ptr<std::int64_t>();
  if (!problem.empty()) throw error("Pipeline::step", world.rank(), problem);
  for (int r = 0; r < replicas; ++r)
    if (v[5 * r + 4] > 0)
      throw error("Pipeline::step", world.rank(),
                  "a rank of pipeline replica " + std::to_string(r) +
                      " was given a micro-batch it cannot use (see its message)");
  for (int r = 0; r < replicas; ++r, v += 5)
    if (v[0] != -v[1] || v[2] != -v[3])
      throw error("Pipeline::step", world.rank(),
                  "the ranks of pipeline replica " + std::to_string(r) + " were given different micro-batches (" +
                      (v[0] != -v[1] ? "from " + std::to_string(-v[1]) + " to " + std::to_string(v[0]) + " of them"
                                     : std::string("as many, of different sizes")) +
                      "): every stage of one replica runs on the same micro-batches (fit gives them so; Note "
                      "[Same micro-batches])");
}

}  // namespace paratrain::pipeline::detail
