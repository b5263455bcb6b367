#pragma once
/// \file
/// What fit settles before its first step: the options' defaults that depend on the
/// strategy (the seed, a pipeline's micro-batches), and that every rank was given the same
/// training data.

#include <ATen/ATen.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

#include "paratrain/collectives/agree.hpp"
#include "paratrain/comm/mesh.hpp"
#include "paratrain/concepts/strategy.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/core/process.hpp"
#include "paratrain/core/reduce_op.hpp"
#include "paratrain/fit/options.hpp"
#include "paratrain/util/fnv1a.hpp"

namespace paratrain::detail {

// Note [fit's defaults]
// - FitOptions::seed unset: paratrain::seed(), the seed paratrain::main gave every rank, so
//   that one number drives the initial weights and the sample order.
// - FitOptions::accumulation 0: one micro-batch per step, but for a pipeline of K ranks 2K
//   (rank 0 says so once): with one micro-batch a pipeline runs one stage at a time, and
//   2K keeps the bubble of 1F1B at (K - 1) / (3K - 1) of the step, under a third, and is a
//   multiple of K as interleaved 1F1B needs.
// - FitOptions::global_batch_size unset: batch_size x accumulation x replicas, unless a
//   checkpoint resumed from says otherwise (Note [The global batch]).

/// The pipeline ranks of `s`'s mesh; 1 for a strategy without one.
template <strategy S>
int pipeline_ranks_of(S& s) {
  if constexpr (requires { s.mesh().size(Dim::pipeline); }) return s.mesh().size(Dim::pipeline);
  else return 1;
}

/// `options` with the defaults that depend on `s` filled in (Note [fit's defaults]).
/// Out-of-range values (a negative accumulation)
/// are left as given, for the Trainer's one check of the options.
template <strategy S>
FitOptions resolved(S& s, const FitOptions& options) {
  FitOptions o = options;
  if (!o.seed) o.seed = paratrain::seed();
  if (o.accumulation == 0) {
    const int K = pipeline_ranks_of(s);
    o.accumulation = K > 1 ? 2 * K : 1;
    if (K > 1 && s.rank() == 0)
      std::printf("fit: a pipeline of %d ranks: %d micro-batches of %lld per step (FitOptions::accumulation; "
                  "0 means 2K for a pipeline)\n",
                  K, o.accumulation, static_cast<long long>(o.batch_size));
  }
  return o;
}

/// A fingerprint of `train`: its size and a hash of its first and last samples' tensors.
template <class D>
std::int64_t data_fingerprint(const D& train) {
  Fnv1a h;
  const auto n = static_cast<std::int64_t>(train.size());
  h.mix(static_cast<std::uint64_t>(n));
  if (n > 0) {
    const auto batch = train.get(at::tensor({std::int64_t{0}, n - 1}, at::kLong));
    const auto mix = [&h](const at::Tensor& t) {
      if (!t.defined()) return;
      const auto c = t.to(at::kCPU).contiguous();
      h.mix(static_cast<std::uint64_t>(c.scalar_type()));
      for (const auto d : c.sizes()) h.mix(static_cast<std::uint64_t>(d));
      h.mix(std::string_view(static_cast<const char*>(c.data_ptr()), c.nbytes()));
    };
    for (const auto& x : batch.inputs) mix(x);
    mix(batch.target);
  }
  return h.value62();
}

/// Collective: throws on every rank where the ranks were given different training data
/// (Note [Same data on every rank]).
template <strategy S, class D>
void check_same_data(S& s, const D& train) {
  // Note [Same data on every rank]
  // fit deals the samples of one data set out across the ranks (DistributedSampler), so every
  // rank must hold the same set: a rank that loaded another file, or generated its "data"
  // with another seed, trains on samples the others do not have, and nothing else would say
  // so. Its size and a hash of its first and last samples are compared across the ranks.
  const std::int64_t mine = data_fingerprint(train);
  const auto size = static_cast<std::int64_t>(train.size());
  at::Tensor range = at::tensor({mine, -mine, size, -size}, at::kLong);
  s.all_reduce(range, reduce_op::max);
  const auto* r = range.data_ptr<std::int64_t>();
  const bool same = r[0] == -r[1] && r[2] == -r[3];
  std::string problem;
  if (!same && (mine != r[0] || size != r[2]))
    problem = "this rank's training data (" + std::to_string(size) + " samples, fingerprint " + std::to_string(mine) +
              " of its first and last) differs from another rank's (" + std::to_string(r[2]) + " samples, " +
              std::to_string(r[0]) +
              "); every rank must load the same data set, which fit deals out across the ranks (a random data set "
              "must be drawn from the same seed on every rank: paratrain::main seeds them alike)";
  agree(s, "fit", problem);
}

}  // namespace paratrain::detail
