#pragma once
/// \file
/// 64-bit FNV-1a: the running hash by which ranks compare what they did or were given.

#include <cstdint>
#include <string_view>

namespace paratrain::detail {

/// FNV-1a over 64-bit values (each mixed in whole) or bytes; not for security.
class Fnv1a {
 public:
  constexpr Fnv1a& mix(std::uint64_t v) noexcept {
    h_ = (h_ ^ v) * 1099511628211ull;
    return *this;
  }
  constexpr Fnv1a& mix(std::string_view bytes) noexcept {
    for (const unsigned char c : bytes) mix(c);
    return *this;
  }
  [[nodiscard]] constexpr std::uint64_t value() const noexcept { return h_; }
  /// The value in 62 bits, so that it and its negation fit an int64 (MAX all-reduces of
  /// {h, -h} compare it across ranks).
  [[nodiscard]] constexpr std::int64_t value62() const noexcept { return static_cast<std::int64_t>(h_ >> 2); }

 private:
  std::uint64_t h_ = 14695981039346656037ull;  // the offset basis
};

}  // namespace paratrain::detail
