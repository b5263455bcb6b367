#pragma once
/// \file
/// paratrain::memory::CountingCpuAllocator — the bytes LibTorch's CPU tensors hold, counted
/// at the allocator: while a CountingCpuAllocator::Scope lives, every CPU tensor's storage
/// comes from LibTorch's default allocator through this one, which tracks the live bytes
/// and their peak. What a piece of code holds at most, exactly and whatever the heap (glibc
/// keeps freed memory resident, so the process's RSS cannot say): the tests' measure of
/// ZeRO's memory, and the tensors' share in a breakdown of the peak (memory/usage.hpp).

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/version.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace paratrain::memory {

/// Counts the bytes of CPU tensors allocated while a Scope lives (one for the process).
class CountingCpuAllocator final : public c10::Allocator {
 public:
  /// One for the process: storages made while counting keep pointing at it.
  static CountingCpuAllocator& instance() {
    static CountingCpuAllocator a;
    return a;
  }

  /// Counts from construction to destruction; peak() is relative to the bytes live then.
  class Scope {
   public:
    Scope() : previous_(c10::GetCPUAllocator()) {
      auto& a = instance();
      a.base_ = a.live_.load();
      a.peak_ = a.base_;
      c10::SetCPUAllocator(&a, /*priority=*/255);
    }
    ~Scope() { c10::SetCPUAllocator(previous_, /*priority=*/255); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
    /// Bytes live now and at most, above those live when the scope began.
    [[nodiscard]] std::int64_t live() const { return instance().live_.load() - instance().base_; }
    [[nodiscard]] std::int64_t peak() const { return instance().peak_.load() - instance().base_; }
    /// Forgets the peak so far: peak() is then the most live since now (above the same base).
    void reset_peak() const { instance().peak_ = instance().live_.load(); }

   private:
    c10::Allocator* previous_;
  };

#if TORCH_VERSION_MAJOR >= 2 && TORCH_VERSION_MINOR >= 3 || TORCH_VERSION_MAJOR >= 3
  c10::DataPtr allocate(std::size_t n) override { return count(n); }
  void copy_data(void* dest, const void* src, std::size_t n) const override { default_copy_data(dest, src, n); }
#else
  c10::DataPtr allocate(std::size_t n) const override { return const_cast<CountingCpuAllocator*>(this)->count(n); }
#endif

 private:
  // Each block's size sits in a 64-byte header before its data, so that the data is its
  // own context, as raw_allocate asks (oneDNN's bf16 kernels allocate their scratch so).
  static constexpr std::size_t header = 64;  // c10's alignment
  c10::DataPtr count(std::size_t n) {
    auto* base = static_cast<char*>(c10::alloc_cpu(n + header));
    *reinterpret_cast<std::size_t*>(base) = n;
    void* data = base + header;
    const auto now = live_ += static_cast<std::int64_t>(n);
    auto seen = peak_.load();
    while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
    }
    return {data, data, &release, c10::Device(c10::kCPU)};
  }
  static void release(void* data) {
    auto* base = static_cast<char*>(data) - header;
    instance().live_ -= static_cast<std::int64_t>(*reinterpret_cast<std::size_t*>(base));
    c10::free_cpu(base);
  }
  [[nodiscard]] c10::DeleterFnPtr raw_deleter() const override { return &release; }
  std::atomic<std::int64_t> live_{0}, peak_{0};
  std::int64_t base_ = 0;
};

}  // namespace paratrain::memory
