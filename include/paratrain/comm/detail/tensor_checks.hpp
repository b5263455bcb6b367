#pragma once
/// \file
/// Argument checks shared by every communicator, so that code which runs on
/// comm::SingleDevice fails the same way on comm::Mpi instead of later, on a cluster.

#include <ATen/core/Tensor.h>

#include <string>

#include "paratrain/core/reduce_op.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain::detail {

[[nodiscard]] inline bool is_supported_dtype(at::ScalarType t) noexcept {
  switch (t) {
    case at::kFloat: case at::kDouble: case at::kBFloat16: case at::kHalf: case at::kInt: case at::kLong:
      return true;
    default:
      return false;
  }
}

/// A buffer a collective may read or write: defined, contiguous, of a supported dtype.
inline void check_buffer(const char* op, int rank, const at::Tensor& t, const char* name = "tensor") {
  if (!t.defined()) throw error(op, rank, std::string(name) + " is undefined; pass an allocated tensor");
  if (!t.is_contiguous())
    throw error(op, rank,
                std::string(name) +
                    " is not contiguous; communicate `auto c = t.contiguous();` and copy the result back with "
                    "`t.copy_(c)`");
  if (!is_supported_dtype(t.scalar_type()))
    throw error(op, rank,
                std::string(name) + " has dtype " + std::string(c10::toString(t.scalar_type())) +
                    "; supported are float32, float64, bfloat16, float16, int32 and int64");
}

/// A buffer that will be reduced with `r`.
inline void check_reduction(const char* op, int rank, const at::Tensor& t, reduce_op r, const char* name = "tensor") {
  check_buffer(op, rank, t, name);
  if (r == reduce_op::average && !at::isFloatingType(t.scalar_type()))
    throw error(op, rank,
                "average of an integer tensor (" + std::string(c10::toString(t.scalar_type())) +
                    ") would truncate; reduce with reduce_op::sum and divide, or convert to float first");
}

/// `in` and `out` of a scatter or gather: same dtype, and `out` `factor` times larger
/// (or smaller, for reduce_scatter) than `in`.
inline void check_pair(const char* op, int rank, const at::Tensor& in, const at::Tensor& out, std::int64_t in_numel,
                       std::int64_t out_numel, const std::string& rule) {
  check_buffer(op, rank, in, "in");
  check_buffer(op, rank, out, "out");
  if (in.scalar_type() != out.scalar_type())
    throw error(op, rank,
                "in is " + std::string(c10::toString(in.scalar_type())) + " but out is " +
                    std::string(c10::toString(out.scalar_type())) + "; give both the same dtype");
  if (in.numel() != in_numel || out.numel() != out_numel)
    throw error(op, rank,
                "in has " + std::to_string(in.numel()) + " elements and out " + std::to_string(out.numel()) + "; " +
                    rule);
}

/// The arguments of a reduce-scatter over `ranks` ranks: `in` divides into `ranks` equal
/// parts (the message says how far to pad), `out` holds one of them.
inline void check_reduce_scatter(int rank, int ranks, const at::Tensor& in, const at::Tensor& out, reduce_op r) {
  check_reduction("reduce_scatter", rank, in, r, "in");
  if (in.numel() % ranks != 0)
    throw error("reduce_scatter", rank,
                "in has " + std::to_string(in.numel()) + " elements, not a multiple of the " + std::to_string(ranks) +
                    " ranks; pad it to " + std::to_string((in.numel() + ranks - 1) / ranks * ranks) + " elements");
  check_pair("reduce_scatter", rank, in, out, in.numel(), in.numel() / ranks,
             "out must have in.numel() / size() elements");
}

/// The arguments of an all-gather over `ranks` ranks: `out` holds `ranks` copies' worth of `in`.
inline void check_all_gather(int rank, int ranks, const at::Tensor& in, const at::Tensor& out) {
  check_pair("all_gather", rank, in, out, in.numel(), in.numel() * ranks, "out must have in.numel() * size() elements");
}

}  // namespace paratrain::detail
