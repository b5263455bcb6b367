#pragma once
/// \file
/// What ZeRO's store keeps of each bucket of parameters (a flat buffer and this rank's shard
/// of it), and the timer of its waits: shared by the store and its unit gathers.
// IWYU pragma: private, include "paratrain/strategy/stores/sharded_parameters.hpp"

#include <ATen/core/Tensor.h>

#include <chrono>

namespace paratrain::detail {

/// One bucket of parameters under ZeRO (Note [Shard layout]).
struct FlatShard {
  at::Tensor full;   ///< the whole bucket, padded; stage 3 units: storage only while gathered
  at::Tensor shard;  ///< this rank's part: a view of `full` when resident, else its own storage
  bool resident = true;
  at::Tensor compute;  ///< stage 3 with gathers in the compute type: the bucket in that type
};

/// Adds the seconds of its lifetime to `total`: the time a wait blocked.
class Waiting {
 public:
  explicit Waiting(double& total) : total_(total) {}
  Waiting(const Waiting&) = delete;
  Waiting& operator=(const Waiting&) = delete;
  ~Waiting() { total_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }

 private:
  double& total_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace paratrain::detail
