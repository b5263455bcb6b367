#pragma once
/// \file
/// paratrain::data::read_idx and IdxDataset — the IDX files of MNIST and Fashion-MNIST.

#include <ATen/ATen.h>
#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "paratrain/core/batch.hpp"
#include "paratrain/data/detail/sample_indices.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain::detail {

/// The element type and size of IDX's type code (the magic number's third byte).
inline std::pair<at::ScalarType, std::size_t> idx_type(unsigned code) {
  switch (code) {
    case 0x08: return {at::kByte, 1};
    case 0x09: return {at::kChar, 1};
    case 0x0B: return {at::kShort, 2};
    case 0x0C: return {at::kInt, 4};
    case 0x0D: return {at::kFloat, 4};
    case 0x0E: return {at::kDouble, 8};
    default: return {at::kByte, 0};
  }
}

}  // namespace paratrain::detail

namespace paratrain::data {

/// The tensor in an IDX file (http://yann.lecun.com/exdb/mnist/): a magic number naming
/// the element type (uint8, int8, int16, int32, float32 or float64), big-endian
/// dimensions, then the values, big-endian. Plain and gzipped files alike (Debian's
/// dataset-fashion-mnist ships them gzipped).
///
/// A file that is not one, or holds fewer or more values than its header declares, is a
/// paratrain::error naming it. Memory grows with what the file holds (at most twice),
/// never with what a header claims, so a damaged file cannot make it allocate gigabytes
/// (fuzz/idx.cpp).
inline at::Tensor read_idx(const std::filesystem::path& path) {
  const auto fail = [&](const std::string& what) { return error("read_idx", -1, path.string() + ": " + what); };
  std::unique_ptr<gzFile_s, int (*)(gzFile)> file(gzopen(path.c_str(), "rb"), gzclose);
  if (!file) throw fail("cannot open it");
  // Up to `bytes` into `out`; fewer only at the end of the file.
  const auto read_some = [&](void* out, std::size_t bytes) {
    std::size_t done = 0;
    while (done < bytes) {
      const auto chunk = static_cast<unsigned>(std::min<std::size_t>(bytes - done, std::size_t{1} << 20));
      const int n = gzread(file.get(), static_cast<char*>(out) + done, chunk);
      if (n < 0) {
        int code = 0;
        throw fail(gzerror(file.get(), &code));
      }
      if (n == 0) break;
      done += static_cast<std::size_t>(n);
    }
    return done;
  };
  const auto read = [&](void* out, std::size_t bytes) {
    if (read_some(out, bytes) != bytes) throw fail("truncated header");
  };
  unsigned char magic[4];
  read(magic, 4);
  const auto [type, element] = paratrain::detail::idx_type(magic[2]);
  if (magic[0] != 0 || magic[1] != 0 || element == 0)
    throw fail("not an IDX file (its magic number is not 0 0 <type 8, 9, 11, 12, 13 or 14> <dimensions>)");
  std::vector<std::int64_t> sizes(magic[3]);
  std::int64_t count = 1;
  for (auto& s : sizes) {
    unsigned char b[4];
    read(b, 4);
    s = std::int64_t{b[0]} << 24 | std::int64_t{b[1]} << 16 | std::int64_t{b[2]} << 8 | std::int64_t{b[3]};
    if (s != 0 && count > std::numeric_limits<std::int64_t>::max() / 8 / s)
      throw fail("its header declares more values than memory can hold");
    count *= s;
  }
  const auto bytes = count * static_cast<std::int64_t>(element);
  // In pieces that double, from 1 MiB: a header that overstates the data costs at most
  // twice what the file holds.
  std::vector<unsigned char> values;
  while (static_cast<std::int64_t>(values.size()) < bytes) {
    const auto had = static_cast<std::int64_t>(values.size());
    const auto want = static_cast<std::size_t>(std::min(bytes - had, std::max<std::int64_t>(had, 1 << 20)));
    values.resize(static_cast<std::size_t>(had) + want);
    if (read_some(values.data() + static_cast<std::size_t>(had), want) != want)
      throw fail("truncated: its header declares " + std::to_string(count) + " values");
  }
  unsigned char extra = 0;
  if (read_some(&extra, 1) != 0)
    throw fail("holds more than the " + std::to_string(count) + " values its header declares");
  // IDX is big-endian; this machine (x86-64, aarch64 Linux) is not.
  for (std::size_t at = 0; element > 1 && at < values.size(); at += element)
    std::reverse(values.begin() + static_cast<std::ptrdiff_t>(at),
                 values.begin() + static_cast<std::ptrdiff_t>(at + element));
  auto t = at::empty(sizes, type);
  if (bytes > 0) std::memcpy(t.data_ptr(), values.data(), values.size());
  return t;
}

/// How IdxDataset converts images.
struct IdxOptions {
  double mean = 0;       ///< subtracted after scaling to [0, 1]
  double std = 1;        ///< then divided by
  bool channel = true;   ///< images [n, h, w] come as [n, 1, h, w], as a Conv2d expects
};

/// MNIST-style IDX image and label files as a paratrain::dataset: images as float32,
/// scaled to [0, 1] and then normalised, `(x / 255 - mean) / std`, labels as int64 class
/// indices. The files are read once, into memory, where they take what they take on
/// disk (uint8); each batch is converted when asked for, which data::Loader's workers do
/// off the training thread.
///
/// \code
/// const auto dir = std::filesystem::path("/usr/share/datasets/fashion-mnist");
/// paratrain::data::IdxDataset train(dir / "train-images-idx3-ubyte.gz", dir / "train-labels-idx1-ubyte.gz",
///                                   {.mean = 0.2860, .std = 0.3530});
/// \endcode
class IdxDataset {
 public:
  using Options = IdxOptions;

  /// Throws paratrain::error if a file cannot be read (read_idx), or if they hold different
  /// numbers of samples, or std is not positive.
  IdxDataset(const std::filesystem::path& images, const std::filesystem::path& labels, Options options = {})
      : images_(read_idx(images)), labels_(read_idx(labels).to(at::kLong)), options_(options) {
    if (images_.dim() < 1 || labels_.dim() != 1 || images_.size(0) != labels_.size(0))
      throw error("IdxDataset", -1,
                  images.string() + " and " + labels.string() + " must hold one image and one label per sample; they "
                  "hold tensors of " + std::to_string(images_.dim() ? images_.size(0) : 0) + " and " +
                  std::to_string(labels_.dim() ? labels_.size(0) : 0) + " rows");
    if (!(options_.std > 0)) throw error("IdxDataset", -1, "Options::std must be positive");
  }

  [[nodiscard]] std::int64_t size() const { return labels_.size(0); }

  /// The images at `indices`, converted and normalised, and their labels.
  [[nodiscard]] Batch get(const at::Tensor& indices) const {
    paratrain::detail::check_sample_indices("IdxDataset", indices, size());
    auto x = images_.index_select(0, indices).to(at::kFloat).div_(255.0);
    if (options_.mean != 0) x.sub_(options_.mean);
    if (options_.std != 1) x.div_(options_.std);
    if (options_.channel && x.dim() == 3) x = x.unsqueeze(1);
    return {std::move(x), labels_.index_select(0, indices)};
  }

  /// The images as stored: uint8, [n, h, w].
  [[nodiscard]] const at::Tensor& images() const noexcept { return images_; }
  [[nodiscard]] const at::Tensor& labels() const noexcept { return labels_; }

 private:
  at::Tensor images_;
  at::Tensor labels_;
  Options options_;
};

}  // namespace paratrain::data
