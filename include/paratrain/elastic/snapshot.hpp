#pragma once
/// \file
/// elastic::detail::save_survivors — the state the survivors of a lost rank hold, saved as a
/// checkpoint over their new group, without the lost rank: Note [A snapshot of the survivors].

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "paratrain/checkpoint/checkpointer.hpp"
#include "paratrain/collectives/gather_strings.hpp"
#include "paratrain/comm/gloo/gloo.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/core/message.hpp"
#include "paratrain/fit/checkpoints.hpp"

namespace paratrain::elastic::detail {

// Note [A snapshot of the survivors]
// When a rank is lost, each survivor still holds its part of the training state, and the
// Trainer's journal says after which step (paratrain::detail::Journal, updated right after
// each step, before any other collective). A rank's state is usable when it is some step's:
// the strategy is settled() (no update was cut short) and the journal has a step. The usable
// ranks may differ by one step (a rank whose all-reduce completed before the peer died
// updated; one whose did not, did not), so the snapshot is of the oldest usable step m, from
// the ranks at m only.
//
// It is an ordinary checkpoint, step-<m> in the fit's checkpoint directory, written over the
// new generation's group: each contributing rank writes every slice it holds
// (checkpoint::detail::collect's `held`, no communication with the old group), a slice held by
// several ranks (DDP's replicas, a hybrid-sharded job's replica groups) by the first of them
// only, and the first rank that recorded step m's position writes the index (a rank a step
// ahead writes the previous entry of its journal, never its own step's: found when a resumed
// run's bytes differed after a rank was stopped mid-exchange). So the loader reshards it to whatever strategy the next
// generation runs, at its world size, as any checkpoint (docs/checkpoints.md), and fit resumes
// from it as from any other: the lost step is computed again. Every tensor of the model must be
// covered whole by the contributors (a ZeRO shard whose every holder was lost is not): where it
// is not, no snapshot is written, and fit resumes from the newest checkpoint on disk.
//
// The state passes through the file system, not the network: on one node that is the page
// cache; across nodes, the checkpoint directory is shared already (the restart path needs it).

/// What save_survivors did: `from` is the step the next generation resumes from.
struct Saved {
  bool snapshot = false;   ///< a checkpoint of the survivors' state was written, or was on disk
  std::int64_t step = -1;  ///< its step; -1 without one
  std::string why_not;     ///< why not, for the report
  bool on_disk = false;    ///< the checkpoint of that step was saved before the loss
};

/// Saves the survivors' state of `old` (the strategy of the lost generation) as the
/// checkpoint of its oldest usable step in `directory`, over `group` (the new generation's).
/// Collective over `group`. Throws paratrain::error on every rank where a write fails.
template <class S>
Saved save_survivors(S& old, comm::Gloo& group, const std::filesystem::path& directory,
                     const paratrain::detail::Journal& journal) {
  namespace ck = paratrain::checkpoint;
  const int rank = group.rank(), ranks = group.size();
  // The oldest step of a usable state: one min all-reduce (a rank without one offers none).
  constexpr auto none = std::numeric_limits<std::int64_t>::max();
  const bool usable = journal.step >= 0 && old.settled();
  auto oldest = at::full({1}, usable ? journal.step : none, at::kLong);
  group.all_reduce(oldest, reduce_op::min);
  const std::int64_t m = oldest.item<std::int64_t>() == none ? -1 : oldest.item<std::int64_t>();
  if (m < 0) return {false, -1, "no survivor's state is that of a step (each was lost mid-update)"};
  const bool contributes = usable && journal.step == m;

  // A checkpoint of step m on disk already (saved just before the loss) is the same state.
  auto on_disk = at::zeros({1}, at::kLong);
  if (rank == 0 && ck::latest(directory) == ck::path_of(directory, m)) on_disk[0] = 1;
  group.all_reduce(on_disk, reduce_op::max);
  if (on_disk.item<std::int64_t>() != 0) return {true, m, "", true};

  // What each contributor holds; the first holder of a slice writes it.
  const auto layout = old.checkpoint_layout();
  std::vector<ck::detail::Entry> entries;
  if (contributes) {
    for (auto& e : ck::detail::collect(old, layout, /*copy=*/false, /*held=*/true))
      if (!e.key.starts_with("rng/")) entries.push_back(std::move(e));
  }
  const auto describe = [](const ck::detail::Entry& e) {
    std::int64_t total = 1;
    for (const auto d : e.shape) total *= d;
    return e.key + '\t' + std::to_string(e.begin) + '\t' + std::to_string(e.data.numel()) + '\t' + std::to_string(total);
  };
  std::vector<std::string> mine;
  for (const auto& e : entries) mine.push_back(describe(e));
  const auto all = paratrain::detail::all_gather_strings(group, mine);
  std::set<std::string> earlier;  // held by a rank before this one
  for (int r = 0; r < rank; ++r) earlier.insert(all[static_cast<std::size_t>(r)].begin(), all[static_cast<std::size_t>(r)].end());
  std::vector<ck::detail::Entry> written;
  for (auto& e : entries)
    if (!earlier.count(describe(e))) written.push_back(std::move(e));

  // Coverage: every model tensor whole, and every tensor any rank wrote whole.
  std::map<std::string, std::pair<std::int64_t, std::vector<std::pair<std::int64_t, std::int64_t>>>> held;
  for (const auto& of_rank : all)
    for (const auto& d : of_rank) {
      const auto a = d.find('\t'), b = d.find('\t', a + 1), c = d.find('\t', b + 1);
      auto& h = held[d.substr(0, a)];
      h.first = std::stoll(d.substr(c + 1));
      h.second.emplace_back(std::stoll(d.substr(a + 1, b - a - 1)), std::stoll(d.substr(b + 1, c - b - 1)));
    }
  std::string gap;
  for (const auto& sl : layout.model) {
    std::int64_t total = 1;
    for (const auto d : sl.shape) total *= d;
    if (total > 0 && !held.count(ck::detail::model_key(sl.name))) gap = "'" + sl.name + "' is held by no survivor";
  }
  for (auto& [key, h] : held) {
    auto& runs = h.second;
    std::sort(runs.begin(), runs.end());
    std::int64_t covered = 0;
    for (const auto& [begin, n] : runs)
      if (begin <= covered) covered = std::max(covered, begin + n);
    if (covered < h.first && gap.empty()) gap = "part of '" + key + "' was held by the lost rank(s) only";
  }
  auto missing = at::full({1}, gap.empty() ? 0 : 1, at::kLong);
  group.all_reduce(missing, reduce_op::max);
  if (missing.item<std::int64_t>() != 0)
    return {false, -1, gap.empty() ? std::string("a tensor was held by the lost rank(s) only") : gap};

  // This rank's random generator, under its new rank (checkpoint::load gives rank r rank r's).
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    auto state = generator.get_state();
    written.push_back({ck::detail::rng_key(rank), {state.numel()}, 0, state});
  }

  // Written as Checkpointer::save writes: a partial directory, each rank's files, the index.
  const auto partial = directory / ck::detail::partial_name(m);
  std::string err;
  if (rank == 0) try {
      ck::detail::remove_tree(partial);  // Note [No recursive std::filesystem]
      std::filesystem::create_directories(partial);
    } catch (const std::exception& e) {
      err = "cannot create " + partial.string() + ": " + paratrain::detail::message_of(e);
    }
  const auto agree = [&](const std::string& what) {
    auto failed = at::full({1}, err.empty() ? 0 : 1, at::kLong);
    group.all_reduce(failed, reduce_op::max);
    if (failed.item<std::int64_t>() == 0) return;
    throw error("elastic::fit", rank, what + ": " + (err.empty() ? std::string("failed on another rank") : err));
  };
  agree("saving the survivors' state");
  // Step m's position, from the first rank that recorded it (a rank a step ahead still holds
  // it as its journal's previous entry); each rank's own entry of step m where it has one.
  const auto* extra = journal.extra_at(m);
  auto writer = at::full({1}, extra != nullptr ? rank : ranks, at::kLong);
  group.all_reduce(writer, reduce_op::min);
  const auto* rank_extra = journal.rank_extra_at(m);
  auto sizes = at::zeros({ranks, 4}, at::kLong);
  try {
    const auto w = ck::detail::write_rank(partial, rank, ranks, m, written, ck::detail::groups_of(old.optimizer(), layout),
                                          rank_extra != nullptr ? *rank_extra : journal.rank_extra);
    sizes[rank][0] = static_cast<std::int64_t>(w.meta_crc32c);
    sizes[rank][1] = w.meta_bytes;
    sizes[rank][2] = w.data_bytes;
  } catch (const std::exception& e) {
    err = paratrain::detail::message_of(e);
  }
  agree("saving the survivors' state");
  group.all_reduce(sizes, reduce_op::sum);
  if (rank == writer.item<std::int64_t>()) try {
      ck::detail::write_index(partial, ck::path_of(directory, m), m, sizes,
                              std::string(paratrain::schema_of<ck::detail::optimizer_t<S>>::name),
                              ck::detail::group_options(old.optimizer()), *extra);
    } catch (const std::exception& e) {
      err = paratrain::detail::message_of(e);
    }
  agree("publishing the survivors' state");
  return {true, m, ""};
}

}  // namespace paratrain::elastic::detail
