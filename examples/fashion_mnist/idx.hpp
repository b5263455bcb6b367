#pragma once
// Reading the IDX files of (Fashion-)MNIST, gzipped as Debian ships them.
#include <torch/torch.h>
#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace fashion_mnist {

/// The tensor in an IDX file (http://yann.lecun.com/exdb/mnist/): uint8 data, big-endian
/// dimensions. Works on plain and gzipped files alike. A file that is not one, or holds
/// fewer or more values than its header declares, is a std::runtime_error naming it;
/// memory grows with what the file holds (at most twice), never with what a header claims.
inline torch::Tensor read_idx(const std::string& path) {
  std::unique_ptr<gzFile_s, int (*)(gzFile)> file(gzopen(path.c_str(), "rb"), gzclose);
  if (!file) throw std::runtime_error("cannot open " + path + " (is dataset-fashion-mnist installed?)");
  // Up to `bytes` into `out`; fewer only at the end of the file.
  const auto read_some = [&](void* out, std::size_t bytes) {
    std::size_t done = 0;
    while (done < bytes) {
      const auto chunk = static_cast<unsigned>(std::min<std::size_t>(bytes - done, std::size_t{1} << 20));
      const int n = gzread(file.get(), static_cast<char*>(out) + done, chunk);
      if (n < 0) {
        int code = 0;
        throw std::runtime_error(path + ": " + gzerror(file.get(), &code));
      }
      if (n == 0) break;
      done += static_cast<std::size_t>(n);
    }
    return done;
  };
  const auto read = [&](void* out, std::size_t bytes) {
    if (read_some(out, bytes) != bytes) throw std::runtime_error(path + ": truncated header");
  };
  unsigned char magic[4];
  read(magic, 4);
  if (magic[0] != 0 || magic[1] != 0 || magic[2] != 0x08) throw std::runtime_error(path + ": not an IDX file of uint8");
  std::vector<std::int64_t> sizes(magic[3]);
  std::int64_t count = 1;
  for (auto& s : sizes) {
    unsigned char b[4];
    read(b, 4);
    s = std::int64_t{b[0]} << 24 | std::int64_t{b[1]} << 16 | std::int64_t{b[2]} << 8 | std::int64_t{b[3]};
    if (s != 0 && count > std::numeric_limits<std::int64_t>::max() / s)
      throw std::runtime_error(path + ": its header declares more values than an int64 counts");
    count *= s;
  }
  // In pieces that double, from 1 MiB: a header that overstates the data costs at most
  // twice what the file holds.
  std::vector<unsigned char> values;
  while (static_cast<std::int64_t>(values.size()) < count) {
    const auto had = static_cast<std::int64_t>(values.size());
    const auto want = static_cast<std::size_t>(std::min(count - had, std::max<std::int64_t>(had, 1 << 20)));
    values.resize(static_cast<std::size_t>(had) + want);
    if (read_some(values.data() + static_cast<std::size_t>(had), want) != want)
      throw std::runtime_error(path + ": truncated: its header declares " + std::to_string(count) + " values");
  }
  unsigned char extra = 0;
  if (read_some(&extra, 1) != 0)
    throw std::runtime_error(path + ": holds more than the " + std::to_string(count) + " values its header declares");
  auto t = torch::empty(sizes, torch::kUInt8);
  if (count > 0) std::memcpy(t.data_ptr(), values.data(), values.size());
  return t;
}

struct Split {
  torch::Tensor images;  // float32 [n, 1, 28, 28], normalised
  torch::Tensor labels;  // int64 [n]
};

inline Split load(const std::string& dir, const std::string& prefix) {
  auto images = read_idx(dir + "/" + prefix + "-images-idx3-ubyte.gz").to(torch::kFloat32).div_(255.0);
  // Fashion-MNIST's training-set mean and standard deviation.
  images = images.sub_(0.2860).div_(0.3530).unsqueeze(1).contiguous();
  return {images, read_idx(dir + "/" + prefix + "-labels-idx1-ubyte.gz").to(torch::kLong)};
}

}  // namespace fashion_mnist
