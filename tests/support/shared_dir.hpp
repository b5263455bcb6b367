#pragma once
// A fresh scratch directory that every rank names alike, unique to this run.
#include <unistd.h>
#include <torch/torch.h>

#include <filesystem>
#include <string>

#include "paratrain/comm/mpi/mpi.hpp"

namespace paratrain_test {

/// temp/paratrain-<what>-<rank 0's pid>, emptied by rank 0; collective over `c`.
inline std::filesystem::path shared_dir(paratrain::comm::Mpi& c, const std::string& what) {
  namespace fs = std::filesystem;
  auto id = torch::full({1}, c.rank() == 0 ? static_cast<std::int64_t>(::getpid()) : 0, torch::kLong);
  c.all_reduce(id, paratrain::reduce_op::sum);
  const auto dir = fs::temp_directory_path() / ("paratrain-" + what + "-" + std::to_string(id.item<std::int64_t>()));
  if (c.rank() == 0) {
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  c.barrier();
  return dir;
}

/// Removes a shared_dir once every rank is done with it; collective over `c`.
inline void remove_shared_dir(paratrain::comm::Mpi& c, const std::filesystem::path& dir) {
  c.barrier();
  if (c.rank() == 0) std::filesystem::remove_all(dir);
}

}  // namespace paratrain_test
