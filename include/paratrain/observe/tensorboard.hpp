#pragma once
/// \file
/// paratrain::observe::TensorBoardWriter — scalars in TensorBoard's event-file format,
/// with no protobuf or TensorFlow dependency.

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <system_error>

#include "paratrain/util/crc32c.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain::observe {

// Note [Event file format]
// An event file is a sequence of TFRecords:
//   uint64 length, uint32 masked_crc32c(length bytes), data, uint32 masked_crc32c(data)
// (little-endian; detail::masked_crc32c). Each `data` is a serialised tensorflow.Event:
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }
//   Value   { string tag = 1; float simple_value = 2; }
// The first event carries file_version "brain.Event:2"; TensorBoard reads every file
// whose name contains "tfevents" in a directory as one run. The few protobuf encodings
// needed (varint, fixed64, fixed32, length-delimited) are written by hand below.

namespace detail {

inline void put_varint(std::string& out, std::uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

template <class T>
void put_fixed(std::string& out, T value) {  // little-endian, as protobuf and TFRecord want
  std::uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof value);
  for (std::size_t i = 0; i < sizeof value; ++i) out.push_back(static_cast<char>((bits >> (8 * i)) & 0xFF));
}

// A field's key: (number << 3) | wire type (0 varint, 1 fixed64, 2 length-delimited, 5 fixed32).
inline void put_key(std::string& out, int field, int wire_type) {
  put_varint(out, static_cast<std::uint64_t>(field << 3 | wire_type));
}

inline void put_bytes(std::string& out, int field, std::string_view bytes) {
  put_key(out, field, 2);
  put_varint(out, bytes.size());
  out.append(bytes);
}

inline std::string event_header(double wall_time, std::int64_t step) {
  std::string e;
  put_key(e, 1, 1);
  put_fixed(e, wall_time);
  if (step != 0) {  // proto3: a zero is simply absent
    put_key(e, 2, 0);
    put_varint(e, static_cast<std::uint64_t>(step));  // int64: two's complement, as protobuf does
  }
  return e;
}

/// A serialised Event with file_version.
inline std::string file_version_event(double wall_time) {
  auto e = event_header(wall_time, 0);
  put_bytes(e, 3, "brain.Event:2");
  return e;
}

/// A serialised Event whose summary holds one simple_value per entry of `values`.
inline std::string scalars_event(double wall_time, std::int64_t step, const std::map<std::string, double>& values) {
  std::string summary;
  for (const auto& [tag, value] : values) {
    std::string v;
    put_bytes(v, 1, tag);
    put_key(v, 2, 5);
    put_fixed(v, static_cast<float>(value));
    put_bytes(summary, 1, v);
  }
  auto e = event_header(wall_time, step);
  put_bytes(e, 5, summary);
  return e;
}

/// One TFRecord around `data`.
inline std::string record(std::string_view data) {
  std::string r, length;
  put_fixed(length, static_cast<std::uint64_t>(data.size()));
  r += length;
  put_fixed(r, paratrain::detail::masked_crc32c(length));
  r += data;
  put_fixed(r, paratrain::detail::masked_crc32c(data));
  return r;
}

}  // namespace detail

/// Writes scalars into `<dir>/events.out.tfevents.<unix time>.<host>.<id>`, where
/// TensorBoard (`tensorboard --logdir <dir>`) finds them.
///
/// Not collective: any process may own one. fit() gives rank 0 one
/// (ObserveOptions::tensorboard_dir) and, when asked, every rank one of its own.
///
/// \code
///   paratrain::observe::TensorBoardWriter tb("runs/mlp");
///   tb.scalar("train/loss", 0.42, step);
///   tb.scalars({{"eval/loss", 0.5}, {"eval/accuracy", 0.83}}, step);  // one event
/// \endcode
class TensorBoardWriter {
 public:
  struct Options {
    /// The file name's last part, e.g. the rank; -1: the process id.
    int id = -1;
    /// Records are flushed to the file at most this often (and at destruction);
    /// 0: after every write.
    double flush_seconds = 0;
  };

  explicit TensorBoardWriter(const std::filesystem::path& dir) : TensorBoardWriter(dir, Options{}) {}
  TensorBoardWriter(const std::filesystem::path& dir, Options options) : options_(options) {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    char host[256] = "localhost";
    gethostname(host, sizeof host - 1);
    const auto now = std::chrono::system_clock::now().time_since_epoch();
    const auto id = std::to_string(options.id >= 0 ? options.id : static_cast<int>(getpid()));
    const auto base = "events.out.tfevents." + std::to_string(std::chrono::duration_cast<std::chrono::seconds>(now).count()) +
                      "." + host + "." + id;
    // Two writers in one second with one id would share a name: never overwrite.
    path_ = dir / base;
    for (int n = 1; std::filesystem::exists(path_); ++n) path_ = dir / (base + "." + std::to_string(n));
    file_ = std::fopen(path_.c_str(), "wb");
    if (file_ == nullptr)
      throw error("TensorBoardWriter", -1,
                  "cannot create '" + path_.string() + "': " + std::strerror(errno) + "; check that the directory is writable");
    write(detail::file_version_event(wall_time()));
    flush();
  }

  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;
  ~TensorBoardWriter() {
    if (file_ != nullptr) std::fclose(file_);
  }

  /// One scalar at `step`.
  void scalar(const std::string& tag, double value, std::int64_t step) { scalars({{tag, value}}, step); }

  /// Several scalars at `step`, in one event. Values are stored as float (simple_value).
  void scalars(const std::map<std::string, double>& values, std::int64_t step) {
    if (values.empty()) return;
    write(detail::scalars_event(wall_time(), step, values));
    if (options_.flush_seconds <= 0 || std::chrono::steady_clock::now() - last_flush_ >=
                                           std::chrono::duration<double>(options_.flush_seconds))
      flush();
  }

  void flush() {
    std::fflush(file_);
    last_flush_ = std::chrono::steady_clock::now();
  }

  [[nodiscard]] const std::filesystem::path& path() const noexcept { return path_; }

 private:
  static double wall_time() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  }

  void write(std::string_view event) {
    const auto r = detail::record(event);
    if (std::fwrite(r.data(), 1, r.size(), file_) != r.size())
      throw error("TensorBoardWriter", -1, "cannot write to '" + path_.string() + "': " + std::strerror(errno));
  }

  Options options_;
  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
  std::chrono::steady_clock::time_point last_flush_{};
};

}  // namespace paratrain::observe
