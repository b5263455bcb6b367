#pragma once
/// \file
/// Errors that every rank reports: what failed on one rank is thrown on all of them, so
/// that no rank waits for another in a collective it will never reach.

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "paratrain/core/reduce_op.hpp"
#include "paratrain/collectives/gather_strings.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/core/message.hpp"

namespace paratrain::detail {

/// Collective over `group`, for when some rank is known to have failed (`local_error`
/// is empty on the others): throws paratrain::error on every rank with the first
/// failing rank's message.
template <class Group>
[[noreturn]] void raise_everywhere(Group& group, const char* operation, const std::string& local_error) {
  const auto errors = all_gather_strings(
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

}  // namespace paratrain::detail
