#pragma once
/// \file
/// paratrain::memory::SlotPool — a fixed set of equal buffers reused every step for what a
/// step allocates and frees again (ZeRO's gathered units, whole gradient buckets): Note
/// [Pooled transients].

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace paratrain::memory {

// Note [Pooled transients]
// A ZeRO step allocates and frees the same large buffers every time: each unit's
// parameters gathered around its forward and its backward (stage 3), each bucket's whole
// gradient buffer until its reduce-scatter completes (stages 2 and 3). From the heap,
// they are what makes a process grow past its live bytes: glibc serves them between
// longer-lived tensors (the optimizer's state, made in the first step), and the holes
// they leave are kept (Note [Allocator]) but fit the next request only sometimes; a
// 16.8M-parameter ZeRO-3 rank held 185 MiB of heap for 88 MiB of tensors at its peak.
// So they come from a SlotPool instead: `count` slots of the largest size any of them
// needs, allocated at the first use and reused for the strategy's lifetime, like
// FSDP's limit_all_gathers: at most the unit computing plus DataParallelOptions::prefetch
// units gathered ahead, at most three whole gradient buckets (the one filling, the one
// allocated ahead of it, the one in flight). A request when every slot is taken (every
// unit gathered at once, to save or evaluate the whole model) is served by the allocator
// as before, so the pool bounds what the steps churn and never refuses.

/// `count` buffers of `slot_bytes` each, on one device, handed out whole.
class SlotPool {
 public:
  SlotPool() = default;
  SlotPool(std::size_t slot_bytes, int count, at::Device device)
      : slot_bytes_(slot_bytes), device_(device), slots_(static_cast<std::size_t>(count > 0 ? count : 0)) {}

  /// A free slot for `bytes` (at most slot_bytes), allocated on first use; -1 when every
  /// slot is taken or the request is larger than a slot.
  int acquire(std::size_t bytes) {
    if (bytes > slot_bytes_) return -1;
    for (std::size_t i = 0; i < slots_.size(); ++i)
      if (!slots_[i].taken) {
        if (!slots_[i].memory.defined())
          slots_[i].memory = at::empty({static_cast<std::int64_t>(slot_bytes_)}, at::TensorOptions(device_).dtype(at::kByte));
        slots_[i].taken = true;
        return static_cast<int>(i);
      }
    return -1;
  }
  void release(int slot) {
    if (slot >= 0) slots_[static_cast<std::size_t>(slot)].taken = false;
  }
  /// Slot `slot`'s first byte.
  [[nodiscard]] char* data(int slot) const {
    return static_cast<char*>(slots_[static_cast<std::size_t>(slot)].memory.data_ptr());
  }
  /// Slot `slot` as `numel` elements of `options` (its dtype and device), from byte `offset`.
  [[nodiscard]] at::Tensor view(int slot, std::int64_t offset, std::int64_t numel, const at::TensorOptions& options) const {
    const auto& m = slots_[static_cast<std::size_t>(slot)].memory;
    const auto size = static_cast<std::int64_t>(c10::elementSize(c10::typeMetaToScalarType(options.dtype())));
    return m.narrow(0, offset, numel * size).view(c10::typeMetaToScalarType(options.dtype()));
  }

 private:
  struct Slot {
    at::Tensor memory;
    bool taken = false;
  };
  std::size_t slot_bytes_ = 0;
  at::Device device_{at::kCPU};
  std::vector<Slot> slots_;
};

}  // namespace paratrain::memory
