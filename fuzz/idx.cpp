// Fuzzes the IDX reader (paratrain/data/idx_dataset.hpp), plain and gzipped: whatever the
// bytes, read_idx returns the tensor the header describes or throws paratrain::error
// naming the file, allocates no more than the file holds, and touches
// no memory it does not own. Built with libFuzzer (fuzz/CMakeLists.txt) and replayed by a
// g++ build in ctest (replay_main.cpp).
#include <unistd.h>
#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "paratrain/data/idx_dataset.hpp"

namespace {

struct File {
  std::string path;
  File() {
    char name[] = "/tmp/paratrain-fuzz-idx-XXXXXX";
    const int fd = mkstemp(name);
    if (fd < 0) std::abort();
    close(fd);
    path = name;
  }
  ~File() { std::remove(path.c_str()); }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static File file;
  // The first byte picks plain or gzipped: the reader takes both.
  const bool gzipped = size > 0 && (data[0] & 1);
  if (size > 0) ++data, --size;
  if (gzipped) {
    gzFile out = gzopen(file.path.c_str(), "wb");
    if (size > 0) gzwrite(out, data, static_cast<unsigned>(size));
    gzclose(out);
  } else {
    std::FILE* out = std::fopen(file.path.c_str(), "wb");
    std::fwrite(data, 1, size, out);
    std::fclose(out);
  }
  try {
    const auto t = paratrain::data::read_idx(file.path);
    // What was read is what the header declared, and no more than the file held.
    if (t.numel() > static_cast<std::int64_t>(size)) std::abort();
  } catch (const std::runtime_error& e) {
    if (std::string(e.what()).find(file.path) == std::string::npos) {
      std::fprintf(stderr, "idx: an error that names no file: %s\n", e.what());
      std::abort();
    }
  }
  return 0;
}
