#pragma once
/// \file
/// elastic::fit — fit that goes on when ranks are lost: the survivors meet again, rebuild the
/// strategy over their new group and continue from the state they hold, without a restart.

#include <ATen/CPUGeneratorImpl.h>

#include <chrono>
#include <concepts>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#include "paratrain/checkpoint/load.hpp"
#include "paratrain/comm/gloo/gloo.hpp"
#include "paratrain/concepts/checkpointable.hpp"
#include "paratrain/concepts/strategy.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/data/distributed_sampler.hpp"
#include "paratrain/elastic/membership.hpp"
#include "paratrain/elastic/snapshot.hpp"
#include "paratrain/fit/fit.hpp"

namespace paratrain::elastic {

/// A strategy whose state survivors can save (Note [A snapshot of the survivors]): it says
/// whether its state is some step's, and checkpoints reshard into it. DataParallel at every
/// ZeRO stage, hybrid sharding and tensor parallelism included.
template <class S>
concept recoverable = checkpointable<S> && step_counted_strategy<S> && requires(const S& s) {
  { s.settled() } -> std::convertible_to<bool>;
};

/// What elastic::fit ends with: fit's result, and the last generation's strategy (over its
/// group, which lives as long as it does), trained.
template <class S>
struct Trained {
  FitResult result;
  std::unique_ptr<S> strategy;
};

namespace detail {

inline void say(int rank, const std::string& line) {
  std::fprintf(stderr, "paratrain: elastic: rank %d: %s\n", rank, line.c_str());
  std::fflush(stderr);
}

}  // namespace detail

/// Trains as paratrain::fit does, on a strategy that `make(group)` builds over a comm::Gloo
/// group, and survives lost ranks without a restart: when a rank dies or stops answering,
/// every survivor's collective throws paratrain::peer_lost within moments (Note [Recoverable
/// groups]); the survivors meet as the next generation (elastic::Membership, Note
/// [Generations]), save the state they hold as a checkpoint (Note [A snapshot of the
/// survivors]), build the strategy again with `make` over the new group, and fit resumes
/// from it, at the new world size, with the run's global batch: the lost step is computed
/// again, and in deterministic mode the run ends with the bits of one that lost nothing.
/// Where the survivors do not hold the whole state (a ZeRO shard whose every copy was lost),
/// fit resumes from the newest checkpoint on disk instead.
///
/// `options.checkpoint.directory` is required (the survivors' state goes there; periodic
/// checkpoints are the fallback). `make` is called once per generation and may choose the
/// layout by the group's size (a hybrid shard group that divides it). Collective; each rank
/// prints one line per loss on stderr. Errors other than a lost rank end the job as fit's do.
///
/// \code
///   auto make = [](paratrain::comm::Gloo& group) {
///     return Strategy(Net(), group, torch::optim::SGDOptions(0.05), {.deterministic = {.shards = 12}});
///   };
///   auto [result, s] = paratrain::elastic::fit(make, train, {.epochs = 2, .global_batch_size = 48,
///                                      .checkpoint = {.directory = "ckpt", .every_steps = 50}});
///   auto weights = s->full_parameters();
/// \endcode
template <class Make, class D, class Loss = CrossEntropy>
auto fit(Make make, const D& train, const FitOptions& options, Options elastic = {}, Loss loss = {}) {
  using S = std::remove_cvref_t<std::invoke_result_t<Make&, comm::Gloo&>>;
  static_assert(recoverable<S>,
                "paratrain::elastic::fit: make(group) must return a strategy whose state survivors can save "
                "(checkpointable, with step_count() and settled()): DataParallel at any stage; pipelines are "
                "not recoverable in-process (docs/elastic.md: the restart path)");
  Membership members(std::move(elastic));
  const auto& directory = options.checkpoint.directory;
  if (directory.empty())
    throw error("elastic::fit", members.rank(),
                "FitOptions::checkpoint.directory is required: the survivors of a lost rank save their state there, "
                "and periodic checkpoints are what they fall back on");
  // Each generation's model starts as the first did (a fresh start after a loss before the
  // first checkpoint is the run's own start): the random generator as it was before the first.
  auto generator = at::detail::getDefaultCPUGenerator();
  at::Tensor initial;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    initial = generator.get_state();
  }
  for (;;) {
    std::unique_ptr<S> built;
    paratrain::detail::Journal journal;
    journal.waiting = [&members] { return members.waiting(); };
    try {
      {
        std::lock_guard<std::mutex> lock(generator.mutex());
        generator.set_state(initial);
      }
      built.reset(new S(make(members.communicator())));  // in place: strategies do not move
      auto result = paratrain::detail::fit_built<data::DistributedSampler>(*built, train, options, loss, &journal);
      if (result.stopped != paratrain::detail::joining_reason) return Trained<S>{std::move(result), std::move(built)};
      const auto before = members.size();
      const auto joined = members.admit();  // the old group is whole: the strategy ends as any does
      if (members.rank() == 0)
        detail::say(0, "generation " + std::to_string(members.generation()) + ": " + std::to_string(members.size()) +
                           " ranks go on with " + std::to_string(joined) + " joined (" + std::to_string(before) +
                           " before), from the checkpoint of step " + std::to_string(result.steps));
    } catch (const peer_lost& e) {
      const auto before = members.size();
      const auto begin = std::chrono::steady_clock::now();
      detail::say(members.rank(), std::string("a rank is lost (") + e.what() + "); meeting the survivors");
      members.regroup();
      const auto saved = built ? elastic::detail::save_survivors(*built, members.communicator(), directory, journal)
                               : elastic::detail::Saved{false, -1, "the strategy was not built yet"};
      if (members.rank() == 0) {
        const auto seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
        detail::say(0, "generation " + std::to_string(members.generation()) + ": " + std::to_string(members.size()) +
                           " of " + std::to_string(before) + " ranks go on, " +
                           (saved.snapshot ? "from the survivors' state at step " + std::to_string(saved.step) +
                                                 (saved.on_disk ? ", its checkpoint saved before the loss" : "")
                                           : "from the newest checkpoint on disk (" + saved.why_not + ")") +
                           " (met and saved in " + std::to_string(seconds).substr(0, 4) + " s)");
      }
    }
  }
}

}  // namespace paratrain::elastic
