#pragma once
/// \file
/// The part of a communicator written once for comm::Mpi, comm::Gloo and comm::Nccl: who it
/// is (rank, size), the checks of peers, and the preamble every collective passes through
/// (validation, ledger, fingerprint, watch). A transport supplies two blocking operations on
/// int64 words (`word_collectives`); the request lifetime is detail::BasicRequest.
// IWYU pragma: private, include "paratrain/comm/mpi/mpi.hpp" (or gloo/, nccl/)

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "paratrain/comm/detail/request.hpp"
#include "paratrain/comm/detail/tensor_checks.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/reliability/collective_signature.hpp"
#include "paratrain/reliability/watchdog.hpp"

namespace paratrain::detail {

/// The two operations the preamble runs over a transport, blocking, neither counted nor
/// watched (the skeleton watches them): `all_reduce_max(op, words)` all-reduces a contiguous
/// CPU int64 tensor in place with MAX; `all_gather(op, in, out)` concatenates every rank's
/// CPU int64 `in`, in rank order, into `out`. `op` names the operation in errors.
template <class T>
concept word_collectives = requires(T& t, const char* op, at::Tensor& words, const at::Tensor& in) {
  t.all_reduce_max(op, words);
  t.all_gather(op, in, words);
};

/// A communicator's rank, size, validation setting and Watched (Note [Watchdog], Note
/// [Collective fingerprint]); each communicator keeps one in its shared state.
class Skeleton {
 public:
  Skeleton() = default;
  Skeleton(int rank, int size, bool validate, Watched watched)
      : watched_(std::move(watched)), rank_(rank), size_(size), validate_(validate) {}

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return size_; }
  [[nodiscard]] bool validates() const noexcept { return validate_; }
  [[nodiscard]] const Watched& watched() const noexcept { return watched_; }

  [[noreturn]] void fail(const char* op, const std::string& message) const { throw error(op, rank_, message); }

  /// `peer` (a root, a sender, a receiver) is a rank of this communicator.
  void check_peer(const char* op, int peer) const {
    if (peer < 0 || peer >= size_)
      fail(op, "rank " + std::to_string(peer) + " is not in this communicator of " + std::to_string(size_) +
                   " ranks (0.." + std::to_string(size_ - 1) + ")");
  }

  // Every collective but barrier, split and duplicate passes here, after its arguments are
  // checked: it is checked in full across ranks when asked (Note [Collective validation],
  // reliability/collective_signature.hpp), counted, its fingerprint compared when due (Note
  // [Collective fingerprint]), and watched: the returned watch (Note [Watchdog]).
  template <word_collectives Words>
  [[nodiscard]] Watch begin(std::string_view op, at::ScalarType dtype, std::int64_t numel, int detail,
                            Words&& words) const {
    // first: a collective refused on every rank is not counted
    if (validate_) [[unlikely]] validate(op, dtype, numel, detail, words);
    auto [watch, due] = watched_.collective(op, dtype, numel, detail);
    if (due) [[unlikely]] compare_fingerprints(words);
    return std::move(watch);
  }
  template <word_collectives Words>
  [[nodiscard]] Watch begin(std::string_view op, const at::Tensor& t, int detail, Words&& words) const {
    return begin(op, t.scalar_type(), t.numel(), detail, words);
  }

  // Note [All-to-all across ranks]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // An all-to-all's parts may differ by rank (uneven counts: a mixture of experts routes
  // each rank's tokens its own way), so its record carries no element count (-1: the
  // fingerprint and the signature compare the operation and the dtype), and what the ranks
  // must agree on is a matrix: rank i sends rank j in_counts_i[j] elements, which rank j
  // must expect, out_counts_j[i]. Under validation every rank gathers every rank's counts
  // (2 * size() words each) and checks the whole matrix, so that a mismatch anywhere is
  // the same error on every rank, naming the pair, instead of a truncated message on one
  // of them or a hang (MPI), or a Gloo abort. Without validation a mismatch is the
  // transport's to find.

  /// The preamble of an all-to-all whose arguments check_all_to_all checked (Note
  /// [All-to-all across ranks]).
  template <word_collectives Words>
  [[nodiscard]] Watch begin_all_to_all(const char* op, at::ScalarType dtype, const AllToAllLayout& layout,
                                       Words&& words) const {
    auto watch = begin(op, dtype, -1, 0, words);
    if (validate_) check_counts(op, layout, words);
    return watch;
  }

  /// Counts and watches a collective without a buffer (barrier, split).
  [[nodiscard]] Watch collective(std::string_view op) const { return watched_.collective(op); }
  [[nodiscard]] Watch point_to_point(std::string_view op, int peer, int tag) const {
    return watched_.point_to_point(op, peer, tag);
  }

 private:
  // The rare parts of begin(), out of line, so that a collective's common path stays short.
  template <word_collectives Words>
  [[gnu::noinline]] void validate(std::string_view op, at::ScalarType dtype, std::int64_t numel, int detail,
                                  Words& words) const {
    CollectiveSignature signature(op, dtype, numel, detail);
    const auto watch = watched_.operation(record_of("validate", signature.packed(), 0));
    words.all_reduce_max("validate", signature.packed());
    signature.check(rank_);
  }
  template <word_collectives Words>
  [[gnu::noinline]] void compare_fingerprints(Words& words) const {
    watched_.compare_fingerprints(
        rank_, size_, [&](at::Tensor& w) { words.all_reduce_max("fingerprint", w); },
        [&](const at::Tensor& in, at::Tensor& out) { words.all_gather("fingerprint", in, out); });
  }

  template <word_collectives Words>
  void check_counts(const char* op, const AllToAllLayout& layout, Words&& words) const {
    const auto n = static_cast<std::size_t>(size_);
    auto mine = at::empty({static_cast<std::int64_t>(2 * n)}, at::kLong);
    auto all = at::empty({static_cast<std::int64_t>(2 * n * n)}, at::kLong);
    auto* m = mine.data_ptr<std::int64_t>();
    for (std::size_t i = 0; i < n; ++i) m[i] = layout.in_count(i), m[n + i] = layout.out_count(i);
    {
      const auto watch = watched_.operation(record_of("validate", mine, 0));
      words.all_gather("validate", mine, all);
    }
    const auto* a = all.data_ptr<std::int64_t>();
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = 0; j < n; ++j) {
        const auto sends = a[i * 2 * n + j], expects = a[j * 2 * n + n + i];
        if (sends != expects)
          fail(op,
               "rank " + std::to_string(i) + " sends rank " + std::to_string(j) + " " + std::to_string(sends) +
                   " elements but rank " + std::to_string(j) + " expects " + std::to_string(expects) + " from rank " +
                   std::to_string(i) + "; in_counts[j] on rank i must equal out_counts[i] on rank j");
      }
  }

  Watched watched_;
  int rank_ = 0;
  int size_ = 1;
  bool validate_ = false;
};

}  // namespace paratrain::detail
