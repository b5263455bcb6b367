#pragma once
/// \file
/// paratrain::data::MappedArray and NpyDataset — arrays in .npy or raw files, memory-mapped.

#include <ATen/ATen.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "paratrain/core/batch.hpp"
#include "paratrain/data/detail/sample_indices.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain::data {

/// A file's array, memory-mapped read-only: a .npy file (NumPy's format, versions 1 to 3,
/// as `numpy.save` writes it) or a raw file of little-endian values. Nothing is read until
/// a sample is asked for; the kernel's page cache then keeps what was read, shared by
/// every process on the machine that maps the same file.
///
/// `tensor()` views the mapping (no copy) and keeps it alive, so it may outlive the
/// MappedArray; it is read-only memory: writing to it kills the process (SIGSEGV).
class MappedArray {
 public:
  /// A .npy file. Throws paratrain::error naming the file if it cannot be read, is not
  /// .npy, holds a type LibTorch has no equivalent of (strings, objects, records), is
  /// big-endian or Fortran-ordered (`numpy.ascontiguousarray(a).astype('<f4')` fixes
  /// both), or is shorter than its header declares.
  static MappedArray npy(const std::filesystem::path& file) {
    MappedArray a(file);
    a.parse_npy_header();
    a.finish();
    return a;
  }

  /// A raw file of little-endian `dtype` values, C-ordered, each sample of shape
  /// `sample_shape` (empty: a scalar per sample); the number of samples is the file size
  /// over a sample's bytes, which must divide it.
  static MappedArray raw(const std::filesystem::path& file, at::ScalarType dtype,
                         std::vector<std::int64_t> sample_shape, std::int64_t offset = 0) {
    MappedArray a(file);
    if (offset < 0 || offset > a.file_size_) a.fail("offset " + std::to_string(offset) + " lies outside the file");
    a.dtype_ = dtype;
    a.offset_ = offset;
    std::int64_t sample = static_cast<std::int64_t>(at::elementSize(dtype));
    for (const auto d : sample_shape) {
      if (d < 0) a.fail("a sample's shape cannot have a negative extent");
      if (d != 0 && sample > a.file_size_ / d) a.fail("a sample of that shape is larger than the file");
      sample *= d;
    }
    const auto bytes = a.file_size_ - offset;
    if (sample == 0 || bytes % sample != 0)
      a.fail("holds " + std::to_string(bytes) + " bytes of data, not a whole number of samples of " +
             std::to_string(sample) + " bytes");
    a.shape_ = {bytes / sample};
    a.shape_.insert(a.shape_.end(), sample_shape.begin(), sample_shape.end());
    a.finish();
    return a;
  }

  /// The whole array, viewing the mapping.
  [[nodiscard]] const at::Tensor& tensor() const noexcept { return tensor_; }
  [[nodiscard]] std::int64_t size() const { return tensor_.size(0); }
  [[nodiscard]] const std::filesystem::path& file() const noexcept { return file_; }

 private:
  struct Mapping {
    void* address = MAP_FAILED;
    std::size_t length = 0;
    ~Mapping() {
      if (address != MAP_FAILED) munmap(address, length);
    }
  };

  explicit MappedArray(std::filesystem::path file) : file_(std::move(file)) {
    const int fd = ::open(file_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail(std::string("cannot open it: ") + std::strerror(errno));
    struct stat st {};
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      fail("is not a regular file");
    }
    file_size_ = st.st_size;
    mapping_ = std::make_shared<Mapping>();
    if (file_size_ > 0) {
      mapping_->length = static_cast<std::size_t>(file_size_);
      mapping_->address = mmap(nullptr, mapping_->length, PROT_READ, MAP_SHARED, fd, 0);
    }
    const int mapped_errno = errno;
    ::close(fd);  // the mapping holds the file
    if (file_size_ > 0 && mapping_->address == MAP_FAILED)
      fail(std::string("cannot map it: ") + std::strerror(mapped_errno));
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw error("MappedArray", -1, file_.string() + ": " + what);
  }

  [[nodiscard]] const char* bytes() const { return static_cast<const char*>(mapping_->address); }

  // Note [The .npy header]
  // "\x93NUMPY", a major and minor version byte, the header's
  // length (2 bytes little-endian in version 1, 4 in versions 2 and 3), then a Python
  // dict literal such as {'descr': '<f4', 'fortran_order': False, 'shape': (60000, 28), }
  // padded with spaces to a multiple of 64 bytes (16 in files older than NumPy 1.9).
  void parse_npy_header() {
    if (file_size_ < 10 || std::memcmp(bytes(), "\x93NUMPY", 6) != 0) fail("is not a .npy file");
    const auto major = static_cast<unsigned char>(bytes()[6]);
    if (major < 1 || major > 3) fail("has .npy version " + std::to_string(major) + "; versions 1 to 3 are read");
    const std::int64_t width = major == 1 ? 2 : 4;
    if (file_size_ < 8 + width) fail("is not a .npy file");
    std::int64_t length = 0;
    for (std::int64_t k = width - 1; k >= 0; --k)
      length = length << 8 | static_cast<unsigned char>(bytes()[8 + k]);
    offset_ = 8 + width + length;
    if (offset_ > file_size_) fail("is shorter than its .npy header declares");
    const std::string header(bytes() + 8 + width, static_cast<std::size_t>(length));
    const auto value_of = [&](const std::string& key) {
      std::smatch m;
      if (!std::regex_search(header, m, std::regex("'" + key + "'\\s*:\\s*('[^']*'|True|False|\\([^)]*\\))")))
        fail("has a .npy header without '" + key + "': " + header);
      return m[1].str();
    };
    if (value_of("fortran_order") != "False")
      fail("is Fortran-ordered; save numpy.ascontiguousarray(a) so that each sample's values are contiguous");
    dtype_ = npy_dtype(value_of("descr"));
    const auto shape = value_of("shape");
    static const std::regex number("\\d+");
    for (auto it = std::sregex_iterator(shape.begin(), shape.end(), number); it != std::sregex_iterator(); ++it) {
      if (it->str().size() > 15) fail("declares an extent too large: " + it->str());
      shape_.push_back(std::stoll(it->str()));
    }
    if (shape_.empty()) fail("holds a single scalar, not samples along dimension 0");
  }

  [[nodiscard]] at::ScalarType npy_dtype(const std::string& quoted) const {
    const auto d = quoted.size() >= 2 ? quoted.substr(1, quoted.size() - 2) : quoted;
    if (d.size() >= 2 && d[0] == '>' && d.substr(1) != "u1" && d.substr(1) != "i1" && d.substr(1) != "b1")
      fail("holds big-endian values ('" + d + "'); save a.astype(a.dtype.newbyteorder('<'))");
    const auto type = d.size() >= 2 ? d.substr(1) : d;
    if (type == "u1") return at::kByte;
    if (type == "i1") return at::kChar;
    if (type == "b1") return at::kBool;
    if (type == "i2") return at::kShort;
    if (type == "i4") return at::kInt;
    if (type == "i8") return at::kLong;
    if (type == "f2") return at::kHalf;
    if (type == "f4") return at::kFloat;
    if (type == "f8") return at::kDouble;
    fail("holds values of NumPy type '" + d + "', which LibTorch has no tensor type for");
  }

  // Checks the data fits and makes the tensor that views it.
  void finish() {
    const auto element = static_cast<std::int64_t>(at::elementSize(dtype_));
    std::int64_t count = 1;
    for (const auto d : shape_) {
      if (d != 0 && count > (file_size_ + 1) / d) fail("is shorter than its header declares");
      count *= d;
    }
    if (offset_ + count * element > file_size_)
      fail("is shorter than its header declares: " + std::to_string(count) + " values of " +
           std::to_string(element) + " bytes from byte " + std::to_string(offset_));
    if (offset_ % element != 0) fail("has its data at byte " + std::to_string(offset_) + ", not aligned to its values");
    // The deleter holds the mapping: the tensor keeps it alive, not this object.
    auto keep = mapping_;
    void* data = count > 0 ? const_cast<char*>(bytes() + offset_) : nullptr;
    tensor_ = count > 0 ? at::from_blob(data, shape_, [keep](void*) {}, at::TensorOptions().dtype(dtype_))
                        : at::empty(shape_, dtype_);
  }

  std::filesystem::path file_;
  std::int64_t file_size_ = 0;
  std::shared_ptr<Mapping> mapping_;
  at::ScalarType dtype_ = at::kByte;
  std::int64_t offset_ = 0;
  std::vector<std::int64_t> shape_;
  at::Tensor tensor_;
};

/// Memory-mapped arrays as a paratrain::dataset: one MappedArray per model input and one
/// of targets, with the same number of samples (dimension 0). A batch is gathered from the
/// mappings into fresh tensors of the files' types; a sample not yet in the page cache is
/// read from disk then, on whichever thread asks (data::Loader's workers, with workers).
///
/// \code
/// paratrain::data::NpyDataset train({"images.npy"}, "labels.npy");
/// \endcode
class NpyDataset {
 public:
  /// .npy files (MappedArray::npy). Throws paratrain::error if one cannot be read or they
  /// hold different numbers of samples.
  NpyDataset(const std::vector<std::filesystem::path>& inputs, const std::filesystem::path& targets)
      : NpyDataset(npy_files(inputs), MappedArray::npy(targets)) {}

  /// Arrays already mapped (MappedArray::raw for raw files).
  NpyDataset(std::vector<MappedArray> inputs, MappedArray targets)
      : inputs_(std::move(inputs)), targets_(std::move(targets)) {
    if (inputs_.empty()) throw error("NpyDataset", -1, "give at least one input array");
    for (const auto& x : inputs_) {
      if (x.size() != targets_.size())
        throw error("NpyDataset", -1,
                    x.file().string() + " holds " + std::to_string(x.size()) + " samples but " +
                        targets_.file().string() + " " + std::to_string(targets_.size()));
    }
  }

  [[nodiscard]] std::int64_t size() const { return targets_.size(); }

  [[nodiscard]] Batch get(const at::Tensor& indices) const {
    paratrain::detail::check_sample_indices("NpyDataset", indices, size());
    Batch b;
    for (const auto& x : inputs_) b.inputs.push_back(x.tensor().index_select(0, indices));
    b.target = targets_.tensor().index_select(0, indices);
    return b;
  }

  [[nodiscard]] const std::vector<MappedArray>& inputs() const noexcept { return inputs_; }
  [[nodiscard]] const MappedArray& targets() const noexcept { return targets_; }

 private:
  static std::vector<MappedArray> npy_files(const std::vector<std::filesystem::path>& files) {
    std::vector<MappedArray> out;
    for (const auto& f : files) out.push_back(MappedArray::npy(f));
    return out;
  }

  std::vector<MappedArray> inputs_;
  MappedArray targets_;
};

}  // namespace paratrain::data
