#pragma once
/// \file
/// paratrain::data::Loader — batches prepared by worker threads while the step computes.

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/GradMode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "paratrain/concepts/dataset.hpp"
#include "paratrain/core/batch.hpp"
#include "paratrain/core/message.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain::data {

/// How data::Loader prepares batches (and FitOptions::loader, fit's).
struct LoaderOptions {
  /// Threads that call the dataset's get() ahead of the training thread. 0: the training
  /// thread reads each batch when it needs it, as fit did before there was a Loader.
  /// 1 suffices when reading and collating a batch takes less time than a step: then all
  /// of it hides behind the step (docs/benchmarks.md measures 0, 1 and 2 on 2 cores).
  int workers = 1;
  /// Batches ready or in preparation at once, at least `workers`: memory for `depth`
  /// batches buys slack for steps and reads whose times vary.
  int depth = 2;
  /// Copy each batch into page-locked memory in the worker, so that its copy to the GPU is
  /// asynchronous (Note [One move per batch]). Needs CUDA. fit and evaluate turn it on for a
  /// strategy whose device is a GPU (for_device).
  bool pin_memory = false;
  /// The GPU the batches are for, or none: the workers then also copy each batch there, on a
  /// stream of their own, while the step computes (Note [Copies beside the step]). Needs at
  /// least one worker (with none, the strategy's move does the copy). fit and evaluate set
  /// it to a GPU strategy's device (for_device). Costs `depth` batches of GPU memory.
  std::optional<at::Device> device;
};

/// `options` for batches bound for `device`: where it is a GPU, pinned and copied there by
/// the workers, beside the step.
[[nodiscard]] inline LoaderOptions for_device(LoaderOptions options, at::Device device) {
  if (!device.is_cuda()) return options;
  options.pin_memory = true;
  if (!options.device) options.device = device;
  return options;
}

// Note [Copies beside the step]
// A batch copied to the GPU by the strategy, just before its forward, is copied on the
// stream the forward runs on: asynchronous for the host (from pinned memory), but the GPU
// does nothing else meanwhile. With LoaderOptions::device, each worker copies its batches
// on a stream of its own (one from the device's pool, made current in the worker), while the
// training thread's kernels of earlier steps run on theirs, and records an event after the
// copy. next() makes the training thread's current stream wait for that event (on the GPU:
// the host does not wait) and records the batch's memory as used by that stream, so that
// CUDA's caching allocator does not hand it out again before the step that reads it is done
// (it was allocated on the worker's stream). The strategy then finds the batch on its
// device, and its move (Note [One move per batch]) copies nothing: each tensor still moves
// once. A copy that fails (out of memory) fails that batch, in order (Note [Loader order]).

// Note [Loader order]
// Batch k is prepared into slot k % depth by whichever worker claims it, and the training
// thread takes batch k from that slot and nothing else, so the order is the sampler's
// whatever the number of workers and however long each read takes. A worker may claim
// batch k only once batch k - depth has been taken (its slot is free): at most `depth`
// batches exist at once. An error in a worker is stored in the batch's slot and thrown on
// the training thread when it asks for that batch, so it surfaces in order too, after
// every batch before it was trained on.

/// The batches of `indices` (one 1-D int64 tensor of sample indices per batch, as
/// data::to_tensor makes them) from a paratrain::dataset, in that order, prepared ahead by
/// `options.workers` threads (Note [Loader order]).
///
/// An error in the dataset's get() is thrown by next() as a paratrain::error naming the
/// batch and the first sample of it that fails to load alone, e.g. "Loader: batch 3 of 10
/// (samples 17, 4, 9 ...): sample 4: <the dataset's message>".
///
/// \code
/// data::Loader loader(dataset, micro_batches, {.workers = 2});
/// while (auto batch = loader.next()) train_on(*batch);
/// \endcode
template <dataset D>
class Loader {
 public:
  /// Starts the workers. Throws paratrain::error if workers < 0 or depth < max(workers, 1),
  /// or if options.device is a GPU that LibTorch does not see.
  Loader(const D& data, std::vector<at::Tensor> indices, LoaderOptions options = {})
      : data_(data), indices_(std::move(indices)), options_(options) {
    if (options_.workers < 0 || options_.depth < std::max(options_.workers, 1))
      throw error("Loader", -1,
                  "LoaderOptions::workers must be >= 0 and depth at least max(workers, 1); they are " +
                      std::to_string(options_.workers) + " and " + std::to_string(options_.depth));
    if (options_.workers == 0) return;
    if (options_.device && options_.device->is_cuda()) side_streams();
    slots_.resize(static_cast<std::size_t>(options_.depth));
    workers_.reserve(static_cast<std::size_t>(options_.workers));
    try {
      for (int w = 0; w < options_.workers; ++w) workers_.emplace_back([this, w] { work(w); });
    } catch (...) {  // no thread left running: the destructor will not be called
      stop();
      throw;
    }
  }

  /// Deleted: the workers would read a dataset destroyed at the end of the statement.
  Loader(const D&& data, std::vector<at::Tensor> indices, LoaderOptions options = {}) = delete;
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  /// Stops the workers (a batch being read is finished and dropped) and waits for them.
  ~Loader() { stop(); }

  /// The next batch in order, or nothing after the last. Throws the error of a batch that
  /// could not be loaded (paratrain::error); later calls go on with the batch after it.
  std::optional<Batch> next() {
    if (taken_ == size()) return std::nullopt;
    const auto k = taken_++;
    if (workers_.empty()) return load(k);
    auto& slot = slots_[static_cast<std::size_t>(k % options_.depth)];
    std::unique_lock lock(mutex_);
    changed_.wait(lock, [&] { return slot.batch == k; });
    auto out = std::move(slot);
    slot = Slot{};
    ++freed_;
    lock.unlock();
    changed_.notify_all();
    if (out.failure) std::rethrow_exception(out.failure);
    if (out.copied) {  // Note [Copies beside the step]
      const auto& device = *options_.device;
      const auto stream = c10::impl::VirtualGuardImpl(device.type()).getStream(device);
      out.copied->block(stream);
      out.value.for_each_tensor([&](const at::Tensor& x) { x.record_stream(stream); });
    }
    return std::move(out.value);
  }

  /// The number of batches in all.
  [[nodiscard]] std::int64_t size() const noexcept { return static_cast<std::int64_t>(indices_.size()); }
  [[nodiscard]] const LoaderOptions& options() const noexcept { return options_; }

 private:
  void stop() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    changed_.notify_all();
    for (auto& t : workers_) t.join();
  }

  struct Slot {
    std::int64_t batch = -1;  ///< which batch the slot holds; -1: none yet
    Batch value;
    std::exception_ptr failure;
    std::optional<c10::Event> copied;  ///< after the copy to options_.device, where there is one
  };

  /// One stream per worker for its copies to options_.device (Note [Copies beside the step]),
  /// taken here, on the constructing thread, so that a GPU LibTorch cannot use fails there.
  void side_streams() {
    auto& device = *options_.device;
    const auto gpus = c10::impl::hasDeviceGuardImpl(device.type())
                          ? static_cast<int>(c10::impl::VirtualGuardImpl(device.type()).deviceCount())
                          : 0;
    if (gpus == 0 || device.index() >= gpus)
      throw error("Loader", -1,
                  "LoaderOptions::device is " + device.str() + ", but LibTorch sees " + std::to_string(gpus) +
                      " GPU(s) (a LibTorch built without CUDA, no driver, or CUDA_VISIBLE_DEVICES); leave it "
                      "unset to keep batches on the host");
    const c10::impl::VirtualGuardImpl gpu(device.type());
    if (!device.has_index()) device = gpu.getDevice();  // "cuda": the current GPU, as Tensor::to takes it
    for (int w = 0; w < options_.workers; ++w) streams_.push_back(gpu.getStreamFromGlobalPool(device));
  }

  void work(int w) {
    const c10::NoGradGuard no_grad;  // reading data records nothing for autograd
    // This worker's copies to the GPU: on its own stream (Note [Copies beside the step]).
    std::optional<c10::StreamGuard> side;
    if (!streams_.empty()) side.emplace(streams_[static_cast<std::size_t>(w)]);
    for (;;) {
      std::int64_t k = 0;
      {
        std::unique_lock lock(mutex_);
        changed_.wait(lock, [&] { return stopping_ || claimed_ == size() || claimed_ < freed_ + options_.depth; });
        if (stopping_ || claimed_ == size()) return;
        k = claimed_++;
      }
      Slot filled{.batch = k};
      try {
        filled.value = load(k);
        if (options_.pin_memory) pin(filled.value);
        if (side) {
          filled.value = filled.value.to(*options_.device);
          filled.copied.emplace(options_.device->type());
          filled.copied->record(side->current_stream());
        }
      } catch (...) {
        filled.failure = std::current_exception();
      }
      {
        std::lock_guard lock(mutex_);
        slots_[static_cast<std::size_t>(k % options_.depth)] = std::move(filled);
      }
      changed_.notify_all();
    }
  }

  /// Batch k, or a paratrain::error naming it and the sample that fails.
  Batch load(std::int64_t k) const {
    const auto& ids = indices_[static_cast<std::size_t>(k)];
    try {
      return data_.get(ids);
    } catch (const std::exception& e) {
      throw error("Loader", -1, "batch " + std::to_string(k) + " of " + std::to_string(size()) + " (" +
                                    describe(ids) + "): " + culprit(ids, paratrain::detail::inner_message(e)));
    }
  }

  /// "sample i: message" for the first sample of `ids` that fails alone, or the batch's
  /// message when each loads alone (the failure is the batch's: memory, a collation).
  std::string culprit(const at::Tensor& ids, const std::string& batch_message) const {
    if (!ids.defined() || ids.dim() != 1) return batch_message;
    const auto n = ids.numel();
    for (std::int64_t i = 0; i < n; ++i) {
      try {
        static_cast<void>(data_.get(ids.narrow(0, i, 1)));
      } catch (const std::exception& e) {
        return "sample " + std::to_string(ids[i].template item<std::int64_t>()) + ": " + paratrain::detail::inner_message(e);
      }
    }
    return batch_message;
  }

  static std::string describe(const at::Tensor& ids) {
    if (!ids.defined() || ids.dim() != 1) return "not a 1-D tensor of sample indices";
    std::string s = "samples ";
    const auto n = ids.numel();
    for (std::int64_t i = 0; i < std::min<std::int64_t>(n, 4); ++i)
      s += (i ? ", " : "") + std::to_string(ids[i].template item<std::int64_t>());
    return s + (n > 4 ? " ..." : "");
  }

  static void pin(Batch& b) {
    b.for_each_tensor([](at::Tensor& x) { x = x.pin_memory(); });
  }

  const D& data_;
  std::vector<at::Tensor> indices_;
  LoaderOptions options_;
  std::vector<Slot> slots_;
  std::vector<c10::Stream> streams_;  ///< the workers' own, for copies to options_.device
  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::int64_t claimed_ = 0;  ///< batches claimed by workers
  std::int64_t freed_ = 0;    ///< batches taken by the training thread (their slots free)
  std::int64_t taken_ = 0;    ///< next() calls that returned a batch or threw
  bool stopping_ = false;
};

}  // namespace paratrain::data
