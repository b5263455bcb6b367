#pragma once
/// \file
/// The lifetime of a pending operation, written once for comm::Mpi, comm::Gloo and comm::Nccl:
/// what it keeps alive, what runs when it completes, its watch, and what dropping it does.
/// A transport supplies only its native handles (MPI requests, c10d works, a CUDA event).
// IWYU pragma: private, include "paratrain/comm/mpi/mpi.hpp" (or gloo/, nccl/)

#include <ATen/core/Tensor.h>

#include <array>
#include <concepts>
#include <cstddef>
#include <exception>
#include <functional>
#include <utility>
#include <vector>

#include "paratrain/reliability/watchdog.hpp"

// Under AddressSanitizer, the buffers a dropped request leaks on purpose are registered as
// such (Note [Dropped requests]), so that LeakSanitizer reports only leaks by mistake.
#if defined(__SANITIZE_ADDRESS__)
#define PARATRAIN_LSAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PARATRAIN_LSAN 1
#endif
#endif
#ifdef PARATRAIN_LSAN
#include <sanitizer/lsan_interface.h>
#endif

namespace paratrain::detail {

/// A transport's handles on one pending operation. Moved-from and default-constructed
/// handles are not pending; wait() and test() leave them not pending when they succeed.
template <class N>
concept native_handles = std::default_initializable<N> && std::movable<N> &&
                         requires(N& n, const N& c, const char* op, int rank) {
                           { c.pending() } -> std::same_as<bool>;
                           n.wait(op, rank);                          // blocks; throws paratrain::error
                           { n.test(op, rank) } -> std::same_as<bool>;  // progresses; true once complete
                           n.abandon();  // leaks the handles: Note [Dropped requests]
                         };

// Note [Dropped requests]
// MPI forbids freeing a request of a non-blocking collective, and the buffer must
// outlive it, so a Request destroyed while pending waits. During stack unwinding
// it does not: a peer may have failed, and waiting could hang the rank that is
// about to report the error. The buffer is then leaked on purpose (and, under
// AddressSanitizer, registered with __lsan_ignore_object as a leak on purpose).

/// The tensors a pending operation keeps alive: up to four (what every operation keeps)
/// without an allocation, more in a vector.
class KeptTensors {
 public:
  KeptTensors() = default;
  // Each tensor copied once (a list of tensors would be copied twice: one more pair of
  // atomic reference-count operations a tensor, on every non-blocking operation).
  template <class... T>
    requires(sizeof...(T) > 0 && (std::same_as<T, at::Tensor> && ...))
  KeptTensors(const T&... tensors) {  // NOLINT(google-explicit-constructor): request("op", {in, out})
    (push(tensors), ...);
  }
  KeptTensors(std::vector<at::Tensor> tensors) {  // NOLINT(google-explicit-constructor): a request's keep_ = vector
    if (tensors.size() > few_.size()) {
      more_ = std::move(tensors);
      return;
    }
    for (auto& t : tensors) push(std::move(t));
  }
  void clear() noexcept {
    for (auto& t : few_) t.reset();
    more_.clear();
    n_ = 0;
  }

 private:
  void push(at::Tensor t) {
    if (n_ < few_.size())
      few_[n_++] = std::move(t);
    else
      more_.push_back(std::move(t));
  }

  std::array<at::Tensor, 4> few_;
  std::size_t n_ = 0;
  std::vector<at::Tensor> more_;
};

/// A pending non-blocking operation of the communicator `Native::owner`. Dropping one waits
/// for it: Note [Dropped requests].
template <native_handles Native>
class BasicRequest {
 public:
  BasicRequest() = default;
  BasicRequest(BasicRequest&& o) noexcept { *this = std::move(o); }
  BasicRequest& operator=(BasicRequest&& o) noexcept {
    if (this != &o) {
      finish_or_abandon();
      native_ = std::exchange(o.native_, Native{});
      keep_ = std::move(o.keep_);
      then_ = std::exchange(o.then_, {});
      watch_ = std::move(o.watch_);
      op_ = o.op_;
      rank_ = o.rank_;
    }
    return *this;
  }
  ~BasicRequest() { finish_or_abandon(); }

  /// Blocks until the operation is complete; the buffer is then valid. Throws
  /// paratrain::error when the transport failed.
  void wait() {
    if (native_.pending()) {
      try {
        native_.wait(op_, rank_);
      } catch (...) {
        watch_.release();
        throw;
      }
    }
    complete();  // also an operation that had nothing to wait for (an all-to-all over one rank)
  }

  /// Makes progress and says whether the operation is complete.
  [[nodiscard]] bool test() {
    if (native_.pending() && !native_.test(op_, rank_)) return false;
    complete();
    return true;
  }

  /// Whether test() answers without blocking, where the transport can say (comm::Gloo).
  [[nodiscard]] bool pollable() const noexcept
    requires requires(const Native& n) { n.pollable(); }
  {
    return native_.pollable();
  }

 private:
  friend typename Native::owner;
  BasicRequest(const char* op, int rank, KeptTensors keep) : keep_(std::move(keep)), op_(op), rank_(rank) {}

  void complete() {
    watch_.release();
    if (then_) std::exchange(then_, {})();
    keep_.clear();
  }

  void finish_or_abandon() noexcept {
    if (!native_.pending()) return;
    if (std::uncaught_exceptions() > 0) {
      native_.abandon();
      [[maybe_unused]] auto* kept = new KeptTensors(std::move(keep_));  // never freed, on purpose
#ifdef PARATRAIN_LSAN
      __lsan_ignore_object(kept);
#endif
      watch_.release();
      return;
    }
    try {
      wait();
    } catch (...) {  // a destructor cannot report it; the next operation will fail too
    }
  }

  Native native_;
  KeptTensors keep_;              // must outlive the operation
  std::function<void()> then_;    // runs once it completes (an average's division, a copy back)
  Watch watch_;                   // Note [Watchdog]
  const char* op_ = "";
  int rank_ = -1;
};

}  // namespace paratrain::detail
