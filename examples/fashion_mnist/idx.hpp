#pragma once
// Reading the IDX files of (Fashion-)MNIST, gzipped as Debian ships them.
#include <torch/torch.h>
#include <zlib.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace fashion_mnist {

/// The tensor in an IDX file (http://yann.lecun.com/exdb/mnist/): uint8 data, big-endian
/// dimensions. Works on plain and gzipped files alike.
inline torch::Tensor read_idx(const std::string& path) {
  std::unique_ptr<gzFile_s, int (*)(gzFile)> file(gzopen(path.c_str(), "rb"), gzclose);
  if (!file) throw std::runtime_error("cannot open " + path + " (is dataset-fashion-mnist installed?)");
  auto read = [&](void* out, unsigned bytes) {
    if (gzread(file.get(), out, bytes) != static_cast<int>(bytes)) throw std::runtime_error(path + ": truncated");
  };
  unsigned char magic[4];
  read(magic, 4);
  if (magic[0] != 0 || magic[1] != 0 || magic[2] != 0x08) throw std::runtime_error(path + ": not an IDX file of uint8");
  std::vector<std::int64_t> sizes(magic[3]);
  std::int64_t count = 1;
  for (auto& s : sizes) {
    unsigned char b[4];
    read(b, 4);
    s = (std::int64_t{b[0]} << 24) | (b[1] << 16) | (b[2] << 8) | b[3];
    count *= s;
  }
  auto t = torch::empty(sizes, torch::kUInt8);
  read(t.data_ptr(), static_cast<unsigned>(count));
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
