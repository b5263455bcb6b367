#pragma once
/// \file
/// paratrain::reduce_op — how a reduction combines the ranks' values.

#include <string_view>

namespace paratrain {

/// The reductions every communicator offers.
///
/// `average` is `sum` followed by a division by the number of ranks, done once on
/// the reduced buffer (so it costs one pass, not one per rank); it is defined for
/// floating-point tensors only, because an integer average would silently truncate.
enum class reduce_op { sum, average, max, min };

[[nodiscard]] constexpr std::string_view to_string(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return "sum";
    case reduce_op::average: return "average";
    case reduce_op::max: return "max";
    case reduce_op::min: return "min";
  }
  return "?";
}

}  // namespace paratrain
