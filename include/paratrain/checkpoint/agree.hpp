#pragma once
/// \file
/// The collective pieces of checkpointing: errors every rank reports (detail/agree.hpp),
/// and the model's names over the ranks.

#include <set>
#include <string>
#include <vector>

#include "paratrain/concepts/checkpointable.hpp"
#include "paratrain/detail/agree.hpp"
#include "paratrain/detail/gather_strings.hpp"

namespace paratrain::checkpoint::detail {

using paratrain::detail::agree;
using paratrain::detail::message_of;
using paratrain::detail::raise_everywhere;

/// The names of the model's tensors over all ranks: this rank's when the layout is whole,
/// else the union of every rank's (collective then, over `group`).
template <class Group>
std::set<std::string> model_names(Group& group, const CheckpointLayout& layout) {
  std::vector<std::string> mine;
  for (const auto& sl : layout.model) mine.push_back(sl.name);
  if (layout.whole) return {mine.begin(), mine.end()};
  std::set<std::string> all;
  for (const auto& of_rank : paratrain::detail::all_gather_strings(group, mine)) all.insert(of_rank.begin(), of_rank.end());
  return all;
}

}  // namespace paratrain::checkpoint::detail
