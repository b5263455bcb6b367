#pragma once
/// \file
/// The argument checks every sampler shares.

#include <cstdint>
#include <string>

#include "paratrain/core/error.hpp"

namespace paratrain::detail {

/// Throws paratrain::error (operation `sampler`) unless num_replicas >= 1,
/// 0 <= rank < num_replicas and dataset_size >= 0, with a message that names the field.
inline void check_shard(const char* sampler, std::int64_t dataset_size, std::int64_t num_replicas,
                        std::int64_t rank) {
  const int rank_for_error = rank >= 0 && rank < num_replicas ? static_cast<int>(rank) : -1;
  auto fail = [&](const std::string& message) { throw error(sampler, rank_for_error, message); };
  if (num_replicas < 1)
    fail("num_replicas is " + std::to_string(num_replicas) +
         "; set Options::num_replicas to the number of processes (the world size), at least 1");
  if (rank < 0 || rank >= num_replicas)
    fail("rank is " + std::to_string(rank) + "; set Options::rank to this process's rank, in [0, " +
         std::to_string(num_replicas - 1) + "]");
  if (dataset_size < 0)
    fail("dataset_size is " + std::to_string(dataset_size) + "; pass the number of samples in the dataset, 0 or more");
}

}  // namespace paratrain::detail
