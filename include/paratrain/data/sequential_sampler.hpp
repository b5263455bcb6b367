#pragma once
/// \file
/// paratrain::data::SequentialSampler — each replica reads one contiguous block, in order.

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "paratrain/data/sampler_options.hpp"
#include "paratrain/data/detail/shard_checks.hpp"

namespace paratrain::data {

/// Splits the indices 0..dataset_size-1 into `num_replicas` contiguous blocks, in order,
/// as `numpy.array_split` does: the first dataset_size % num_replicas replicas get one
/// index more. With drop_last every replica gets dataset_size / num_replicas of them
/// and the last dataset_size % num_replicas indices are left out.
///
/// No shuffling, whatever SamplerOptions::shuffle says, and every epoch alike: for data
/// already in random order on disk, where reading a file front to back is what makes it
/// fast (an HDF5 or .npy file read in long runs, data::Hdf5Dataset's pread path). With
/// PyTorch's sequential order (DistributedSampler with shuffle off) a replica's samples
/// are N apart instead.
///
/// \code
/// auto result = paratrain::fit<paratrain::data::SequentialSampler>(strategy, train, options);
/// \endcode
class SequentialSampler {
 public:
  using Options = SamplerOptions;

  /// Throws paratrain::error if dataset_size < 0, num_replicas < 1, or rank lies
  /// outside [0, num_replicas).
  SequentialSampler(std::int64_t dataset_size, Options options) : options_(options) {
    detail::check_shard("SequentialSampler", dataset_size, options.num_replicas, options.rank);
    const auto n = dataset_size, replicas = options.num_replicas, r = options.rank;
    const auto base = n / replicas, extra = options.drop_last ? 0 : n % replicas;
    begin_ = r * base + std::min(r, extra);
    end_ = begin_ + base + (r < extra ? 1 : 0);
    dataset_size_ = dataset_size;
  }

  /// Does nothing: the blocks do not depend on the epoch.
  void set_epoch(std::int64_t /*epoch*/) noexcept {}

  /// This replica's block: begin(), begin() + 1, ... < end().
  [[nodiscard]] std::vector<std::int64_t> indices() const {
    std::vector<std::int64_t> mine(static_cast<std::size_t>(end_ - begin_));
    std::iota(mine.begin(), mine.end(), begin_);
    return mine;
  }
  [[nodiscard]] std::int64_t size() const noexcept { return end_ - begin_; }
  [[nodiscard]] std::int64_t begin() const noexcept { return begin_; }
  [[nodiscard]] std::int64_t end() const noexcept { return end_; }
  [[nodiscard]] std::int64_t dataset_size() const noexcept { return dataset_size_; }
  [[nodiscard]] const Options& options() const noexcept { return options_; }

 private:
  Options options_;
  std::int64_t dataset_size_ = 0;
  std::int64_t begin_ = 0;
  std::int64_t end_ = 0;
};

}  // namespace paratrain::data
