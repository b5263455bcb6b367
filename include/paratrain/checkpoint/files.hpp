#pragma once
/// \file
/// The file operations checkpoints are made of: whole writes, positioned reads, fsync,
/// atomic replacement. Failures throw checkpoint::detail::file_error naming the path.

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

namespace paratrain::checkpoint::detail {

namespace fs = std::filesystem;

/// A failed file operation: "<path>: <what>: <strerror>".
struct file_error : std::runtime_error {
  file_error(const fs::path& path, const std::string& what, int err)
      : std::runtime_error(path.string() + ": " + what + (err ? std::string(": ") + std::strerror(err) : "")) {}
};

/// An open file descriptor, closed on destruction.
class File {
 public:
  File(const fs::path& path, int flags, mode_t mode = 0644) : path_(path), fd_(::open(path.c_str(), flags | O_CLOEXEC, mode)) {
    if (fd_ < 0) throw file_error(path, (flags & (O_WRONLY | O_RDWR)) ? "cannot create" : "cannot open", errno);
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() {
    if (fd_ >= 0) ::close(fd_);
  }

  void write_at(const void* data, std::size_t size, std::int64_t offset) const {
    const auto* p = static_cast<const char*>(data);
    while (size > 0) {
      const auto n = ::pwrite(fd_, p, size, offset);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw file_error(path_, "write failed", n < 0 ? errno : ENOSPC);
      p += n, size -= static_cast<std::size_t>(n), offset += n;
    }
  }
  void read_at(void* data, std::size_t size, std::int64_t offset) const {
    auto* p = static_cast<char*>(data);
    while (size > 0) {
      const auto n = ::pread(fd_, p, size, offset);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw file_error(path_, "read failed", errno);
      if (n == 0) throw file_error(path_, "ends early (truncated)", 0);
      p += n, size -= static_cast<std::size_t>(n), offset += n;
    }
  }
  /// Makes what was written durable, and the file's final size `size`.
  void finish(std::int64_t size) const {
    if (::ftruncate(fd_, size) != 0) throw file_error(path_, "cannot set its size", errno);
    if (::fsync(fd_) != 0) throw file_error(path_, "fsync failed", errno);
  }
  [[nodiscard]] std::int64_t size() const {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) throw file_error(path_, "cannot stat", errno);
    return st.st_size;
  }
  [[nodiscard]] const fs::path& path() const noexcept { return path_; }

 private:
  fs::path path_;
  int fd_;
};

/// Makes a directory's entries (a rename, a new file) durable.
inline void sync_directory(const fs::path& dir) {
  // Some file systems refuse fsync on a directory (EINVAL): their renames are durable anyway.
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw file_error(dir, "cannot open", errno);
  const int rc = ::fsync(fd), err = errno;
  ::close(fd);
  if (rc != 0 && err != EINVAL) throw file_error(dir, "fsync failed", err);
}

/// Renames `from` to `to`, replacing a file `to` atomically.
inline void rename_file(const fs::path& from, const fs::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) throw file_error(to, "cannot rename " + from.string() + " to it", errno);
}

/// Writes `bytes` to `path` as a whole or not at all: a temporary name, fsync, rename.
inline void write_file_atomically(const fs::path& path, const std::vector<char>& bytes) {
  const auto tmp = fs::path(path.string() + ".tmp");
  {
    File f(tmp, O_WRONLY | O_CREAT | O_TRUNC);
    f.write_at(bytes.data(), bytes.size(), 0);
    f.finish(static_cast<std::int64_t>(bytes.size()));
  }
  rename_file(tmp, path);
}

inline std::vector<char> read_file(const fs::path& path) {
  File f(path, O_RDONLY);
  std::vector<char> bytes(static_cast<std::size_t>(f.size()));
  f.read_at(bytes.data(), bytes.size(), 0);
  return bytes;
}

/// Bytes free for an unprivileged writer on the file system holding `dir`.
inline std::uint64_t free_bytes(const fs::path& dir) {
  struct statvfs st {};
  if (::statvfs(dir.c_str(), &st) != 0) throw file_error(dir, "cannot stat its file system", errno);
  return static_cast<std::uint64_t>(st.f_bavail) * st.f_frsize;
}

/// Puts directory `from` at `to`, atomically also where `to` exists: the two are
/// exchanged (renameat2's RENAME_EXCHANGE) and the old one removed.
inline void publish_directory(const fs::path& from, const fs::path& to) {
  if (!fs::exists(to)) return rename_file(from, to);
#ifdef RENAME_EXCHANGE
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) == 0) {
    fs::remove_all(from);  // now the old one
    return;
  }
#endif
  // No exchange on this file system: move the old one aside first (a crash in between
  // leaves it under `from`.old, still whole).
  const auto old = fs::path(from.string() + ".old");
  fs::remove_all(old);
  rename_file(to, old);
  rename_file(from, to);
  fs::remove_all(old);
}

}  // namespace paratrain::checkpoint::detail
