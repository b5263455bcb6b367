#pragma once
/// \file
/// The file operations checkpoints are made of: whole writes, positioned reads, fsync,
/// atomic replacement. Failures throw checkpoint::detail::file_error naming the path.

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
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
#include <system_error>
#include <vector>

namespace paratrain::checkpoint::detail {

namespace fs = std::filesystem;

/// A failed file operation: "<path>: <what>: <strerror>".
struct file_error : std::runtime_error {
  file_error(const fs::path& path, const std::string& what, int err)
      : std::runtime_error(path.string() + ": " + what + (err ? std::string(": ") + std::strerror(err) : "")) {}
};

// Note [No recursive std::filesystem]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// PyTorch's wheels since 2.5 export, from a libstdc++ linked into libtorch_cpu.so, symbols of
// std::filesystem (pytorch/pytorch#133437), and the dynamic linker binds a program's calls to
// them before the system's libstdc++. With the LibTorch of PyTorch 2.11's wheel,
// std::filesystem::remove_all jumped to address 0 (the first GPU run, an H200: a segfault in
// the first checkpoint test, at remove_all + 146). So what removes or lists a directory here is
// POSIX: remove_tree (nftw, depth first, links not followed) and entries (readdir), which
// libc alone provides; tests/static/filesystem.py keeps std::filesystem's directory walks
// out of include/. (The std::filesystem calls left here, create_directories, exists and the
// like, had not run on that machine when the crash came; whether they are bound to LibTorch's
// copies, and work there, is not known yet.)

/// Removes `path` and, if it is a directory, everything under it (symbolic links themselves,
/// not what they point to), as std::filesystem::remove_all does: no error where nothing is
/// there. Returns how many entries went; on failure sets `ec` and stops.
inline std::uintmax_t remove_tree(const fs::path& path, std::error_code& ec) noexcept {
  ec.clear();
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return 0;
    ec.assign(errno, std::generic_category());
    return static_cast<std::uintmax_t>(-1);
  }
  static thread_local std::uintmax_t removed;
  static thread_local int failure;
  removed = 0;
  failure = 0;
  const auto remove_one = [](const char* p, const struct stat*, int, struct FTW*) -> int {
    if (::remove(p) != 0 && errno != ENOENT) {
      failure = errno;
      return 1;
    }
    ++removed;
    return 0;
  };
  if (::nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS) != 0 || failure != 0) {
    ec.assign(failure != 0 ? failure : errno, std::generic_category());
    return static_cast<std::uintmax_t>(-1);
  }
  return removed;
}
/// remove_tree, throwing file_error.
inline std::uintmax_t remove_tree(const fs::path& path) {
  std::error_code ec;
  const auto n = remove_tree(path, ec);
  if (ec) throw file_error(path, "cannot remove", ec.value());
  return n;
}

/// The entries of directory `dir` (not "." and ".."), as paths under it, in no particular
/// order; none, with `ec` set, where it cannot be read.
inline std::vector<fs::path> entries(const fs::path& dir, std::error_code& ec) {
  ec.clear();
  std::vector<fs::path> out;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    ec.assign(errno, std::generic_category());
    return out;
  }
  errno = 0;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") out.push_back(dir / name);
    errno = 0;
  }
  if (errno != 0) ec.assign(errno, std::generic_category());
  ::closedir(d);
  return out;
}
/// entries, throwing file_error.
inline std::vector<fs::path> entries(const fs::path& dir) {
  std::error_code ec;
  auto out = entries(dir, ec);
  if (ec) throw file_error(dir, "cannot list", ec.value());
  return out;
}

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
    remove_tree(from);  // now the old one
    return;
  }
#endif
  // No exchange on this file system: move the old one aside first (a crash in between
  // leaves it under `from`.old, still whole).
  const auto old = fs::path(from.string() + ".old");
  remove_tree(old);
  rename_file(to, old);
  rename_file(from, to);
  remove_tree(old);
}

}  // namespace paratrain::checkpoint::detail
