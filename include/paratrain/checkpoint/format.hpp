#pragma once
/// \file
/// The on-disk format of a training checkpoint (docs/checkpoints.md): what is in which
/// file, and the reading side's table of every chunk. Note [Checkpoint format].

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "paratrain/checkpoint/files.hpp"
#include "paratrain/concepts/optimizer_state.hpp"
#include "paratrain/checkpoint/zip_check.hpp"
#include "paratrain/util/crc32c.hpp"

namespace paratrain::checkpoint {

// The optimizer-state schema is below both strategies and checkpoints (concepts/); its
// checkpoint spellings, as before.
using paratrain::Dict;
using paratrain::known_optimizer;
using paratrain::make_dict;
using paratrain::optimizer_schema;
using paratrain::ParamStateTensors;
using paratrain::schema_of;

// Note [Checkpoint format]
// A checkpoint is a directory, <dir>/step-<9 digits>, holding
//   index.pt            written last, by rank 0: a torch.save'd dict (LibTorch's pickle_save)
//   rank-<5 digits>.pt  one per saving rank: its chunk table and per-rank extras (a dict)
//   rank-<5 digits>.bin one per saving rank: the chunks' raw bytes, 64-byte aligned
// A chunk is a flat, row-major range [begin, begin + numel) of one named tensor (its
// key): "model/<name>" for parameters and buffers, "optim/<name>/<field>" for optimizer
// state ("optim/<name>/step" a 0-dim int64), "rng/cpu/<rank>" for generator states, and
// "rng/cuda/<rank>" for the generator of the rank's GPU where its model is on one.
// Every element of every tensor is in exactly one chunk: a replicated tensor is written
// by one rank, chosen to balance the bytes. Loading is by key and range alone, so
// any strategy at any world size reads what any other wrote (resharding).
// The directory is written as .step-<9 digits>.partial and renamed to its name only
// when every file is durable (fsync) and the index, with every rank file's size and
// CRC-32C, is in it: a checkpoint exists whole or not at all.

inline constexpr const char* format_name = "paratrain checkpoint";
inline constexpr std::int64_t format_version = 1;
inline constexpr std::int64_t alignment = 64;

namespace fs = std::filesystem;

namespace detail {

/// Each parameter's group index in `optimizer`, by the parameter's storage.
inline std::map<const void*, int> group_index(torch::optim::Optimizer& optimizer) {
  std::map<const void*, int> group;
  const auto& groups = optimizer.param_groups();
  for (std::size_t g = 0; g < groups.size(); ++g)
    for (const auto& p : groups[g].params()) group.emplace(p.unsafeGetTensorImpl(), static_cast<int>(g));
  return group;
}


inline std::string numbered(const char* prefix, std::int64_t n, int digits, const char* suffix = "") {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%s%0*lld%s", prefix, digits, static_cast<long long>(n), suffix);
  return buf;
}
inline std::string rank_meta_name(int rank) { return numbered("rank-", rank, 5, ".pt"); }
inline std::string rank_data_name(int rank) { return numbered("rank-", rank, 5, ".bin"); }
inline constexpr const char* index_name = "index.pt";

// The names Note [Checkpoint format] gives: directories and tensor keys.
inline constexpr const char* step_prefix = "step-";
inline constexpr int step_digits = 9;
inline std::string step_name(std::int64_t step) { return numbered(step_prefix, step, step_digits); }
/// Where a save of `step` is written before it is published.
inline std::string partial_name(std::int64_t step) { return numbered(".step-", step, step_digits, ".partial"); }
/// What a save killed mid-write leaves: a partial directory, or one set aside while publishing.
inline bool is_leftover(const std::string& name) {
  return name.starts_with(".step-") && (name.ends_with(".partial") || name.ends_with(".partial.old"));
}
inline constexpr std::string_view model_prefix = "model/";
inline std::string model_key(const std::string& name) { return std::string(model_prefix) + name; }
inline std::string optim_key(const std::string& name, const std::string& field) { return "optim/" + name + "/" + field; }
inline std::string rng_key(int rank) { return "rng/cpu/" + std::to_string(rank); }
inline std::string cuda_rng_key(int rank) { return "rng/cuda/" + std::to_string(rank); }

/// The default generator of `device` where it is a GPU (dropout's there), else none. Through
/// ATen's device-generic Context, so that this compiles against a LibTorch without CUDA.
inline std::optional<at::Generator> device_generator(at::Device device) {
  if (!device.is_cuda()) return std::nullopt;
  return at::globalContext().defaultGenerator(device);
}

/// PyTorch's dtype names, so that Python can read a chunk with `getattr(torch, dtype)`.
inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: return c10::toString(t);
  }
}
inline std::optional<at::ScalarType> dtype_of(const std::string& name) {
  for (auto t : {at::kFloat, at::kDouble, at::kHalf, at::kBFloat16, at::kLong, at::kInt, at::kShort, at::kChar,
                 at::kByte, at::kBool})
    if (dtype_name(t) == name) return t;
  return std::nullopt;
}

inline std::int64_t numel_of(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

inline std::string shape_string(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

inline Dict read_dict(const fs::path& path, const std::vector<char>& bytes) {
  if (const auto damage = zip_damage(bytes))  // Note [Zip checksums]
    throw file_error(path, "is not a paratrain checkpoint file, or is corrupt: " + *damage, 0);
  try {
    auto v = torch::pickle_load(bytes);
    if (!v.isGenericDict()) throw std::runtime_error("not a dict");
    return v.toGenericDict();
  } catch (const c10::Error& e) {
    throw file_error(path, std::string("is not a paratrain checkpoint file (") + e.what_without_backtrace() + ")", 0);
  } catch (const std::exception& e) {
    throw file_error(path, std::string("is not a paratrain checkpoint file (") + e.what() + ")", 0);
  }
}

// A typed read of dict entry `key`, or an error naming the file.
template <class T>
T field(const fs::path& file, const Dict& d, const char* key) {
  const auto it = d.find(key);
  if (it == d.end()) throw file_error(file, std::string("has no '") + key + "' entry (corrupt or not a checkpoint)", 0);
  const auto& v = it->value();
  if constexpr (std::is_same_v<T, std::int64_t>) {
    if (v.isInt()) return v.toInt();
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (v.isString()) return v.toStringRef();
  } else if constexpr (std::is_same_v<T, Dict>) {
    if (v.isGenericDict()) return v.toGenericDict();
  } else if constexpr (std::is_same_v<T, c10::List<c10::IValue>>) {
    if (v.isList()) return v.toList();
  } else if constexpr (std::is_same_v<T, std::vector<std::int64_t>>) {
    if (v.isIntList()) return v.toIntVector();
    if (v.isList() && v.toList().empty()) return {};
  }
  throw file_error(file, std::string("entry '") + key + "' has the wrong type (corrupt or not a checkpoint)", 0);
}

}  // namespace detail

/// One chunk of a named tensor in a rank's data file.
struct Chunk {
  int file = 0;              ///< the saving rank
  std::int64_t begin = 0;    ///< flat offset in the whole tensor
  std::int64_t numel = 0;
  std::int64_t offset = 0;   ///< byte offset in the data file
  std::uint32_t crc32c = 0;  ///< of its bytes
};

/// Everything the files say of one key.
struct TensorRecord {
  at::ScalarType dtype = at::kFloat;
  std::vector<std::int64_t> shape;
  std::vector<Chunk> chunks;
};

/// A complete checkpoint's index and every rank's chunk table, validated: each file
/// exists, has the size and CRC-32C the index records.
struct Contents {
  fs::path path;
  std::int64_t step = 0;
  int world_size = 0;  ///< ranks that saved it
  std::string optimizer;
  c10::List<c10::IValue> param_groups{c10::AnyType::get()};
  Dict extra = make_dict();
  std::vector<Dict> rank_extra;               ///< [saving rank]
  std::map<std::string, int> group_of;        ///< parameter name -> parameter group
  std::map<std::string, TensorRecord> tensors;
  std::vector<std::int64_t> data_bytes;       ///< [saving rank]

  [[nodiscard]] fs::path data_file(int rank) const { return path / detail::rank_data_name(rank); }
  [[nodiscard]] const TensorRecord* find(const std::string& key) const {
    const auto it = tensors.find(key);
    return it == tensors.end() ? nullptr : &it->second;
  }
};

namespace detail {

/// Whether `chunk` lies inside a tensor of `shape` (no negative dimension, its element
/// count representable) and inside a data file of `file_bytes` bytes, without overflow.
inline bool chunk_fits(const Chunk& chunk, const std::vector<std::int64_t>& shape, std::size_t element,
                       std::int64_t file_bytes) {
  constexpr auto max = std::numeric_limits<std::int64_t>::max();
  std::int64_t total = 1;
  for (const auto d : shape) {
    if (d < 0 || (d != 0 && total > max / d)) return false;
    total *= d;
  }
  const auto e = static_cast<std::int64_t>(element);
  return chunk.begin >= 0 && chunk.numel >= 0 && chunk.begin <= total - chunk.numel && chunk.offset >= 0 &&
         chunk.numel <= (max - chunk.offset) / e && chunk.offset + chunk.numel * e <= file_bytes;
}

}  // namespace detail

namespace detail {

/// The index of the checkpoint directory `path`, its format and version checked.
inline Dict read_index(const fs::path& path) {
  if (!fs::is_directory(path)) throw file_error(path, "is not a checkpoint directory", ENOENT);
  const auto index_path = path / index_name;
  if (!fs::exists(index_path))
    throw file_error(path, "has no index.pt: the checkpoint is incomplete (still being written, or its writer was "
                           "killed); load an earlier one",
                     0);
  auto index = read_dict(index_path, read_file(index_path));
  if (field<std::string>(index_path, index, "format") != format_name)
    throw file_error(index_path, "is not a paratrain checkpoint index", 0);
  if (const auto v = field<std::int64_t>(index_path, index, "version"); v != format_version)
    throw file_error(index_path, "has format version " + std::to_string(v) + "; this paratrain reads version " +
                                     std::to_string(format_version),
                     0);
  return index;
}

}  // namespace detail

/// What the saver added to the index of the checkpoint directory `path` (Checkpointer::save's
/// `extra`), read without its tensors: fit's loop position, for one.
inline Dict read_extra(const fs::path& path) {
  return detail::field<Dict>(path / detail::index_name, detail::read_index(path), "extra");
}

/// Reads and checks the index and chunk tables of the checkpoint directory `path`.
inline Contents read_contents(const fs::path& path) {
  using detail::field;
  using detail::file_error;
  Contents c;
  c.path = path;
  const auto index_path = path / detail::index_name;
  const auto index = detail::read_index(path);
  c.step = field<std::int64_t>(index_path, index, "step");
  c.world_size = static_cast<int>(field<std::int64_t>(index_path, index, "world_size"));
  c.optimizer = field<std::string>(index_path, index, "optimizer");
  c.param_groups = field<c10::List<c10::IValue>>(index_path, index, "param_groups");
  c.extra = field<Dict>(index_path, index, "extra");
  const auto ranks = field<c10::List<c10::IValue>>(index_path, index, "ranks");
  if (static_cast<int>(ranks.size()) != c.world_size || c.world_size < 1)
    throw file_error(index_path, "lists " + std::to_string(ranks.size()) + " rank files for a world of " +
                                     std::to_string(c.world_size) + " (corrupt)",
                     0);
  for (int r = 0; r < c.world_size; ++r) {
    const auto entry = ranks.get(static_cast<std::size_t>(r));
    if (!entry.isGenericDict()) throw file_error(index_path, "has a malformed rank entry (corrupt)", 0);
    const auto e = entry.toGenericDict();
    const auto meta_path = path / detail::rank_meta_name(r);
    if (!fs::exists(meta_path)) throw file_error(meta_path, "is missing: the checkpoint lacks rank " + std::to_string(r) + "'s shard", ENOENT);
    const auto bytes = detail::read_file(meta_path);
    if (static_cast<std::int64_t>(bytes.size()) != field<std::int64_t>(index_path, e, "meta_bytes"))
      throw file_error(meta_path, "has " + std::to_string(bytes.size()) + " bytes, the index says " +
                                      std::to_string(field<std::int64_t>(index_path, e, "meta_bytes")) + " (truncated or replaced)",
                       0);
    if (paratrain::detail::crc32c_extend(0, bytes.data(), bytes.size()) !=
        static_cast<std::uint32_t>(field<std::int64_t>(index_path, e, "meta_crc32c")))
      throw file_error(meta_path, "fails its checksum (the file is corrupt)", 0);
    c.data_bytes.push_back(field<std::int64_t>(index_path, e, "data_bytes"));
    const auto meta = detail::read_dict(meta_path, bytes);
    c.rank_extra.push_back(field<Dict>(meta_path, meta, "extra"));
    for (const auto& g : field<Dict>(meta_path, meta, "groups")) {
      if (!g.key().isString() || !g.value().isInt())
        throw file_error(meta_path, "has a malformed parameter group entry (corrupt)", 0);
      c.group_of[g.key().toStringRef()] = static_cast<int>(g.value().toInt());
    }
    for (const auto& item : field<c10::List<c10::IValue>>(meta_path, meta, "chunks")) {
      if (!item.get().isGenericDict()) throw file_error(meta_path, "has a malformed chunk entry (corrupt)", 0);
      const auto ch = item.get().toGenericDict();
      const auto key = field<std::string>(meta_path, ch, "key");
      const auto dtype = detail::dtype_of(field<std::string>(meta_path, ch, "dtype"));
      if (!dtype) throw file_error(meta_path, "chunk '" + key + "' has an unknown dtype", 0);
      const auto shape = field<std::vector<std::int64_t>>(meta_path, ch, "shape");
      const Chunk chunk{r, field<std::int64_t>(meta_path, ch, "begin"), field<std::int64_t>(meta_path, ch, "numel"),
                        field<std::int64_t>(meta_path, ch, "offset"),
                        static_cast<std::uint32_t>(field<std::int64_t>(meta_path, ch, "crc32c"))};
      const bool known = c.tensors.count(key) != 0;
      auto& record = c.tensors[key];
      if (known && (record.dtype != *dtype || record.shape != shape))
        throw file_error(meta_path, "chunk '" + key + "' disagrees with another chunk of it on its dtype or shape (corrupt)", 0);
      record.dtype = *dtype;
      record.shape = shape;
      if (!detail::chunk_fits(chunk, shape, c10::elementSize(*dtype), c.data_bytes.back()))
        throw file_error(meta_path, "chunk '" + key + "' lies outside its tensor or its data file (corrupt)", 0);
      record.chunks.push_back(chunk);
    }
  }
  return c;
}

/// Reads the chunks of a checkpoint's data files, each checked against its CRC-32C.
class ChunkReader {
 public:
  explicit ChunkReader(const Contents& c) : contents_(&c), files_(static_cast<std::size_t>(c.world_size)) {}

  /// Elements [begin, begin + numel) of the tensor `record` describes (named `key`), as
  /// saved: a flat CPU tensor of its dtype.
  at::Tensor read(const std::string& key, const TensorRecord& record, std::int64_t begin, std::int64_t numel) {
    auto out = at::empty({numel}, at::TensorOptions().dtype(record.dtype));
    const auto element = static_cast<std::int64_t>(out.element_size());
    auto* dst = static_cast<char*>(out.data_ptr());
    std::int64_t covered = 0;
    for (const auto& chunk : record.chunks) {
      if (numel == 0) break;
      const auto lo = std::max(begin, chunk.begin), hi = std::min(begin + numel, chunk.begin + chunk.numel);
      if (lo >= hi) continue;
      const auto bytes = static_cast<std::size_t>(chunk.numel * element);
      // A chunk that is exactly the range goes straight into `out`; else through a buffer.
      const bool direct = chunk.begin == begin && chunk.numel == numel;
      if (!direct) buffer_.resize(bytes);
      char* into = direct ? dst : buffer_.data();
      auto& file = open(chunk.file);
      if (chunk.offset < 0 || chunk.offset + static_cast<std::int64_t>(bytes) > contents_->data_bytes[static_cast<std::size_t>(chunk.file)])
        throw detail::file_error(file.path(), "chunk '" + key + "' lies outside the file (corrupt index)", 0);
      file.read_at(into, bytes, chunk.offset);
      if (paratrain::detail::crc32c_extend(0, into, bytes) != chunk.crc32c)
        throw detail::file_error(file.path(), "chunk '" + key + "' [" + std::to_string(chunk.begin) + ", " +
                                                  std::to_string(chunk.begin + chunk.numel) +
                                                  ") fails its checksum (the file is corrupt)",
                                 0);
      if (!direct) std::memcpy(dst + (lo - begin) * element, into + (lo - chunk.begin) * element, static_cast<std::size_t>((hi - lo) * element));
      covered += hi - lo;
    }
    if (covered != numel)
      throw detail::file_error(contents_->path, "holds " + std::to_string(covered) + " of the " + std::to_string(numel) +
                                                    " elements of '" + key + "' this rank needs (a shard is missing)",
                               0);
    return out;
  }

 private:
  detail::File& open(int rank) {
    auto& f = files_[static_cast<std::size_t>(rank)];
    if (!f) {
      const auto path = contents_->data_file(rank);
      if (!fs::exists(path)) throw detail::file_error(path, "is missing: the checkpoint lacks rank " + std::to_string(rank) + "'s shard", ENOENT);
      f = std::make_unique<detail::File>(path, O_RDONLY);
      if (f->size() != contents_->data_bytes[static_cast<std::size_t>(rank)])
        throw detail::file_error(path, "has " + std::to_string(f->size()) + " bytes, the index says " +
                                           std::to_string(contents_->data_bytes[static_cast<std::size_t>(rank)]) +
                                           " (truncated)",
                                 0);
    }
    return *f;
  }

  const Contents* contents_;
  std::vector<std::unique_ptr<detail::File>> files_;
  std::vector<char> buffer_;
};

}  // namespace paratrain::checkpoint
