#pragma once
/// \file
/// paratrain::memory::install — the process's heap settings for multi-MiB tensors (Note
/// [Allocator]), made once, by comm::Mpi::Environment or the first strategy — and
/// MappedLargeBlocks, the settings of a sharded construction (Note [Mapped construction]).

#include <climits>
#include <cstdlib>
#include <cstring>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace paratrain::memory {

// Note [Allocator]
// glibc serves every allocation above M_MMAP_THRESHOLD (128 KiB, raised dynamically up
// to 32 MiB as mmapped blocks are freed) with a fresh mmap, and returns the top of the
// heap to the kernel once more than M_TRIM_THRESHOLD of it is free. A training step
// allocates and frees the same multi-MiB temporaries every time (activations, gradients,
// optimizer scratch; under ZeRO also whole-bucket gradient buffers and, at stage 3, each
// unit's parameters), so under those defaults they are page-faulted anew every step:
//   - a LibTorch process with 1024x1024 layers ran 3.3x slower (28-30 against 96-98
//     steps/s, one process, one thread; docs/benchmarks.md);
//   - ZeRO-2 and ZeRO-3 on the 16.8M-parameter MLP (2 ranks) ran at 3.3 and 2.0 steps/s
//     with the trim threshold at 128 MiB, and at 9.2 and 8.5 with it at 2 GiB (DDP: 8.5):
//     they free more than 128 MiB per step, so glibc gave it back and faulted it in again
//     (34% of the time in page faults under perf).
// So: M_MMAP_THRESHOLD = 64 MiB (smaller blocks stay on the heap for reuse; larger ones
// are still mapped and returned when freed) and M_TRIM_THRESHOLD = 2 GiB (the heap keeps
// its high-water mark, as a caching allocator does; peak RSS is unchanged, only memory
// that was already in use stays resident). memory::install() sets them, once per process:
// comm::Mpi::Environment calls it before anything is allocated, and so does every
// strategy's constructor (for programs without that environment: comm::Single, Gloo over
// a store), so that every paratrain program is fast by default without a launcher's help,
// unless:
//   - the environment already sets MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_
//     (the user has chosen; glibc applies those at start-up), or
//   - PARATRAIN_MALLOC=default asks for glibc's own behaviour (the opt-out), or
//   - another allocator (jemalloc, tcmalloc) is preloaded: mallopt then does not reach it.
// benchmarks/*_vs_torch.sh give PyTorch the same two values ("at its best").
//
// Revisited with ZeRO's transients pooled (Note [Pooled transients]), on the 16.8M-
// parameter MLP at 2 ranks (bench_zero, peak RSS above the process's baseline against
// plan::peak, which equals the tensors' peak counted at LibTorch's allocator):
//   these settings          DDP 6.10 steps/s, 353 MiB (plan 288); ZeRO-3 5.73, 379 (240)
//   glibc's own             DDP 4.17,         353;                ZeRO-3 4.55, 367
//   trim threshold 128 MiB  DDP 6.08,         378;                ZeRO-3 5.85, 342
//   mmap threshold 1 MiB    DDP 3.43,         308;                ZeRO-3 3.41, 320
// Lower thresholds do not bring the peak down to the tensors' (what is left is the heap's
// fragments around the optimizer's long-lived state, and Open MPI's scratch for a
// non-blocking collective: ZeRO-3 at 1 rank, with no collective to speak of, is 6% above
// its plan under the 1 MiB threshold, at 2 ranks 20%) and cost 6-45% of the step rate;
// so the settings stay.

/// Applies Note [Allocator] once per process; later calls do nothing. Whether it did
/// (false where the user chose, or another allocator is in charge).
inline bool install() noexcept {
#if defined(__GLIBC__)
  static const bool applied = [] {
    const char* choice = std::getenv("PARATRAIN_MALLOC");
    if (choice != nullptr && std::strcmp(choice, "default") == 0) return false;
    if (std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr || std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr)
      return false;
    mallopt(M_MMAP_THRESHOLD, 64 << 20);
    mallopt(M_TRIM_THRESHOLD, INT_MAX);  // 2 GiB
    return true;
  }();
  return applied;
#else
  return false;
#endif
}

// Note [Mapped construction]
// A sharded construction (Note [Sharded construction]) allocates each unit whole, keeps a
// shard and frees the rest, unit after unit, between shards that stay: from the heap,
// under Note [Allocator]'s thresholds, the freed units are holes the process keeps and
// the next sizes do not fill (the 201M-parameter MLP at 2 ranks: 1058 MiB of RSS for 769
// MiB of tensors after construction). While one runs, blocks of 1 MiB or more are mapped
// on their own instead, so what is freed goes back at once (771 MiB); construction runs
// once, so its page faults do not matter. Where Note [Allocator] was not applied (the user
// chose), nothing is changed.

/// While it lives, glibc maps every block of 1 MiB or more on its own: Note [Mapped construction].
class MappedLargeBlocks {
 public:
  MappedLargeBlocks() noexcept : tuned_(install()) {
#if defined(__GLIBC__)
    if (tuned_) mallopt(M_MMAP_THRESHOLD, 1 << 20);
#endif
  }
  ~MappedLargeBlocks() {
#if defined(__GLIBC__)
    if (tuned_) mallopt(M_MMAP_THRESHOLD, 64 << 20);
#endif
  }
  MappedLargeBlocks(const MappedLargeBlocks&) = delete;
  MappedLargeBlocks& operator=(const MappedLargeBlocks&) = delete;

 private:
  bool tuned_;
};

}  // namespace paratrain::memory
