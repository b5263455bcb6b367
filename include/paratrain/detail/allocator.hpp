#pragma once
/// \file
/// The process's heap settings for multi-MiB tensors: Note [Allocator].

#include <cstdlib>
#include <cstring>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace paratrain::detail {

// Note [Allocator]
// glibc serves every allocation above M_MMAP_THRESHOLD (128 KiB, raised dynamically up
// to 32 MiB as mmapped blocks are freed) with a fresh mmap, and returns heap tops above
// M_TRIM_THRESHOLD to the kernel. A training step allocates and frees the same
// multi-MiB temporaries every time (activations, gradients, optimizer scratch), so under
// those defaults each one is page-faulted anew every step: a LibTorch process with
// 1024x1024 layers ran 3.3x slower (28-30 against 96-98 steps/s, one process, one
// thread; docs/benchmarks.md). Raising both thresholds (mmap 64 MiB, trim 128 MiB)
// keeps those blocks on the heap for reuse; buffers above 64 MiB are still mapped and
// returned. We set them when the first strategy is built, so that every paratrain
// program is fast by default without a launcher's help, unless:
//   - the environment already sets MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_
//     (the user has chosen; glibc applies those at start-up), or
//   - PARATRAIN_MALLOC=default asks for glibc's own behaviour (the opt-out), or
//   - another allocator (jemalloc, tcmalloc) is preloaded: mallopt then does not reach it.
// The settings are process-wide and only move memory between "kept for reuse" and
// "returned to the kernel"; peak RSS grows by at most the freed blocks kept.

/// Applies Note [Allocator] once per process; later calls do nothing.
inline void tune_allocator() noexcept {
#if defined(__GLIBC__)
  static const bool done = [] {
    const char* choice = std::getenv("PARATRAIN_MALLOC");
    if (choice != nullptr && std::strcmp(choice, "default") == 0) return true;
    if (std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr || std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr)
      return true;
    mallopt(M_MMAP_THRESHOLD, 64 << 20);
    mallopt(M_TRIM_THRESHOLD, 128 << 20);
    return true;
  }();
  (void)done;
#endif
}

}  // namespace paratrain::detail
