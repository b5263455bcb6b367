#pragma once
/// \file
/// Argument checks shared by every communicator, so that code which runs on
/// comm::SingleDevice fails the same way on comm::Mpi instead of later, on a cluster.

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <span>
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
  if (!t.defined()) fail_with(op, rank, [&] { return std::string(name) + " is undefined; pass an allocated tensor"; });
  if (!t.is_contiguous())
    fail_with(op, rank, [&] {
      return std::string(name) +
             " is not contiguous; communicate `auto c = t.contiguous();` and copy the result back with `t.copy_(c)`";
    });
  if (!is_supported_dtype(t.scalar_type()))
    fail_with(op, rank, [&] {
      return std::string(name) + " has dtype " + std::string(c10::toString(t.scalar_type())) +
             "; supported are float32, float64, bfloat16, float16, int32 and int64";
    });
}

/// A buffer that will be reduced with `r`.
inline void check_reduction(const char* op, int rank, const at::Tensor& t, reduce_op r, const char* name = "tensor") {
  check_buffer(op, rank, t, name);
  if (r == reduce_op::average && !at::isFloatingType(t.scalar_type()))
    throw error(op, rank,
                "average of an integer tensor (" + std::string(c10::toString(t.scalar_type())) +
                    ") would truncate; reduce with reduce_op::sum and divide, or convert to float first");
}

/// `in` and `out` of an exchange: buffers of the same dtype.
inline void check_in_out(const char* op, int rank, const at::Tensor& in, const at::Tensor& out) {
  check_buffer(op, rank, in, "in");
  check_buffer(op, rank, out, "out");
  if (in.scalar_type() != out.scalar_type())
    fail_with(op, rank, [&] {
      return "in is " + std::string(c10::toString(in.scalar_type())) + " but out is " +
             std::string(c10::toString(out.scalar_type())) + "; give both the same dtype";
    });
}

/// `in` and `out` of a scatter or gather: same dtype, and `out` `factor` times larger
/// (or smaller, for reduce_scatter) than `in`.
inline void check_pair(const char* op, int rank, const at::Tensor& in, const at::Tensor& out, std::int64_t in_numel,
                       std::int64_t out_numel, const char* rule) {
  check_in_out(op, rank, in, out);
  if (in.numel() != in_numel || out.numel() != out_numel)
    fail_with(op, rank, [&] {
      return "in has " + std::to_string(in.numel()) + " elements and out " + std::to_string(out.numel()) + "; " + rule;
    });
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

/// Where an all-to-all's parts lie: part i of `in` (in_count(i) elements, after those of
/// ranks 0..i-1) goes to rank i, part i of `out` comes from rank i. A view of the caller's
/// counts (empty in the equal form, where every part has `part` elements) and of what the
/// call reads of its tensors, read once: made per call, in place, so that it allocates and
/// copies nothing (Note [Stores in the preamble]).
struct AllToAllLayout {
  std::span<const std::int64_t> in_counts, out_counts;
  std::int64_t part = 0;
  void* in_data = nullptr;  // in's and out's first elements (data_ptr() is two calls into c10 each)
  void* out_data = nullptr;
  at::ScalarType dtype = at::kFloat;
  [[nodiscard]] bool equal() const noexcept { return in_counts.empty(); }
  [[nodiscard]] std::int64_t in_count(std::size_t i) const noexcept { return equal() ? part : in_counts[i]; }
  [[nodiscard]] std::int64_t out_count(std::size_t i) const noexcept { return equal() ? part : out_counts[i]; }
};

// One side's counts, once the pass over both found something wrong: what, said.
[[gnu::cold, gnu::noinline]] inline void check_counts(int rank, std::span<const std::int64_t> counts,
                                                       std::int64_t numel, std::size_t ranks, const char* name) {
  const char* op = "all_to_all";
  if (counts.size() != ranks)
    fail_with(op, rank, [&] {
      return std::string(name) + "_counts has " + std::to_string(counts.size()) + " entries; give one per rank (" +
             std::to_string(ranks) + ")";
    });
  std::int64_t sum = 0;
  for (std::size_t i = 0; i < ranks; ++i) {
    if (counts[i] < 0)
      fail_with(op, rank, [&] {
        return std::string(name) + "_counts[" + std::to_string(i) + "] is " + std::to_string(counts[i]) +
               "; counts are elements, >= 0";
      });
    if (counts[i] > numel)  // before the sum, which it could overflow
      fail_with(op, rank, [&] {
        return std::string(name) + "_counts[" + std::to_string(i) + "] is " + std::to_string(counts[i]) +
               ", more than the " + std::to_string(numel) + " elements of " + name;
      });
    sum += counts[i];
  }
  if (sum != numel)
    fail_with(op, rank, [&] {
      return std::string(name) + "_counts sum to " + std::to_string(sum) + " elements but " + name + " has " +
             std::to_string(numel) + "; the parts must cover the tensor exactly";
    });
}

/// The arguments of an all-to-all over `ranks` ranks, checked where this rank can check
/// them (what every rank must agree on, that rank i sends rank j what rank j expects, is
/// checked across ranks under validation: Skeleton::begin_all_to_all), and their layout.
/// No counts: `in` cut into `ranks` equal parts, `out` as large as `in`. Counts: one per
/// rank, each side's summing to its tensor's elements. Neither side may hold more than
/// `max_elements` (a transport's limit, MPI's int counts).
// Every fact of a tensor is read before the first call into c10 (data_ptr()), after which
// it would be read again; the messages capture by value (Note [Stores in the preamble]).
// The spans by reference: passed by value they went on the stack as two 8-byte stores and
// came back as one 16-byte load, which waits for both (a store-forwarding stall, ~3 ns a
// call, docs/benchmarks.md).
inline AllToAllLayout check_all_to_all(int rank, int ranks, const at::Tensor& in,
                                       const std::span<const std::int64_t>& in_counts, const at::Tensor& out,
                                       const std::span<const std::int64_t>& out_counts,
                                       std::int64_t max_elements = INT64_MAX) {
  const char* op = "all_to_all";
  check_in_out(op, rank, in, out);  // its sizes are checked below, against each other and the counts
  const auto dtype = in.scalar_type();
  const auto in_numel = in.numel(), out_numel = out.numel();
  const auto bytes = static_cast<std::int64_t>(in.element_size());
  if (std::max(in_numel, out_numel) > max_elements) [[unlikely]]
    fail_with(op, rank, [=] {
      const bool in_too = in_numel > max_elements;
      return std::string(in_too ? "in" : "out") + " has " + std::to_string(in_too ? in_numel : out_numel) +
             " elements; this communicator's counts and displacements stop at " + std::to_string(max_elements) +
             ", so split it";
    });
  const auto n = static_cast<std::size_t>(ranks);
  std::int64_t part = 0;
  const bool equal = in_counts.empty() && out_counts.empty();
  if (equal) {
    if (in_numel % ranks != 0)
      fail_with(op, rank, [=] {
        return "in has " + std::to_string(in_numel) + " elements, not a multiple of the " + std::to_string(ranks) +
               " ranks; pad it, or pass each rank's count (the uneven form: all_to_all(in, in_counts, out, "
               "out_counts))";
      });
    if (out_numel != in_numel)
      fail_with(op, rank, [=] {
        return "in has " + std::to_string(in_numel) + " elements and out " + std::to_string(out_numel) +
               "; out must have as many as in (size() equal parts each)";
      });
    part = in_numel / ranks;
  } else {
    // One pass over both sides, loads only; what is wrong, found again by check_counts.
    // Each count within its tensor (unsigned: >= 0 too), so that the sums cannot overflow.
    const auto within = [](std::int64_t count, std::int64_t numel) {
      return static_cast<std::uint64_t>(count) <= static_cast<std::uint64_t>(numel);
    };
    bool ok = in_counts.size() == n && out_counts.size() == n;
    std::int64_t sent = 0, received = 0;
    for (std::size_t i = 0; ok && i < n; ++i) {
      ok = within(in_counts[i], in_numel) && within(out_counts[i], out_numel);
      if (ok) sent += in_counts[i], received += out_counts[i];
    }
    if (!ok || sent != in_numel || received != out_numel) [[unlikely]] {
      check_counts(rank, in_counts, in_numel, n, "in");
      check_counts(rank, out_counts, out_numel, n, "out");
      fail_with(op, rank, [] { return std::string("the counts do not cover the tensors"); });  // not reached
    }
  }
  auto* const in_data = in.data_ptr();
  auto* const out_data = out.data_ptr();
  const auto* a = static_cast<const char*>(in_data);
  const auto* b = static_cast<const char*>(out_data);
  if (in_numel > 0 && out_numel > 0 && a < b + out_numel * bytes && b < a + in_numel * bytes)
    fail_with(op, rank, [] {
      return "in and out overlap; an all-to-all reads every part of in while it writes out: pass two separate tensors";
    });
  // each field written once, in the caller's frame
  if (equal) return {{}, {}, part, in_data, out_data, dtype};
  return {in_counts, out_counts, 0, in_data, out_data, dtype};
}

}  // namespace paratrain::detail
