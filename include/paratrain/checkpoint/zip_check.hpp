#pragma once
/// \file
/// The CRC-32 of every stored entry of a zip archive (a torch.save'd .pt file), checked
/// before LibTorch's unpickler reads it (Note [Zip checksums]).

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "paratrain/util/crc32c.hpp"

namespace paratrain::checkpoint::detail {

// Note [Zip checksums]
// A .pt file is a zip archive whose entries carry the CRC-32 of their bytes, but LibTorch
// 1.13's reader does not check them, and its unpickler trusts the lengths inside: the
// checkpoint fuzzer's corrupted index.pt made it allocate and fill a string of a length
// read from the damaged bytes (13 s, and as much memory as the length said). index.pt has
// no checksum of its own in the index (the rank files do), so every .pt file is checked
// here first: the central directory's entries, each found through its local header and
// compared with its recorded CRC-32. Only what PyTorch writes is read: stored entries, no
// ZIP64 fields; anything else is reported as "not a paratrain checkpoint file" by the
// caller, as before. A file crafted with valid checksums can still reach the unpickler.

/// Why the zip archive in `bytes` is damaged, or nullopt when each of its stored entries
/// has the CRC-32 its central directory records (Note [Zip checksums]).
inline std::optional<std::string> zip_damage(const std::vector<char>& bytes) {
  const auto size = bytes.size();
  const auto u16 = [&](std::size_t at) -> std::uint32_t {
    return static_cast<unsigned char>(bytes[at]) | static_cast<unsigned char>(bytes[at + 1]) << 8;
  };
  const auto u32 = [&](std::size_t at) -> std::uint32_t { return u16(at) | u16(at + 2) << 16; };
  // The end-of-central-directory record: 22 bytes plus a comment of at most 65535.
  std::optional<std::size_t> end;
  for (std::size_t back = 22; back <= size && back <= 22 + 65535 && !end; ++back)
    if (u32(size - back) == 0x06054b50u) end = size - back;
  if (!end) return "it is not a zip archive (no end of central directory)";
  const std::size_t entries = u16(*end + 10), directory = u32(*end + 16);
  std::size_t at = directory;
  for (std::size_t e = 0; e < entries; ++e) {
    if (at + 46 > size || u32(at) != 0x02014b50u) return "its central directory is damaged";
    const std::uint32_t method = u16(at + 10), crc = u32(at + 16), stored = u32(at + 20);
    const std::size_t name = u16(at + 28), extra = u16(at + 30), comment = u16(at + 32), local = u32(at + 42);
    at += 46 + name + extra + comment;
    if (method != 0 || stored == 0xFFFFFFFFu || local == 0xFFFFFFFFu) continue;  // not PyTorch's: unchecked
    if (local + 30 > size || u32(local) != 0x04034b50u) return "a local file header is damaged";
    const std::size_t data = local + 30 + u16(local + 26) + u16(local + 28);
    if (data > size || stored > size - data) return "an entry runs past the end of the file (truncated)";
    if (paratrain::detail::crc32({bytes.data() + data, stored}) != crc) return "an entry fails its CRC-32";
  }
  return std::nullopt;
}

}  // namespace paratrain::checkpoint::detail
