#pragma once
/// \file
/// What data::Hdf5Dataset stands on: one lock for paratrain's HDF5 calls, HDF5's errors
/// as text, HDF5's element types as LibTorch's, and rows read with pread. Part of
/// paratrain::hdf5.

#include <H5Cpp.h>
#include <c10/core/ScalarType.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>

namespace paratrain::detail {

/// Held around every call paratrain makes into HDF5.
///
/// HDF5's C++ API is not thread-safe, not even over a C library built thread-safe (that
/// build locks the C API's calls only), so paratrain's calls take this lock. It is
/// process-wide, the one piece of global state in paratrain::hdf5, because the library it
/// guards is process-wide. What paratrain reads without HDF5 does not take it: Note
/// [Reading HDF5 without its lock] (data/hdf5/hdf5_dataset.hpp).
///
/// HDF5 prints its error stack to stderr when a call fails, and that setting is per
/// thread in a thread-safe build, so taking the lock also turns the printing off on the
/// calling thread: hdf5_error_text folds the stack into paratrain's message instead.
class Hdf5Lock {
 public:
  Hdf5Lock() : lock_(mutex()) { H5::Exception::dontPrint(); }

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  std::lock_guard<std::mutex> lock_;
};

/// What HDF5 said about its last failure on this thread: the API call and its innermost,
/// most specific, description, e.g. "H5Dopen2: object 'nope' doesn't exist"; `fallback`
/// where the stack is empty. Clears the stack. Hold Hdf5Lock.
inline std::string hdf5_error_text(const std::string& fallback = "no details") {
  struct Walk {
    std::string api;
    std::string detail;
  } walk;
  H5Ewalk2(
      H5E_DEFAULT, H5E_WALK_DOWNWARD,  // from the API call inwards: the last entry is the innermost
      [](unsigned, const H5E_error2_t* e, void* data) -> herr_t {
        auto& w = *static_cast<Walk*>(data);
        if (w.api.empty() && e->func_name != nullptr) w.api = e->func_name;
        if (e->desc != nullptr && *e->desc != '\0') w.detail = e->desc;
        return 0;
      },
      &walk);
  H5Eclear2(H5E_DEFAULT);
  if (walk.detail.empty()) return fallback;
  return walk.api.empty() ? walk.detail : walk.api + ": " + walk.detail;
}

/// hdf5_error_text for a C++ API exception: the stack where it has one, else the
/// exception's own "function: message". Hold Hdf5Lock.
inline std::string hdf5_error_text(const H5::Exception& e) {
  return hdf5_error_text(e.getFuncName() + ": " + e.getDetailMsg());
}

/// How an HDF5 element type is read into a tensor.
struct Hdf5Element {
  c10::ScalarType dtype;
  H5::DataType memory;  ///< what HDF5 converts to when it reads: the native type, or the file's (bool)
  bool swap;            ///< stored in the other byte order than this machine's: swap after pread
};

/// How to read `type`, or nothing where Hdf5Dataset cannot: int8, uint8, int16, int32,
/// int64, float32 and float64 (IEEE) in either byte order, and h5py's bool, an enum over
/// a 1-byte integer with members FALSE = 0 and TRUE = 1, read as uint8 (its bytes are
/// the 0s and 1s a uint8 holds; kBool could not hold another byte the file might have).
/// Hold Hdf5Lock.
inline std::optional<Hdf5Element> hdf5_element(const H5::DataType& type) {
  constexpr bool little = std::endian::native == std::endian::little;
  struct Known {
    const H5::PredType& le;
    const H5::PredType& be;
    const H5::PredType& native;
    c10::ScalarType dtype;
  };
  // Here, not at namespace scope: HDF5 makes its predefined types when the library starts.
  const Known known[] = {
      {H5::PredType::STD_I8LE, H5::PredType::STD_I8BE, H5::PredType::NATIVE_INT8, c10::kChar},
      {H5::PredType::STD_U8LE, H5::PredType::STD_U8BE, H5::PredType::NATIVE_UINT8, c10::kByte},
      {H5::PredType::STD_I16LE, H5::PredType::STD_I16BE, H5::PredType::NATIVE_INT16, c10::kShort},
      {H5::PredType::STD_I32LE, H5::PredType::STD_I32BE, H5::PredType::NATIVE_INT32, c10::kInt},
      {H5::PredType::STD_I64LE, H5::PredType::STD_I64BE, H5::PredType::NATIVE_INT64, c10::kLong},
      {H5::PredType::IEEE_F32LE, H5::PredType::IEEE_F32BE, H5::PredType::NATIVE_FLOAT, c10::kFloat},
      {H5::PredType::IEEE_F64LE, H5::PredType::IEEE_F64BE, H5::PredType::NATIVE_DOUBLE, c10::kDouble},
  };
  for (const auto& k : known) {
    // H5Tequal: the same class, size, sign, precision, offset, padding and byte order.
    if (type == k.le) return Hdf5Element{k.dtype, H5::DataType(k.native), !little};
    if (type == k.be) return Hdf5Element{k.dtype, H5::DataType(k.native), little};
  }
  const hid_t id = type.getId();
  if (type.getClass() != H5T_ENUM || type.getSize() != 1 || H5Tget_nmembers(id) != 2 ||
      type.getSuper().getClass() != H5T_INTEGER)
    return std::nullopt;
  // H5Tenum_nameof takes the value in the enum's own 1-byte type: 0 and 1 read alike
  // whatever its sign.
  for (std::int8_t value : {0, 1}) {
    char name[8] = {};
    if (H5Tenum_nameof(id, &value, name, sizeof name) < 0) {
      H5Eclear2(H5E_DEFAULT);  // not a member: not h5py's bool
      return std::nullopt;
    }
    if (std::strcmp(name, value == 0 ? "FALSE" : "TRUE") != 0) return std::nullopt;
  }
  return Hdf5Element{c10::kByte, type, false};  // read as stored: one byte, 0 or 1
}

/// `type` in words, for an error: "uint16", "float16", "int32 (big-endian) with a
/// non-standard bit layout", "variable-length string", ... Hold Hdf5Lock.
inline std::string hdf5_type_name(const H5::DataType& type) {
  const hid_t id = type.getId();
  const auto bits = std::to_string(8 * type.getSize());
  const std::string order = H5Tget_order(id) == H5T_ORDER_BE ? " (big-endian)" : "";
  switch (type.getClass()) {
    case H5T_INTEGER:
      return (H5Tget_sign(id) == H5T_SGN_NONE ? "uint" : "int") + bits + order +
             (H5Tget_precision(id) != 8 * type.getSize() ? " with a non-standard bit layout" : "");
    case H5T_FLOAT: return "float" + bits + order;
    case H5T_STRING:
      return H5Tis_variable_str(id) > 0 ? "variable-length string" : "fixed-length string of " + bits + " bits";
    case H5T_ENUM: return "an enum of " + bits + " bits (not h5py's bool: FALSE = 0, TRUE = 1 over int8)";
    case H5T_COMPOUND: return "compound (a record of fields)";
    case H5T_ARRAY: return "array (of elements of a fixed shape)";
    case H5T_VLEN: return "variable-length sequence";
    case H5T_REFERENCE: return "reference";
    case H5T_OPAQUE: return "opaque";
    case H5T_BITFIELD: return "bitfield";
    case H5T_TIME: return "time";
    default: return "an unknown class of type";
  }
}

/// Reads `bytes` bytes at `offset` of `fd` into `out`, in as many preads as it takes.
/// "" when all were read, else what went wrong. Safe from any number of threads on one
/// descriptor: pread moves no file position. Note [Reading HDF5 without its lock].
inline std::string pread_exactly(int fd, void* out, std::size_t bytes, std::uint64_t offset) {
  auto* to = static_cast<unsigned char*>(out);
  while (bytes > 0) {
    const auto n = ::pread(fd, to, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return std::generic_category().message(errno);
    if (n == 0) return "the file ends before byte " + std::to_string(offset + bytes) + " (truncated?)";
    to += n;
    bytes -= static_cast<std::size_t>(n);
    offset += static_cast<std::uint64_t>(n);
  }
  return {};
}

/// Reverses the bytes of each `U` of the `count` at `data`.
template <class U>
void swap_each(unsigned char* data, std::size_t count) {
  for (std::size_t i = 0; i < count; ++i, data += sizeof(U)) {
    U v;
    std::memcpy(&v, data, sizeof v);
    if constexpr (sizeof(U) == 2) v = __builtin_bswap16(v);
    if constexpr (sizeof(U) == 4) v = __builtin_bswap32(v);
    if constexpr (sizeof(U) == 8) v = __builtin_bswap64(v);
    std::memcpy(data, &v, sizeof v);
  }
}

/// Reverses the bytes of each of the `count` elements of `size` bytes (1, 2, 4 or 8) at
/// `data`: big-endian to this machine's order, or back.
inline void swap_bytes(void* data, std::size_t count, std::size_t size) {
  auto* p = static_cast<unsigned char*>(data);
  switch (size) {
    case 2: swap_each<std::uint16_t>(p, count); break;
    case 4: swap_each<std::uint32_t>(p, count); break;
    case 8: swap_each<std::uint64_t>(p, count); break;
    default: break;  // one byte has no order
  }
}

}  // namespace paratrain::detail
