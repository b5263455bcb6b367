#pragma once
/// \file
/// paratrain::StepTimeline — where a strategy reports the phases of its steps,
/// and the launch and completion of each bucket's communication, while it is watched.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace paratrain {

/// The phases of a training step, in the order they happen.
enum class Phase : std::uint8_t {
  data,       ///< gathering a batch (fit)
  forward,    ///< model and loss
  backward,   ///< autograd, with bucket all-reduces launched as gradients become ready
  sync,       ///< waiting for the all-reduces backward did not hide, and the step's status
  optimizer,  ///< the optimizer step
};

constexpr const char* phase_name(Phase p) noexcept {
  constexpr const char* names[] = {"data", "forward", "backward", "sync", "optimizer"};
  return names[static_cast<int>(p)];
}

// Note [Zero-cost timeline]
// A strategy holds a `StepTimeline*` that is null unless an observer (fit's trace) sets
// it; every probe is then one pointer test and reads no clock. A strategy opts in by
// having `set_timeline(StepTimeline*)`; fit() calls it only when a trace is asked for.

/// The phases of one or more steps on this rank, in steady_clock time.
class StepTimeline {
 public:
  using clock = std::chrono::steady_clock;
  struct Span {
    Phase phase;
    clock::time_point begin, end;
  };
  /// One bucket's all-reduce, from its launch to when this rank saw it complete
  /// (a test() that said so, or the wait() that returned). `done` is {} until then.
  struct Transfer {
    std::size_t bucket;
    clock::time_point launch, done;
  };

  void add(Phase phase, clock::time_point begin, clock::time_point end) { spans_.push_back({phase, begin, end}); }

  void launched(std::size_t bucket) { transfers_.push_back({bucket, clock::now(), {}}); }

  /// The first call after `launched(bucket)` counts; later ones are ignored.
  void completed(std::size_t bucket) {
    for (auto it = transfers_.rbegin(); it != transfers_.rend(); ++it)
      if (it->bucket == bucket) {
        if (it->done == clock::time_point{}) it->done = clock::now();
        return;
      }
  }

  [[nodiscard]] const std::vector<Span>& spans() const noexcept { return spans_; }
  [[nodiscard]] const std::vector<Transfer>& transfers() const noexcept { return transfers_; }

  void clear() noexcept {
    spans_.clear();
    transfers_.clear();
  }

 private:
  std::vector<Span> spans_;
  std::vector<Transfer> transfers_;
};

/// Times one phase into `timeline` from construction to stop() (or destruction);
/// with a null timeline it does nothing at all.
class PhaseTimer {
 public:
  PhaseTimer(StepTimeline* timeline, Phase phase) : timeline_(timeline), phase_(phase) {
    if (timeline_ != nullptr) begin_ = StepTimeline::clock::now();
  }
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;
  ~PhaseTimer() {
    try {
      stop();
    } catch (...) {  // an allocation failure while recording must not end the program
    }
  }

  void stop() {
    if (timeline_ == nullptr) return;
    timeline_->add(phase_, begin_, StepTimeline::clock::now());
    timeline_ = nullptr;
  }

 private:
  StepTimeline* timeline_;
  Phase phase_;
  StepTimeline::clock::time_point begin_{};
};

}  // namespace paratrain
