#pragma once
/// \file
/// CRC-32C (Castagnoli), as TensorBoard's record framing uses it.

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace paratrain::detail {

// The reflected polynomial 0x82F63B78, one table lookup per byte. Event files are
// written a few records at a time, so the table is plenty fast; no SSE4.2 intrinsics.
inline constexpr std::array<std::uint32_t, 256> crc32c_table = [] {
  std::array<std::uint32_t, 256> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}();

/// CRC-32C of `data`: crc32c("123456789") == 0xE3069283.
constexpr std::uint32_t crc32c(std::string_view data) noexcept {
  std::uint32_t c = 0xFFFFFFFFu;
  for (const char ch : data) c = crc32c_table[(c ^ static_cast<unsigned char>(ch)) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

/// TFRecord's masked CRC: a CRC stored next to the data it covers is itself rotated
/// and offset, so that the CRC of a string containing CRCs stays well distributed.
constexpr std::uint32_t masked_crc32c(std::string_view data) noexcept {
  const std::uint32_t c = crc32c(data);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

static_assert(crc32c("123456789") == 0xE3069283u, "CRC-32C check value (RFC 3720, iSCSI)");

}  // namespace paratrain::detail
