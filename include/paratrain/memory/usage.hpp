#pragma once
/// \file
/// paratrain::memory::usage — where this process's resident memory is: the heap (glibc's
/// arenas, what of them is free, its mapped blocks), other anonymous memory, shared memory
/// (Open MPI's shared-memory transport), and mapped files (code), with the resident set and
/// its peak. The breakdown of a peak beside paratrain::plan::peak (docs/benchmarks.md).

#include <cstddef>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace paratrain::memory {

/// This process's memory now, in bytes (Linux: /proc/self/status and smaps; glibc's
/// mallinfo2). Fields a platform cannot tell stay 0.
struct Usage {
  std::int64_t resident = 0;       ///< VmRSS
  std::int64_t peak_resident = 0;  ///< VmHWM: the most resident so far
  /// Of the resident set, by mapping: glibc's main heap ([heap]), other anonymous memory
  /// (thread arenas, mapped large blocks, thread stacks, libraries' scratch), shared memory
  /// (/dev/shm: Open MPI's shared-memory transport) and mapped files (code, read-only data).
  std::int64_t heap_resident = 0;
  std::int64_t anonymous_resident = 0;
  std::int64_t shared_resident = 0;
  std::int64_t file_resident = 0;
  /// glibc's own account, over all its arenas: bytes handed out and not freed, bytes free
  /// but kept (holes and the top it does not trim: Note [Allocator]), and blocks mapped on
  /// their own.
  std::int64_t heap_in_use = 0;
  std::int64_t heap_free = 0;
  std::int64_t heap_mapped = 0;
};

namespace detail {

/// The kB value of a "Name:   123 kB" line, in bytes.
inline std::int64_t kb_field(const std::string& line) {
  std::istringstream in(line.substr(line.find(':') + 1));
  std::int64_t kb = 0;
  in >> kb;
  return kb * 1024;
}

}  // namespace detail

/// This process's memory now (Usage).
inline Usage usage() {
  Usage u;
  {
    std::ifstream status("/proc/self/status");
    for (std::string line; std::getline(status, line);) {
      if (line.rfind("VmRSS:", 0) == 0) u.resident = detail::kb_field(line);
      if (line.rfind("VmHWM:", 0) == 0) u.peak_resident = detail::kb_field(line);
    }
  }
  {
    // A mapping's header line ("start-end perms offset dev inode [path]") starts its block;
    // its Rss line counts it under the path's class.
    std::ifstream smaps("/proc/self/smaps");
    std::int64_t* into = nullptr;
    for (std::string line; std::getline(smaps, line);) {
      const auto space = line.find(' ');
      const bool header = space != std::string::npos && line.find('-') < space;
      if (header) {
        std::istringstream fields(line);
        std::string range, perms, offset, dev, inode, path;
        fields >> range >> perms >> offset >> dev >> inode;
        std::getline(fields >> std::ws, path);
        if (path == "[heap]") into = &u.heap_resident;
        else if (path.rfind("/dev/shm/", 0) == 0 || path.rfind("/SYSV", 0) == 0) into = &u.shared_resident;
        else if (path.empty() || path[0] == '[') into = &u.anonymous_resident;
        else into = &u.file_resident;
      } else if (into != nullptr && line.rfind("Rss:", 0) == 0) {
        *into += detail::kb_field(line);
      }
    }
  }
#if defined(__GLIBC__) && (__GLIBC__ > 2 || __GLIBC_MINOR__ >= 33)
  const auto m = mallinfo2();
  u.heap_in_use = static_cast<std::int64_t>(m.uordblks);
  u.heap_free = static_cast<std::int64_t>(m.fordblks);
  u.heap_mapped = static_cast<std::int64_t>(m.hblkhd);
#endif
  return u;
}

}  // namespace paratrain::memory
