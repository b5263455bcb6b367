#pragma once
// Collectives of every communicator, checked against values computed locally from a
// formula: rank r holds f(r, i) and the expected result is the sum/max/min over r.
// The values are small integers, exact in every dtype (bfloat16 included), so the
// comparison is exact whatever order the reduction summed in.
//
// Each check takes the communicator to test, so that one written here runs on every
// communicator (Kokkos-style: the behaviour once, instantiated per backend):
// tests/unit/comm_test.cpp for comm::SingleDevice and comm::Mpi, tests/unit/gloo_test.cpp
// for comm::Gloo. The point-to-point, split, request and validation checks need a
// communicator with those members; the all-to-all checks a communicator with all_to_all.
#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "paratrain/core/reduce_op.hpp"
#include "paratrain/core/error.hpp"
#include "support/doctest.hpp"

namespace collectives {

using paratrain::reduce_op;

inline const std::vector<torch::Dtype> all_dtypes = {torch::kFloat32, torch::kFloat64, torch::kBFloat16,
                                                     torch::kFloat16, torch::kInt32,   torch::kInt64};

// 0, 1, odd, and more than 16 MiB in float32 (and in every wider or narrower dtype, it
// is still more than one segment of comm::Mpi's segmented all-reduce).
inline const std::vector<std::int64_t> sizes = {0, 1, 1001, (16 << 20) / 4 + 7};

// `pattern` repeated to n elements: the formulas below have period 7 in i, so each is
// computed on 7 elements and tiled, one pass over a large buffer instead of four or five
// (the 16 MiB cases took ~2.5 s a run to compute).
inline torch::Tensor tiled(const torch::Tensor& pattern, std::int64_t n) {
  const auto period = pattern.numel();
  return pattern.repeat({(n + period - 1) / period}).narrow(0, 0, n);
}

// f(r, i) = i % 7 + r + 1: at most 7 + 4 = 11, sums over 4 ranks at most 34.
inline torch::Tensor values(int rank, std::int64_t n, torch::Dtype dtype) {
  return tiled((torch::arange(7, torch::kLong) + rank + 1).to(dtype), n);
}

inline torch::Tensor expected(reduce_op op, int size, std::int64_t n, torch::Dtype dtype) {
  auto base = torch::arange(7, torch::kDouble);
  const double ranks = size, rank_sum = size * (size + 1) / 2.0;
  switch (op) {
    case reduce_op::sum: return tiled((base * ranks + rank_sum).to(dtype), n);
    case reduce_op::average: return tiled(((base * ranks + rank_sum) / ranks).to(dtype), n);
    case reduce_op::max: return tiled((base + size).to(dtype), n);
    case reduce_op::min: return tiled((base + 1).to(dtype), n);
  }
  return {};
}

inline std::string describe(reduce_op op, torch::Dtype dtype, std::int64_t n) {
  return std::string(paratrain::to_string(op)) + " " + std::string(c10::toString(dtype)) + " n=" + std::to_string(n);
}

// Where a check puts its buffers: the device given, else the communicator's own GPU where it
// takes device buffers only (comm::Nccl), else the host. comm::Gloo's checks run on the host
// and, in the GPU suite, on the GPU.
template <class C>
at::Device device_for(const C& c, std::optional<at::Device> given) {
  if (given) return *given;
  if constexpr (requires {
                  requires C::device_buffers_only;
                  c.device();
                })
    return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(c.device()));
  else
    return at::kCPU;
}

// Equal elements, compared on the host wherever each lives.
inline bool same(const torch::Tensor& a, const torch::Tensor& b) { return torch::equal(a.cpu(), b.cpu()); }

// The result of a reduction `op` over `c` against the exact formula. Equal, but for an average
// over comm::Nccl: NCCL's average of floating-point buffers multiplies each rank's value by
// 1/size before summing (its premultiplied sum), exact only where size is a power of two,
// so it is compared within a few units in the last place of the dtype (Mpi and Gloo sum, then
// divide once: exact here, the sums being small integers).
template <class C>
bool same_reduction(const C&, reduce_op op, const torch::Tensor& got, const torch::Tensor& want) {
  if constexpr (requires { requires C::device_buffers_only; }) {
    if (op == reduce_op::average) {
      const auto dtype = want.scalar_type();
      const double rtol = dtype == torch::kDouble ? 1e-14 : dtype == torch::kFloat ? 1e-6 : 2e-2;
      const auto g = got.cpu().to(torch::kDouble), w = want.cpu().to(torch::kDouble);
      if (torch::allclose(g, w, rtol, /*atol=*/0)) return true;
      // Where and how far: the first element out of tolerance, and how many are.
      const auto bad = ((g - w).abs() > w.abs() * rtol).logical_or(g.isnan()).nonzero().reshape({-1});
      const auto i = bad.numel() > 0 ? bad[0].item<std::int64_t>() : 0;
      MESSAGE(bad.numel() << " of " << w.numel() << " elements out of tolerance; the first, element " << i
                          << ": got " << g[i].item<double>() << ", want " << w[i].item<double>());
      return false;
    }
  }
  return same(got, want);
}

// ---- every communicator ------------------------------------------------------------

template <class C>
void check_all_reduce(C& c, std::optional<at::Device> device = {}) {
  const auto d = device_for(c, device);
  for (auto dtype : all_dtypes)
    for (auto op : {reduce_op::sum, reduce_op::average, reduce_op::max, reduce_op::min})
      for (auto n : sizes) {
        if (op == reduce_op::average && !torch::isFloatingType(dtype)) continue;
        if (n > 2000 && dtype != torch::kFloat32 && op != reduce_op::sum) continue;  // keep the big case cheap
        CAPTURE(describe(op, dtype, n));
        const auto want = expected(op, c.size(), n, dtype);
        auto blocking = values(c.rank(), n, dtype).to(d);
        c.all_reduce(blocking, op);
        CHECK(same_reduction(c, op, blocking, want));

        auto async = values(c.rank(), n, dtype).to(d);
        auto request = c.iall_reduce(async, op);
        request.wait();
        CHECK(same_reduction(c, op, async, want));
      }
}

template <class C>
void check_broadcast(C& c, std::optional<at::Device> device = {}) {
  const auto d = device_for(c, device);
  const int root = c.size() - 1;
  for (auto dtype : all_dtypes)
    for (auto n : sizes) {
      CAPTURE(describe(reduce_op::sum, dtype, n));
      auto t = (c.rank() == root ? values(root, n, dtype) : torch::zeros({n}, dtype)).to(d);
      c.broadcast(t, root);
      CHECK(same(t, values(root, n, dtype)));
    }
}

template <class C>
void check_reduce_scatter(C& c, std::optional<at::Device> device = {}) {
  const auto d = device_for(c, device);
  for (auto dtype : all_dtypes)
    for (std::int64_t part : {0, 1, 333}) {
      for (auto op : {reduce_op::sum, reduce_op::max}) {
        CAPTURE(describe(op, dtype, part));
        const auto in = values(c.rank(), part * c.size(), dtype).to(d);
        auto out = torch::empty({part}, torch::TensorOptions(dtype).device(d));
        c.reduce_scatter(in, out, op);
        const auto whole = expected(op, c.size(), part * c.size(), dtype);
        CHECK(same(out, whole.slice(0, c.rank() * part, (c.rank() + 1) * part)));
      }
    }
}

template <class C>
void check_all_gather(C& c, std::optional<at::Device> device = {}) {
  const auto d = device_for(c, device);
  for (auto dtype : all_dtypes)
    for (std::int64_t part : {0, 1, 333}) {
      CAPTURE(describe(reduce_op::sum, dtype, part));
      const auto in = (torch::arange(part, torch::kLong) + 100 * c.rank()).to(dtype).to(d);
      auto out = torch::empty({part * c.size()}, torch::TensorOptions(dtype).device(d));
      c.all_gather(in, out);
      std::vector<torch::Tensor> parts;
      for (int r = 0; r < c.size(); ++r) parts.push_back(torch::arange(part, torch::kLong) + 100 * r);
      CHECK(same(out, torch::cat(parts).to(dtype)));
    }
}

// ---- non-blocking and large reduce_scatter / all_gather ------------------------------

// Elements per rank for the non-blocking and in-place checks: empty, one, odd, and, for
// float32 and bfloat16 (a predefined and a user-defined MPI reduction), a part whose
// whole buffer (size() parts) is more than 8 MiB, so that comm::Mpi segments its
// reduce-scatter (Note [Segmented reduce-scatter and all-gather]); that part is odd,
// hence not a multiple of any segment, and not a multiple of 7, so that the formula's
// i % 7 differs between the ranks' parts.
inline std::vector<std::int64_t> part_sizes(int size, torch::Dtype dtype) {
  if (dtype != torch::kFloat32 && dtype != torch::kBFloat16) return {0, 1, 333};
  std::int64_t big = (std::int64_t{9} << 20) / static_cast<std::int64_t>(c10::elementSize(dtype)) / size + 1;
  while (big % 2 == 0 || big % 7 == 0) ++big;
  return {0, 1, 333, big};
}

// What rank r contributes to an all-gather: g(r, i) = (37 i + 101 r) mod 251 - 125,
// integers exact in every dtype, with a prime period so that a part or a segment put
// at the wrong offset shows.
inline torch::Tensor gathered(int rank, std::int64_t n, torch::Dtype dtype) {
  return ((torch::arange(n, torch::kLong) * 37 + 101 * rank).remainder(251) - 125).to(dtype);
}
inline torch::Tensor all_gathered(int size, std::int64_t part, torch::Dtype dtype) {
  std::vector<torch::Tensor> parts;
  for (int r = 0; r < size; ++r) parts.push_back(gathered(r, part, dtype));
  return torch::cat(parts);
}

// Blocking and non-blocking reduce_scatter, `parts` elements per rank (part_sizes by default).
template <class C>
void check_ireduce_scatter(C& c, std::vector<std::int64_t> parts = {}, std::optional<at::Device> device = {}) {
  const auto d = device_for(c, device);
  for (auto dtype : all_dtypes)
    for (auto part : parts.empty() ? part_sizes(c.size(), dtype) : parts)
      for (auto op : {reduce_op::sum, reduce_op::average, reduce_op::max}) {
        if (op == reduce_op::average && !torch::isFloatingType(dtype)) continue;
        if (part > 2000 && op != reduce_op::sum && dtype != torch::kFloat32) continue;  // keep the big case cheap
        CAPTURE(describe(op, dtype, part));
        const auto in = values(c.rank(), part * c.size(), dtype).to(d);
        const auto mine =
            expected(op, c.size(), part * c.size(), dtype).slice(0, c.rank() * part, (c.rank() + 1) * part);

        auto async = torch::full({part}, -1, torch::TensorOptions(dtype).device(d));
        auto request = c.ireduce_scatter(in, async, op);
        request.wait();
        CHECK(same_reduction(c, op, async, mine));

        auto blocking = torch::full({part}, -1, torch::TensorOptions(dtype).device(d));
        c.reduce_scatter(in, blocking, op);
        CHECK(same_reduction(c, op, blocking, mine));
        CHECK(same(in, values(c.rank(), part * c.size(), dtype)));  // `in` is left alone
      }
}

// Blocking and non-blocking all_gather, out of place, `parts` elements per rank.
template <class C>
void check_iall_gather(C& c, std::vector<std::int64_t> parts = {}, std::optional<at::Device> device = {}) {
  const auto d = device_for(c, device);
  for (auto dtype : all_dtypes)
    for (auto part : parts.empty() ? part_sizes(c.size(), dtype) : parts) {
      CAPTURE(describe(reduce_op::sum, dtype, part));
      const auto in = gathered(c.rank(), part, dtype).to(d);
      auto async = torch::full({part * c.size()}, -1, torch::TensorOptions(dtype).device(d));
      auto request = c.iall_gather(in, async);
      while (!request.test()) {
      }
      CHECK(same(async, all_gathered(c.size(), part, dtype)));

      auto blocking = torch::full({part * c.size()}, -1, torch::TensorOptions(dtype).device(d));
      c.all_gather(in, blocking);
      CHECK(same(blocking, all_gathered(c.size(), part, dtype)));
    }
}

// All-gather in place: `in` is part rank() of `out` itself, as when ZeRO gathers a flat
// parameter buffer whose shard this rank updated where it lies.
template <class C>
void check_all_gather_in_place(C& c, std::vector<std::int64_t> parts = {}, std::optional<at::Device> device = {}) {
  const auto d = device_for(c, device);
  for (auto dtype : all_dtypes)
    for (auto part : parts.empty() ? part_sizes(c.size(), dtype) : parts)
      for (bool non_blocking : {false, true}) {
        CAPTURE(describe(reduce_op::sum, dtype, part));
        CAPTURE(non_blocking);
        auto out = torch::full({part * c.size()}, -1, torch::TensorOptions(dtype).device(d));
        auto in = out.narrow(0, c.rank() * part, part);
        in.copy_(gathered(c.rank(), part, dtype));
        if (non_blocking) {
          auto request = c.iall_gather(in, out);
          request.wait();
        } else {
          c.all_gather(in, out);
        }
        CHECK(same(out, all_gathered(c.size(), part, dtype)));
      }
}

// Several non-blocking collectives pending at once, progressed a different number of
// times on each rank, then completed in reverse order.
template <class C>
void check_pending_segments(C& c, std::optional<at::Device> device = {}) {
  const auto d = device_for(c, device);
  const std::int64_t part = 1001;
  const auto on = torch::TensorOptions(torch::kFloat32).device(d);
  const auto in = values(c.rank(), part * c.size(), torch::kFloat32).to(d);
  auto reduced = torch::full({part}, -1.0f, on);
  auto first = c.ireduce_scatter(in, reduced, reduce_op::sum);
  for (int i = 0; i < 3 * c.rank(); ++i) (void)first.test();  // rank r gets further than rank r - 1
  auto gathered_out = torch::full({part * c.size()}, -1.0f, on);
  auto mine = gathered(c.rank(), part, torch::kFloat32).to(d);
  auto second = c.iall_gather(mine, gathered_out);
  if (c.rank() == 0) (void)second.test();
  auto summed = values(c.rank(), 77, torch::kFloat32).to(d);
  c.all_reduce(summed, reduce_op::sum);  // blocking, between them
  auto in_place = torch::full({part * c.size()}, -1.0f, on);
  in_place.narrow(0, c.rank() * part, part).copy_(gathered(c.rank(), part, torch::kFloat32));
  auto third = c.iall_gather(in_place.narrow(0, c.rank() * part, part), in_place);
  third.wait();
  second.wait();
  first.wait();
  CHECK(same(summed, expected(reduce_op::sum, c.size(), 77, torch::kFloat32)));
  CHECK(same(reduced, expected(reduce_op::sum, c.size(), part * c.size(), torch::kFloat32)
                                  .slice(0, c.rank() * part, (c.rank() + 1) * part)));
  CHECK(same(gathered_out, all_gathered(c.size(), part, torch::kFloat32)));
  CHECK(same(in_place, all_gathered(c.size(), part, torch::kFloat32)));
  gathered_out.fill_(-1);
  { auto dropped = c.iall_gather(mine, gathered_out); }  // the destructor finishes every segment
  CHECK(same(gathered_out, all_gathered(c.size(), part, torch::kFloat32)));
}

template <class C>
void check_misuse(C& c, std::optional<at::Device> device = {}) {
  const auto d = device_for(c, device);
  const auto on = torch::TensorOptions().device(d);
  auto matrix = torch::ones({3, 4}, on);
  auto transposed = matrix.t();
  CHECK_THROWS_WITH_AS(c.all_reduce(transposed, reduce_op::sum), doctest::Contains("all_reduce on rank"),
                       paratrain::error);
  CHECK_THROWS_WITH_AS(c.all_reduce(transposed, reduce_op::sum), doctest::Contains(".contiguous()"),
                       paratrain::error);
  auto ints = torch::ones({3}, on.dtype(torch::kInt32));
  CHECK_THROWS_WITH_AS(c.all_reduce(ints, reduce_op::average), doctest::Contains("would truncate"), paratrain::error);
  auto bytes = torch::ones({3}, on.dtype(torch::kUInt8));
  CHECK_THROWS_WITH_AS(c.all_reduce(bytes, reduce_op::sum), doctest::Contains("supported are float32"),
                       paratrain::error);
  auto floats = torch::ones({4}, on);
  auto doubles = torch::ones({4 * c.size()}, on.dtype(torch::kDouble));
  CHECK_THROWS_WITH_AS(c.all_gather(floats, doubles), doctest::Contains("give both the same dtype"),
                       paratrain::error);
  auto small = torch::ones({1}, on);
  CHECK_THROWS_WITH_AS(c.all_gather(floats, small), doctest::Contains("out must have"), paratrain::error);
  CHECK_THROWS_WITH_AS(c.broadcast(floats, c.size()), doctest::Contains("is not in this communicator"),
                       paratrain::error);
}

// ---- communicators of several ranks ------------------------------------------------

template <class C>
void check_reduce_scatter_padding(C& c, std::optional<at::Device> device = {}) {
  const auto d = device_for(c, device);
  if (c.size() == 1) return;  // everything divides by one
  const auto in = torch::ones({c.size() + 1}, torch::TensorOptions().device(d));
  auto out = torch::empty({1}, torch::TensorOptions().device(d));
  CHECK_THROWS_WITH_AS(c.reduce_scatter(in, out, reduce_op::sum),
                       doctest::Contains(("pad it to " + std::to_string(2 * c.size()) + " elements").c_str()), paratrain::error);
}

template <class C>
void check_ring(C& c, std::optional<at::Device> device = {}) {
  const auto d = device_for(c, device);
  const int next = (c.rank() + 1) % c.size(), prev = (c.rank() + c.size() - 1) % c.size();
  for (auto dtype : all_dtypes) {
    CAPTURE(c10::toString(dtype));
    const auto mine = values(c.rank(), 1001, dtype).to(d);
    auto theirs = torch::empty({1001}, torch::TensorOptions(dtype).device(d));
    auto sent = c.isend(mine, next, /*tag=*/7);
    c.recv(theirs, prev, /*tag=*/7);
    sent.wait();
    CHECK(same(theirs, values(prev, 1001, dtype)));
  }
}

template <class C>
void check_wrong_length(C& c, std::optional<at::Device> device = {}) {
  const auto d = device_for(c, device);
  const int next = (c.rank() + 1) % c.size(), prev = (c.rank() + c.size() - 1) % c.size();
  for (std::int64_t n : {4, 16}) {
    CAPTURE(n);
    const auto mine = torch::ones({8}, torch::TensorOptions().device(d));
    auto other = torch::empty({n}, torch::TensorOptions().device(d));
    auto sent = c.isend(mine, next, 3);
    CHECK_THROWS_WITH_AS(c.recv(other, prev, 3), doctest::Contains("sent 32 bytes (tag 3)"), paratrain::error);
    sent.wait();
  }
}

template <class C>
void check_split(C& c, std::optional<at::Device> device = {}) {
  const auto d = device_for(c, device);
  auto half = c.split(c.rank() % 2, c.rank());
  int expected_size = 0, expected_sum = 0;
  for (int r = 0; r < c.size(); ++r)
    if (r % 2 == c.rank() % 2) ++expected_size, expected_sum += r;
  CHECK(half.size() == expected_size);
  CHECK(half.rank() == c.rank() / 2);
  auto t = torch::full({5}, c.rank(), torch::TensorOptions(torch::kLong).device(d));
  half.all_reduce(t, reduce_op::sum);
  CHECK(same(t, torch::full({5}, expected_sum, torch::kLong)));
  CHECK_THROWS_AS((void)c.split(-1), paratrain::error);
}

template <class C>
void check_requests(C& c, std::optional<at::Device> device = {}) {
  const auto d = device_for(c, device);
  auto a = torch::ones({1 << 20}, torch::TensorOptions().device(d));
  auto r = c.iall_reduce(a, reduce_op::sum);
  while (!r.test()) {
  }
  CHECK(r.test());
  CHECK(same(a, torch::full({1 << 20}, float(c.size()))));
  // A request dropped unwaited completes in its destructor: rank r's r + 1 become the sum
  // 1 + ... + size (a sum, so that a request that never ran shows on 2 ranks or more).
  auto b = torch::full({1000}, float(c.rank() + 1), torch::TensorOptions().device(d));
  { auto dropped = c.iall_reduce(b, reduce_op::sum); }
  CHECK(same(b, torch::full({1000}, float(c.size() * (c.size() + 1) / 2))));
}

// `c` must have been made with validation on.
template <class C>
void check_validation(C& c, std::optional<at::Device> device = {}) {
  const auto d = device_for(c, device);
  const auto on = torch::TensorOptions().device(d);
  auto t = torch::ones({c.rank() == 0 ? 3 : 4}, on);
  if (c.size() > 1) {
    CHECK_THROWS_WITH_AS(c.all_reduce(t, reduce_op::sum), doctest::Contains("ranks disagree on the element count"),
                         paratrain::error);
    auto typed = c.rank() == 0 ? torch::ones({4}, on) : torch::ones({4}, on.dtype(torch::kDouble));
    CHECK_THROWS_WITH_AS(c.broadcast(typed, 0), doctest::Contains("ranks disagree on the dtype"), paratrain::error);
  }
  auto agreed = torch::ones({4}, on);
  c.all_reduce(agreed, reduce_op::sum);  // agreement still works, and the ranks are still in step
  CHECK(same(agreed, torch::full({4}, float(c.size()))));
}

// Note [Collective fingerprint]: a fresh communicator whose ranks issue 255 equal all-reduces
// and then, as the 256th, one that differs only in its reduction (so that the transport
// itself completes it, with a wrong result): the fingerprint comparison that comes with the
// 256th throws on every rank, naming collective #256 and what each rank issued.
template <class C>
void check_fingerprint(C& c, std::optional<at::Device> device = {}) {
  const auto d = device_for(c, device);
  auto t = torch::ones({4}, torch::TensorOptions().device(d));
  for (int i = 0; i < 255; ++i) c.all_reduce(t, reduce_op::max);
  if (c.size() == 1) return;
  const auto op = c.rank() == 0 ? reduce_op::sum : reduce_op::max;
  CHECK_THROWS_WITH_AS(c.all_reduce(t, op),
                       doctest::Contains("issued different collectives: the first that differs is #256: all_reduce "
                                         "(Float, 4 elements, sum) on world rank 0; all_reduce (Float, 4 elements, "
                                         "max) on world rank"),
                       paratrain::error);
}

// ---- all-to-all -------------------------------------------------------------------

// What rank r sends rank j, element k: a(r, j, k) = (37 k + 11 r + 3 j) mod 251 - 125,
// integers exact in every dtype, different for every pair, so that a part delivered to
// the wrong rank or put at the wrong offset shows.
inline torch::Tensor routed(int from, int to, std::int64_t n, torch::Dtype dtype) {
  return ((torch::arange(n, torch::kLong) * 37 + 11 * from + 3 * to).remainder(251) - 125).to(dtype);
}

// How many elements rank r sends rank j in the uneven checks: 0 to 2 plus `base`, so that
// some parts are empty where base is 0, and no two neighbouring pairs send alike.
inline std::int64_t routed_count(int from, int to, std::int64_t base) { return (from + 2 * to) % 3 + base; }

// Every rank sends rank j its part j and receives part i from rank i, by the formula: in
// equal parts of 0, 1 and 1001 elements, and in uneven parts (routed_count, some empty),
// blocking and, where the communicator has them, non-blocking, in every dtype.
template <class C>
void check_all_to_all(C& c, std::optional<at::Device> device = {}) {
  const auto on = torch::TensorOptions().device(device_for(c, device));
  const int n = c.size(), me = c.rank();
  for (auto dtype : all_dtypes) {
    for (std::int64_t part : {0, 1, 1001}) {
      std::vector<torch::Tensor> in_parts, out_parts;
      for (int j = 0; j < n; ++j) in_parts.push_back(routed(me, j, part, dtype));
      for (int i = 0; i < n; ++i) out_parts.push_back(routed(i, me, part, dtype));
      const auto in = torch::cat(in_parts).to(on.device()), want = torch::cat(out_parts);
      CAPTURE(describe(reduce_op::sum, dtype, part));
      auto out = torch::full({in.numel()}, 99, on.dtype(dtype));
      c.all_to_all(in, out);
      CHECK(same(out, want));
      if constexpr (requires { c.iall_to_all(in, out); }) {
        out.fill_(99);
        auto r = c.iall_to_all(in, out);
        r.wait();
        CHECK(same(out, want));
      }
    }
    for (std::int64_t base : {0, 1000}) {
      std::vector<std::int64_t> in_counts, out_counts;
      std::vector<torch::Tensor> in_parts, out_parts;
      for (int j = 0; j < n; ++j) {
        in_counts.push_back(routed_count(me, j, base));
        in_parts.push_back(routed(me, j, in_counts.back(), dtype));
      }
      for (int i = 0; i < n; ++i) {
        out_counts.push_back(routed_count(i, me, base));
        out_parts.push_back(routed(i, me, out_counts.back(), dtype));
      }
      const auto in = torch::cat(in_parts).to(on.device()), want = torch::cat(out_parts);
      CAPTURE(describe(reduce_op::sum, dtype, base));
      auto out = torch::full({want.numel()}, 99, on.dtype(dtype));
      c.all_to_all(in, in_counts, out, out_counts);
      CHECK(same(out, want));
      if constexpr (requires { c.iall_to_all(in, in_counts, out, out_counts); }) {
        out.fill_(99);
        auto r = c.iall_to_all(in, in_counts, out, out_counts);
        r.wait();
        CHECK(same(out, want));
      }
    }
  }
  // Counts that change from call to call on one communicator, each call by the formula
  // (comm::Mpi keeps its MPI counts from the last call and rewrites them when they
  // change): only the last rank's sends change, so that every other rank keeps its
  // in_counts and finds its out_counts changed.
  for (int round = 0; round < 4; ++round) {
    const auto count = [&](int from, int to) -> std::int64_t {
      return (from + 2 * to + (from == n - 1 ? round : 0)) % 3 + 1;
    };
    std::vector<std::int64_t> in_counts, out_counts;
    std::vector<torch::Tensor> in_parts, out_parts;
    for (int j = 0; j < n; ++j) {
      in_counts.push_back(count(me, j));
      in_parts.push_back(routed(me, j, in_counts.back(), torch::kFloat));
    }
    for (int i = 0; i < n; ++i) {
      out_counts.push_back(count(i, me));
      out_parts.push_back(routed(i, me, out_counts.back(), torch::kFloat));
    }
    const auto in = torch::cat(in_parts).to(on.device()), want = torch::cat(out_parts);
    CAPTURE(round);
    for (int again = 0; again < 2; ++again) {  // the second call with the same counts
      auto out = torch::full({want.numel()}, 99, on.dtype(torch::kFloat));
      c.all_to_all(in, in_counts, out, out_counts);
      CHECK(same(out, want));
    }
  }
}

// What a rank can find wrong in its own arguments: the same error on every rank, each
// making the same mistake, before anything is exchanged (the ranks stay in step: the last
// exchange still works).
template <class C>
void check_all_to_all_misuse(C& c, std::optional<at::Device> device = {}) {
  const auto on = torch::TensorOptions().device(device_for(c, device));
  const int n = c.size();
  const std::vector<std::int64_t> ones(static_cast<std::size_t>(n), 1), short_list(static_cast<std::size_t>(n + 1), 0);
  auto in = torch::ones({n}, on), out = torch::empty({n}, on);
  auto odd = torch::ones({2 * n + 1}, on), wide = torch::empty({2 * n + 1}, on);
  if (n > 1)
    CHECK_THROWS_WITH_AS(c.all_to_all(odd, wide), doctest::Contains("not a multiple of the"), paratrain::error);
  auto bigger = torch::empty({n + 1}, on);
  CHECK_THROWS_WITH_AS(c.all_to_all(in, bigger), doctest::Contains("out must have as many as in"), paratrain::error);
  CHECK_THROWS_WITH_AS(c.all_to_all(in, short_list, out, ones), doctest::Contains("give one per rank"),
                       paratrain::error);
  auto short_by_one = ones;
  short_by_one[0] = 0;  // each count within out (a larger one is named as such: `huge` below)
  CHECK_THROWS_WITH_AS(c.all_to_all(in, ones, out, short_by_one), doctest::Contains("out_counts sum to"),
                       paratrain::error);
  auto negative = ones;
  negative[0] = -1;  // found before the sum is
  CHECK_THROWS_WITH_AS(c.all_to_all(in, negative, out, ones), doctest::Contains("counts are elements, >= 0"),
                       paratrain::error);
  auto huge = ones;
  huge[0] = INT64_MAX;  // found before the sum, which it would overflow
  CHECK_THROWS_WITH_AS(c.all_to_all(in, huge, out, ones), doctest::Contains("more than the"), paratrain::error);
  CHECK_THROWS_WITH_AS(c.all_to_all(at::Tensor(), out), doctest::Contains("is undefined"), paratrain::error);
  auto doubles = torch::empty({n}, on.dtype(torch::kDouble));
  CHECK_THROWS_WITH_AS(c.all_to_all(in, doubles), doctest::Contains("give both the same dtype"), paratrain::error);
  auto whole = torch::ones({2 * n}, on);
  auto later = whole.narrow(0, n / 2, n);
  CHECK_THROWS_WITH_AS(c.all_to_all(whole.narrow(0, 0, n), later),
                       doctest::Contains("in and out overlap"), paratrain::error);
  c.all_to_all(in, out);
  CHECK(same(out, torch::ones({n})));
}

// Under validation, counts that one rank gets wrong (rank 0 expects two elements from the
// last rank, which sends one) are the same error on every rank, naming the pair, instead of
// a truncated message or a hang; and the ranks are still in step after it.
template <class C>
void check_all_to_all_validation(C& c, std::optional<at::Device> device = {}) {
  const auto on = torch::TensorOptions().device(device_for(c, device));
  const int n = c.size(), last = n - 1;
  std::vector<std::int64_t> in_counts(static_cast<std::size_t>(n), 1), out_counts = in_counts;
  if (c.rank() == 0) out_counts[static_cast<std::size_t>(last)] = 2;
  auto in = torch::ones({n}, on);
  auto out = torch::empty({c.rank() == 0 ? n + 1 : n}, on);
  CHECK_THROWS_WITH_AS(c.all_to_all(in, in_counts, out, out_counts),
                       doctest::Contains(("rank " + std::to_string(last) + " sends rank 0 1 elements but rank 0 expects 2")
                                             .c_str()),
                       paratrain::error);
  auto agreed = torch::empty({n}, on);
  c.all_to_all(in, agreed);
  CHECK(same(agreed, torch::ones({n})));
}

}  // namespace collectives
