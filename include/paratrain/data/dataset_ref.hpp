#pragma once
/// \file
/// paratrain::data::DatasetRef — any dataset, by reference, where a type cannot be a template.

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>

#include "paratrain/concepts/dataset.hpp"
#include "paratrain/core/batch.hpp"

namespace paratrain::data {

/// A non-owning reference to any paratrain::dataset, or to none: what FitOptions::eval
/// holds, so that `.eval = &test` takes a TensorDataset, an Hdf5Dataset or a user's own.
/// The dataset must outlive the reference. A DatasetRef models dataset itself.
class DatasetRef {
 public:
  DatasetRef() = default;
  DatasetRef(std::nullptr_t) noexcept {}  // NOLINT: `.eval = nullptr` reads as "none"
  template <dataset D>
  DatasetRef(const D* d) noexcept  // NOLINT: implicit, as a pointer converts
      : object_(d),
        size_([](const void* o) { return static_cast<std::int64_t>(static_cast<const D*>(o)->size()); }),
        get_([](const void* o, const at::Tensor& i) { return static_cast<const D*>(o)->get(i); }) {}

  /// Whether it refers to a dataset.
  explicit operator bool() const noexcept { return object_ != nullptr; }
  [[nodiscard]] std::int64_t size() const { return size_(object_); }
  [[nodiscard]] Batch get(const at::Tensor& indices) const { return get_(object_, indices); }

 private:
  const void* object_ = nullptr;
  std::int64_t (*size_)(const void*) = nullptr;
  Batch (*get_)(const void*, const at::Tensor&) = nullptr;
};

}  // namespace paratrain::data
