#pragma once
/// \file
/// CRC-32C (Castagnoli), as TensorBoard's record framing and checkpoint files use it, and
/// zip's CRC-32 (IEEE 802.3), which the .pt files inside a checkpoint carry.

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace paratrain::detail {

// One table lookup per byte: constexpr, and plenty fast for TensorBoard's few records at a
// time and a checkpoint's small .pt files (crc32c_extend below is for gigabytes).
using CrcTable = std::array<std::uint32_t, 256>;

/// The byte table of the reflected CRC-32 of polynomial `poly`.
constexpr CrcTable reflected_crc_table(std::uint32_t poly) noexcept {
  CrcTable t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ poly : c >> 1;
    t[i] = c;
  }
  return t;
}
inline constexpr CrcTable crc32c_table = reflected_crc_table(0x82F63B78u);
inline constexpr CrcTable crc32_table = reflected_crc_table(0xEDB88320u);

/// The CRC of `data` by `table`, from and to the usual all-ones complement.
constexpr std::uint32_t crc_of(const CrcTable& table, std::string_view data) noexcept {
  std::uint32_t c = 0xFFFFFFFFu;
  for (const char ch : data) c = table[(c ^ static_cast<unsigned char>(ch)) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

/// CRC-32C of `data`: crc32c("123456789") == 0xE3069283.
constexpr std::uint32_t crc32c(std::string_view data) noexcept { return crc_of(crc32c_table, data); }
/// Zip's CRC-32 of `data`: crc32("123456789") == 0xCBF43926.
constexpr std::uint32_t crc32(std::string_view data) noexcept { return crc_of(crc32_table, data); }

/// TFRecord's masked CRC: a CRC stored next to the data it covers is itself rotated
/// and offset, so that the CRC of a string containing CRCs stays well distributed.
constexpr std::uint32_t masked_crc32c(std::string_view data) noexcept {
  const std::uint32_t c = crc32c(data);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

// Checkpoints checksum gigabytes: there the SSE4.2 instruction (8 bytes a cycle, against
// the table's one) is used where the processor has it.
#if defined(__x86_64__)
__attribute__((target("sse4.2"))) inline std::uint32_t crc32c_sse42(std::uint32_t c, const unsigned char* p,
                                                                     std::size_t n) noexcept {
  std::uint64_t c64 = c;
  for (; n >= 8; n -= 8, p += 8) {
    std::uint64_t word;
    __builtin_memcpy(&word, p, 8);
    c64 = _mm_crc32_u64(c64, word);
  }
  c = static_cast<std::uint32_t>(c64);
  for (; n > 0; --n, ++p) c = _mm_crc32_u8(c, *p);
  return c;
}
#endif

/// Extends `crc` (0 to begin) over `size` more bytes: crc32c_extend(0, "123456789", 9)
/// == 0xE3069283, and extending in pieces gives the same as all at once.
inline std::uint32_t crc32c_extend(std::uint32_t crc, const void* data, std::size_t size) noexcept {
  auto c = crc ^ 0xFFFFFFFFu;
  const auto* p = static_cast<const unsigned char*>(data);
#if defined(__x86_64__)
  if (__builtin_cpu_supports("sse4.2")) return crc32c_sse42(c, p, size) ^ 0xFFFFFFFFu;
#endif
  for (std::size_t i = 0; i < size; ++i) c = crc32c_table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

static_assert(crc32c("123456789") == 0xE3069283u, "CRC-32C check value (RFC 3720, iSCSI)");
static_assert(crc32("123456789") == 0xCBF43926u, "CRC-32 check value (IEEE 802.3, zip)");

}  // namespace paratrain::detail
