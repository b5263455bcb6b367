#pragma once
/// \file
/// paratrain::dataset — what fit and data::Loader need from a set of samples.

#include <ATen/core/Tensor.h>

#include <concepts>
#include <cstdint>

#include "paratrain/core/batch.hpp"

namespace paratrain {

/// A set of samples addressed by index: its size, and the batch of the samples at some
/// indices.
///
/// `D` models dataset when, for `const D d` and a 1-D int64 CPU tensor `indices`:
/// - `d.size()` is convertible to std::int64_t: the samples are 0 .. size()-1;
/// - `d.get(indices)` is a paratrain::Batch of those samples, in that order (dimension 0
///   of every input and of the targets), each index in [0, size()); a repeated index
///   gives its sample again. Throw on an index outside, naming it.
///
/// `get` is const and must be safe to call from several threads at once, as the standard
/// library's const members are: data::Loader's workers call it concurrently. A reader that
/// cannot read in parallel locks inside `get` (data::Hdf5Dataset does, for what it cannot
/// read with pread).
///
/// data::TensorDataset (memory), data::IdxDataset (MNIST's IDX files), data::NpyDataset
/// (memory-mapped .npy arrays) and data::Hdf5Dataset (paratrain::hdf5) model it; like
/// `sampler`, the concept is structural.
template <class D>
concept dataset = requires(const D& d, const at::Tensor& indices) {
  { d.size() } -> std::convertible_to<std::int64_t>;
  { d.get(indices) } -> std::same_as<Batch>;
};

}  // namespace paratrain
