#pragma once
/// \file
/// The bytes of a tensor's elements; 0 for an undefined tensor.

#include <ATen/core/Tensor.h>

#include <cstddef>

namespace paratrain::detail {

inline std::size_t bytes_of(const at::Tensor& t) { return t.defined() ? t.nbytes() : 0; }

}  // namespace paratrain::detail
