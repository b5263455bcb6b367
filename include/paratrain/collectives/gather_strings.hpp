#pragma once
/// \file
/// Every rank's strings, on every rank, through a group's sum all-reduce only.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "paratrain/core/reduce_op.hpp"
#include "paratrain/util/group_size.hpp"

namespace paratrain::detail {

/// out[r] is rank r's `mine`. Collective over `group` (a strategy or a communicator):
/// one max all-reduce agrees on the table's size, then each rank writes its strings
/// into its own rows of a zeroed [ranks x count x length] table and one sum all-reduce
/// gives every row to every rank. Strings must not contain '\0'.
template <class Group>
std::vector<std::vector<std::string>> all_gather_strings(Group& group, const std::vector<std::string>& mine) {
  const int ranks = group_size(group), rank = group.rank();
  std::int64_t longest = 0;
  for (const auto& s : mine) longest = std::max<std::int64_t>(longest, static_cast<std::int64_t>(s.size()));
  auto shape = at::tensor({static_cast<std::int64_t>(mine.size()), longest}, at::kLong);
  group.all_reduce(shape, reduce_op::max);
  const auto count = shape[0].item<std::int64_t>(), length = shape[1].item<std::int64_t>() + 1;
  std::vector<std::vector<std::string>> out(static_cast<std::size_t>(ranks));
  if (count == 0) return out;
  // Row r*count + i holds rank r's string i, plus one: an empty string and a missing one differ.
  auto table = at::zeros({ranks, count, length}, at::kInt);
  auto* t = table.data_ptr<std::int32_t>();
  for (std::size_t i = 0; i < mine.size(); ++i) {
    auto* row = t + (rank * count + static_cast<std::int64_t>(i)) * length;
    row[0] = 1;
    for (std::size_t c = 0; c < mine[i].size(); ++c) row[c + 1] = static_cast<unsigned char>(mine[i][c]);
  }
  group.all_reduce(table, reduce_op::sum);
  for (std::int64_t r = 0; r < ranks; ++r)
    for (std::int64_t i = 0; i < count; ++i) {
      const auto* row = t + (r * count + i) * length;
      if (row[0] == 0) continue;
      std::string s;
      for (std::int64_t c = 1; c < length && row[c] != 0; ++c) s += static_cast<char>(row[c]);
      out[static_cast<std::size_t>(r)].push_back(std::move(s));
    }
  return out;
}

}  // namespace paratrain::detail
