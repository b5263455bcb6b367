#pragma once
/// \file
/// Checking that every rank issues the same collective: shared by comm::Mpi, comm::Gloo and comm::Nccl
/// (through comm/detail/skeleton.hpp).

#include <ATen/ATen.h>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <string>
#include <string_view>

#include "paratrain/core/error.hpp"

namespace paratrain::detail {

/// Whether an environment variable is set to something other than "" or "0".
[[nodiscard]] inline bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && std::string_view(v) != "0" && std::string_view(v) != "";
}

// Note [Collective validation]
// Every rank contributes (operation, dtype, count, detail) and their negations to one
// MAX all-reduce: the maximum equals the negated minimum exactly when all ranks agree,
// so every rank reaches the same verdict and throws together, never hangs.
class CollectiveSignature {
 public:
  CollectiveSignature(std::string_view op, const at::Tensor& t, int detail)
      : CollectiveSignature(op, t.scalar_type(), t.numel(), detail) {}
  /// The same for a buffer known by its dtype and element count (comm::Nccl's device pointers).
  CollectiveSignature(std::string_view op, at::ScalarType dtype, std::int64_t numel, int detail)
      : op_(op),
        mine_{static_cast<std::int64_t>(std::hash<std::string_view>{}(op) & 0xffffffff),
              static_cast<std::int64_t>(dtype), numel, detail} {
    auto* b = packed_.data_ptr<std::int64_t>();
    for (int i = 0; i < 4; ++i) b[i] = mine_[i], b[i + 4] = -mine_[i];
  }

  /// The 8 int64 values to all-reduce in place with MAX.
  [[nodiscard]] at::Tensor& packed() noexcept { return packed_; }

  /// After the MAX all-reduce of packed(): throws, on every rank alike, if ranks disagree.
  void check(int rank) const {
    static constexpr const char* what[] = {"the operation", "the dtype", "the element count", "the root or reduction"};
    const auto* b = packed_.data_ptr<std::int64_t>();
    for (int i = 0; i < 4; ++i)
      if (b[i] != -b[i + 4])
        throw error(op_, rank,
                    "ranks disagree on " + std::string(what[i]) +
                        (i == 0 ? "" : " (this rank: " + value(i, mine_[i]) + "; across ranks from " +
                                           value(i, -b[i + 4]) + " to " + value(i, b[i]) + ")") +
                        "; every rank must issue the same collectives in the same order with matching tensors");
  }

 private:
  // dtypes by name, the rest as numbers
  static std::string value(int field, std::int64_t v) {
    return field == 1 ? std::string(c10::toString(static_cast<at::ScalarType>(v))) : std::to_string(v);
  }

  std::string op_;
  std::int64_t mine_[4];
  at::Tensor packed_ = at::empty({8}, at::kLong);
};

}  // namespace paratrain::detail
