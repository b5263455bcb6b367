#pragma once
/// \file
/// paratrain::data::Hdf5Dataset — samples read from an HDF5 file as batches ask for them.
/// Part of paratrain::hdf5.

#include <ATen/ATen.h>
#include <H5Cpp.h>
#include <fcntl.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "paratrain/core/batch.hpp"
#include "paratrain/data/hdf5/detail/io.hpp"
#include "paratrain/data/detail/sample_indices.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain::data {

// Note [Reading HDF5 without its lock]
// HDF5 reads one thing at a time: a thread-safe build of the C library takes one global
// lock in every call, and the C++ API is not thread-safe at all, so paratrain holds a
// lock of its own around every HDF5 call (detail::Hdf5Lock). Loader workers that read
// through HDF5 therefore take turns, and eight of them read no faster than one.
//
// Most datasets do not need HDF5 to be read, though. One with the contiguous layout
// (h5py's default when neither chunks nor compression are asked for), no filters and no
// external storage keeps its elements row-major in one block of the file, at an offset
// HDF5 reports (H5Dget_offset, counted from the start of the file, user block included).
// Sample i is then the row_bytes bytes at offset + i * row_bytes. So the constructor asks
// HDF5 for the layout, the type and the offset, once, and opens the file a second time
// as a plain descriptor; get() reads those rows with pread, which takes no file position,
// so any number of threads read through one descriptor at once, without a lock. A run of
// consecutive indices (idx[k + 1] == idx[k] + 1, in the batch's order: nothing is
// sorted, so nothing needs putting back) is one pread. A big-endian dataset is
// byte-swapped after the read, as HDF5 would have converted it.
//
// Everything else goes through HDF5, under the lock, one hyperslab per run: chunked
// datasets (compressed ones always are), compact ones (their data sits in the object's
// header) and contiguous ones whose storage was never written (HDF5 fills in the fill
// value). The file is read-only to us and, as HDF5 itself assumes without SWMR, not
// written by anyone else while open, so the offsets stay valid.
// Options::direct_reads = false sends every read through HDF5, to compare.

/// How data::Hdf5Dataset reads (Hdf5Dataset::Options).
struct Hdf5DatasetOptions {
  /// Read contiguous datasets with pread instead of through HDF5: Note [Reading HDF5
  /// without its lock]. Off, every read goes through HDF5 under its lock (to compare).
  bool direct_reads = true;
};

/// A paratrain::dataset kept in an HDF5 file: each input and the target is an HDF5
/// dataset whose dimension 0 indexes the samples, read only when a batch asks for them.
///
/// \code
/// // written by h5py: f["images"] float32 [n, 1, 28, 28], f["labels/class"] int64 [n]
/// paratrain::data::Hdf5Dataset train("train.h5", {"images"}, "labels/class");
/// paratrain::Batch b = train.get(paratrain::data::to_tensor(indices));  // [k, 1, 28, 28], [k]
/// \endcode
///
/// Element types: int8, uint8, int16, int32, int64, float32 and float64, either byte
/// order (big-endian is converted), and h5py's bool, read as uint8. Each process (rank)
/// opens the file itself, read-only. Contiguous datasets are read with pread, in
/// parallel; chunked, compressed and compact ones through HDF5, one thread at a time in
/// the process: Note [Reading HDF5 without its lock]. Copies share the open file.
///
/// Every failure is a paratrain::error naming the file and the dataset: a file that is
/// missing or not HDF5, a dataset that is missing, a scalar, of a type not listed above,
/// or compressed with a filter this HDF5 lacks, datasets with different numbers of
/// samples, an index outside [0, size()).
class Hdf5Dataset {
 public:
  using Options = Hdf5DatasetOptions;

  /// One of the HDF5 datasets read: an input or the target.
  struct Array {
    std::string name;                 ///< its path in the file, as given ("x", "group/x")
    at::ScalarType dtype;             ///< of the tensors get() returns
    std::vector<std::int64_t> sizes;  ///< its dimensions in the file; sizes[0] == size()
    bool direct;                      ///< read with pread: Note [Reading HDF5 without its lock]
  };

  /// Opens `file` read-only and the HDF5 datasets named `inputs` (one per argument of the
  /// model's forward, in order) and `target`. Throws paratrain::error on any of the
  /// failures listed above.
  Hdf5Dataset(std::filesystem::path file, std::vector<std::string> inputs, std::string target, Options options = {}) {
    auto open = std::make_shared<Open>();  // before the lock: destroyed after it, on a throw
    open->path = std::move(file);
    const auto fail = [&](const std::string& what) { return Open::fail(open->path, what); };
    if (inputs.empty()) throw fail("no inputs: name at least one HDF5 dataset to read as an input");
    if (target.empty()) throw fail("no target: name the HDF5 dataset that holds the targets");
    std::error_code ec;
    if (!std::filesystem::exists(open->path, ec))
      throw fail(ec ? "cannot look at it: " + ec.message() : "no such file");
    if (!std::filesystem::is_regular_file(open->path, ec)) throw fail("not a regular file");
    auto names = std::move(inputs);
    names.push_back(std::move(target));
    {
      detail::Hdf5Lock lock;
      const htri_t hdf5 = H5Fis_hdf5(open->path.c_str());
      if (hdf5 == 0) throw fail("not an HDF5 file (it has no HDF5 signature)");
      if (hdf5 < 0) throw fail("HDF5 cannot open it (" + detail::hdf5_error_text() + ")");
      try {
        open->file.emplace(open->path.string(), H5F_ACC_RDONLY);
      } catch (const H5::Exception& e) {
        throw fail("HDF5 cannot open it (" + detail::hdf5_error_text(e) + ")");
      }
      for (const auto& name : names) open->add(name, options);
    }
    for (const auto& a : open->arrays) {
      if (a.sizes[0] != open->arrays[0].sizes[0])
        throw fail("dataset '" + a.name + "' holds " + std::to_string(a.sizes[0]) + " samples (its dimension 0) and '" +
                   open->arrays[0].name + "' " + std::to_string(open->arrays[0].sizes[0]) +
                   "; the inputs and the target need one row per sample each");
    }
    open->open_descriptor();
    open_ = std::move(open);
  }

  /// The number of samples: dimension 0 of every input and of the target.
  [[nodiscard]] std::int64_t size() const { return open_->arrays.front().sizes[0]; }

  /// The samples at `indices` (a 1-D int64 or int32 CPU tensor, each in [0, size()), repeats
  /// allowed), in that order: tensors of shape [indices.numel(), sizes[1:]...]. Safe from
  /// several threads at once.
  [[nodiscard]] Batch get(const at::Tensor& indices) const {
    const auto runs = runs_of(indices);
    Batch b;
    const auto last = open_->arrays.size() - 1;
    for (std::size_t a = 0; a < last; ++a) b.inputs.push_back(read(a, runs, indices.numel()));
    b.target = read(last, runs, indices.numel());
    return b;
  }

  [[nodiscard]] const std::filesystem::path& file() const noexcept { return open_->path; }
  /// The inputs, in the order of Batch::inputs.
  [[nodiscard]] std::span<const Array> inputs() const noexcept {
    return {open_->arrays.data(), open_->arrays.size() - 1};
  }
  [[nodiscard]] const Array& target() const noexcept { return open_->arrays.back(); }

 private:
  /// How to read one Array.
  struct Reader {
    H5::DataSet set;
    H5::DataType memory_type;  ///< what HDF5 converts to
    std::uint64_t offset = 0;  ///< of sample 0 in the file, where Array::direct
    std::size_t element_bytes = 0;
    std::size_t row_bytes = 0;  ///< one sample
    bool swap = false;          ///< of the bytes, after a pread
  };

  /// The file, while any copy of the dataset uses it.
  struct Open {
    std::filesystem::path path;
    std::optional<H5::H5File> file;
    std::vector<Array> arrays;  // the inputs, then the target
    std::vector<Reader> readers;
    int fd = -1;  // for the direct reads; -1 where there are none

    Open() = default;
    Open(const Open&) = delete;
    Open& operator=(const Open&) = delete;
    ~Open() {
      if (fd >= 0) ::close(fd);
      detail::Hdf5Lock lock;  // HDF5's objects close under it too
      readers.clear();
      file.reset();
    }

    static error fail(const std::filesystem::path& path, const std::string& what) {
      return error("Hdf5Dataset", -1, path.string() + ": " + what);
    }

    /// Opens the dataset `name` and works out how to read it. Hold Hdf5Lock.
    void add(const std::string& name, const Options& options) {
      const auto fail = [&](const std::string& what) { return Open::fail(path, "dataset '" + name + "' " + what); };
      auto set = [&] {
        try {
          return file->openDataSet(name);
        } catch (const H5::Exception& e) {
          throw Open::fail(path, "has no dataset '" + name + "' (" + detail::hdf5_error_text(e) + ")");
        }
      }();
      const auto space = set.getSpace();
      const int rank = space.getSimpleExtentType() == H5S_SIMPLE ? space.getSimpleExtentNdims() : 0;
      if (rank < 1) throw fail("is a scalar (or has no dataspace); its dimension 0 must index the samples");
      std::vector<hsize_t> dims(static_cast<std::size_t>(rank));
      space.getSimpleExtentDims(dims.data());

      const auto type = set.getDataType();
      auto element = detail::hdf5_element(type);
      if (!element)
        throw fail("has elements of type " + detail::hdf5_type_name(type) +
                   ", which Hdf5Dataset cannot read; it reads int8, uint8, int16, int32, int64, float32 and float64 "
                   "(either byte order) and h5py's bool");

      const auto plist = set.getCreatePlist();
      const int filters = plist.getNfilters();
      for (int f = 0; f < filters; ++f) {
        unsigned flags = 0, config = 0;
        std::size_t values = 0;
        char filter[64] = {};
        const auto id = H5Pget_filter2(plist.getId(), static_cast<unsigned>(f), &flags, &values, nullptr,
                                       sizeof filter, filter, &config);
        if (H5Zfilter_avail(id) <= 0)
          throw fail("is compressed with the filter '" + std::string(filter) + "' (id " + std::to_string(id) +
                     "), which this HDF5 library does not have: install its plugin (HDF5_PLUGIN_PATH), or rewrite "
                     "the file without it (h5repack -f NONE)");
      }
      H5Eclear2(H5E_DEFAULT);

      Array array{name, element->dtype, {}, false};
      Reader r{set, element->memory, 0, type.getSize(), type.getSize(), element->swap};
      for (std::size_t d = 0; d < dims.size(); ++d) {
        array.sizes.push_back(static_cast<std::int64_t>(dims[d]));
        if (d > 0) r.row_bytes *= dims[d];
      }
      if (options.direct_reads && plist.getLayout() == H5D_CONTIGUOUS && filters == 0 &&
          plist.getExternalCount() == 0) {
        const haddr_t offset = H5Dget_offset(set.getId());  // undefined until the storage is written
        H5Eclear2(H5E_DEFAULT);
        array.direct = offset != HADDR_UNDEF && set.getStorageSize() == dims[0] * r.row_bytes;
        r.offset = array.direct ? offset : 0;
      }
      arrays.push_back(std::move(array));
      readers.push_back(std::move(r));
    }

    /// The descriptor the direct reads pread from, where there are any.
    void open_descriptor() {
      bool direct = false;
      for (const auto& a : arrays) direct = direct || a.direct;
      if (!direct) return;
      fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) throw fail(path, "cannot open it for reading: " + std::generic_category().message(errno));
    }
  };

  /// Samples [first, first + count) of the file go to rows [at, at + count) of the batch.
  struct Run {
    std::int64_t first;
    std::int64_t at;
    std::int64_t count;
  };

  /// `indices` checked (detail::check_sample_indices) and cut into runs of consecutive
  /// samples, in their order.
  [[nodiscard]] std::vector<Run> runs_of(const at::Tensor& indices) const {
    std::string names;
    for (const auto& a : open_->arrays) names += (names.empty() ? "'" : ", '") + a.name + "'";
    const auto checked = paratrain::detail::check_sample_indices("Hdf5Dataset", indices, size(),
                                                                 open_->path.string() + ": ", "datasets " + names + " hold");
    const auto* p = checked.data_ptr<std::int64_t>();
    std::vector<Run> runs;
    for (std::int64_t k = 0; k < checked.numel(); ++k) {
      if (!runs.empty() && p[k] == runs.back().first + runs.back().count)
        ++runs.back().count;
      else
        runs.push_back({p[k], k, 1});
    }
    return runs;
  }

  /// Array `a`'s samples in `runs`: a tensor of `n` rows.
  [[nodiscard]] at::Tensor read(std::size_t a, const std::vector<Run>& runs, std::int64_t n) const {
    const auto& array = open_->arrays[a];
    const auto& r = open_->readers[a];
    auto sizes = array.sizes;
    sizes[0] = n;
    auto out = at::empty(sizes, at::TensorOptions().dtype(array.dtype));
    auto* rows = static_cast<unsigned char*>(out.data_ptr());
    const auto fail = [&](const std::string& what) {
      return Open::fail(open_->path, "reading dataset '" + array.name + "' failed: " + what);
    };
    if (n == 0 || r.row_bytes == 0) return out;
    const auto bytes = [&](std::int64_t samples) { return static_cast<std::size_t>(samples) * r.row_bytes; };

    if (array.direct) {  // Note [Reading HDF5 without its lock]
      for (const auto& run : runs) {
        const auto problem = detail::pread_exactly(open_->fd, rows + bytes(run.at), bytes(run.count),
                                                   r.offset + bytes(run.first));
        if (!problem.empty()) throw fail(problem);
      }
      if (r.swap) detail::swap_bytes(rows, bytes(n) / r.element_bytes, r.element_bytes);
      return out;
    }

    detail::Hdf5Lock lock;
    try {
      auto file_space = r.set.getSpace();
      std::vector<hsize_t> start(array.sizes.size(), 0), count(array.sizes.begin(), array.sizes.end());
      for (const auto& run : runs) {
        start[0] = static_cast<hsize_t>(run.first);
        count[0] = static_cast<hsize_t>(run.count);
        file_space.selectHyperslab(H5S_SELECT_SET, count.data(), start.data());
        const H5::DataSpace memory_space(static_cast<int>(count.size()), count.data());
        r.set.read(rows + bytes(run.at), r.memory_type, memory_space, file_space);
      }
    } catch (const H5::Exception& e) {
      throw fail(detail::hdf5_error_text(e));
    }
    return out;
  }

  std::shared_ptr<const Open> open_;
};

}  // namespace paratrain::data
