#pragma once
/// \file
/// Errors that every rank reports: what failed on one rank is thrown on all of them.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <set>
#include <string>
#include <vector>

#include "paratrain/concepts/checkpointable.hpp"

#include "paratrain/comm/reduce_op.hpp"
#include "paratrain/detail/gather_strings.hpp"
#include "paratrain/error.hpp"

namespace paratrain::checkpoint::detail {

/// An exception's message; LibTorch's without the C++ backtrace it carries.
inline std::string message_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

/// Collective over `group`, for when some rank is known to have failed (`local_error`
/// is empty on the others): throws paratrain::error on every rank with the first
/// failing rank's message.
template <class Group>
[[noreturn]] void raise_everywhere(Group& group, const char* operation, const std::string& local_error) {
  const auto errors = paratrain::detail::all_gather_strings(
      group, local_error.empty() ? std::vector<std::string>{} : std::vector<std::string>{local_error});
  for (std::size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty())
      throw error(operation, group.rank(),
                  (static_cast<int>(r) == group.rank() ? "" : "rank " + std::to_string(r) + " failed: ") +
                      errors[r].front());
  throw error(operation, group.rank(), "a rank failed without saying why");
}

/// Collective over `group`: returns when no rank has an error, else throws
/// paratrain::error on every rank with the first failing rank's message. A rank that
/// fails must still call this (catch, then agree), or the others would wait for it.
template <class Group>
void agree(Group& group, const char* operation, const std::string& local_error) {
  auto failed = at::full({1}, local_error.empty() ? 0 : 1, at::kLong);
  group.all_reduce(failed, reduce_op::sum);
  if (failed.item<std::int64_t>() != 0) raise_everywhere(group, operation, local_error);
}

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
