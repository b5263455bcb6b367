#pragma once
/// \file
/// paratrain::fit_callback — what fit runs after each step and each epoch (Lightning's
/// Callback): the seam its own early stopping, plateau schedule, best checkpoint and time
/// limit stand on, and one's own (Note [Loop callbacks]).

#include <concepts>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

namespace paratrain {

struct StepInfo;
struct EpochInfo;

// Note [Loop callbacks]
// ~~~~~~~~~~~~~~~~~~~~~
// fit's loop runs its steps and epochs; what happens after them, beyond logging and
// checkpoints, is callbacks': values with any of
//   after_step(const StepInfo&, LoopControl&)    after every optimizer step, on every rank
//   after_epoch(const EpochInfo&, LoopControl&)  after every epoch and its evaluation
//   learning_rate_factor() -> double             what every later step's rate is multiplied by
//   save(CallbackState&) / load(const CallbackState&)  what a checkpoint keeps of them
// A callback asks the loop through LoopControl: stop (after this step or epoch), or keep
// this epoch's checkpoint as the best. The ranks agree on both in one all-reduce of two
// scalars (after each step only where some rank has a callback with after_step; after
// each epoch always), and the first asking rank's reason is reported. Early stopping,
// reduce-on-plateau, the best checkpoint and the time limit are callbacks the loop makes
// from FitOptions (fit/callbacks.hpp), as are FitOptions::on_step and on_epoch; they run
// in the order on_step, early stopping, reduce-on-plateau, best checkpoint, time limit,
// on_epoch, and then FitOptions::callbacks, a run's own. The next loop feature is a
// callback: it edits no existing class. A callback runs on every rank: what it decides
// from values every rank shares (an epoch's reduced metrics) is the same everywhere; from
// a rank's own (its clock), the agreement makes it so.

/// What a callback keeps across a resume, by name ("early_stopping.best"): fit's
/// checkpoints save every callback's and give them back.
using CallbackState = std::map<std::string, double>;

/// What a callback may ask of the loop after a step or an epoch (Note [Loop callbacks]),
/// and what the loop tells it of its timing.
class LoopControl {
 public:
  /// The loop's timing so far, for a callback that plans ahead (the time limit), in seconds.
  struct Times {
    double longest_step = 0;  ///< the longest optimizer step so far
    double longest_save = 0;  ///< the longest checkpoint save so far
    double last_eval = 0;     ///< the last evaluation
    bool epoch_ends = false;  ///< this step is its epoch's last
    bool next_ends_epoch = false;  ///< the next step is its epoch's last
  };

  LoopControl() = default;
  explicit LoopControl(const Times& times) : times_(times) {}

  /// Ends training after this step (or epoch), on every rank; the first reason stays.
  void stop(std::string why) {
    if (why_.empty()) why_ = why.empty() ? std::string("a callback asked") : std::move(why);
  }
  /// Keeps the checkpoint of this epoch's end as the best (CheckpointOptions::best's
  /// directory), where fit saves checkpoints; after an epoch only. Agreed: one rank's
  /// asking keeps it on all.
  void keep_as_best() noexcept { best_ = true; }

  [[nodiscard]] const Times& times() const noexcept { return times_; }
  [[nodiscard]] const std::string& stop_reason() const noexcept { return why_; }
  [[nodiscard]] bool best() const noexcept { return best_; }

 private:
  Times times_{};
  std::string why_;
  bool best_ = false;
};

/// A callback of fit (Note [Loop callbacks]): a value with at least one of after_step,
/// after_epoch or learning_rate_factor (and save/load where it keeps something).
template <class C>
concept fit_callback =
    std::copy_constructible<C> &&
    (requires(C& c, const StepInfo& s, LoopControl& l) { c.after_step(s, l); } ||
     requires(C& c, const EpochInfo& e, LoopControl& l) { c.after_epoch(e, l); } ||
     requires(const C& c) { { c.learning_rate_factor() } -> std::convertible_to<double>; });

/// Any fit_callback, behind one type: FitOptions::callbacks holds them. Copies share the
/// callback (its state is one per run: make a new one for another run).
class AnyCallback {
 public:
  template <fit_callback C>
    requires(!std::same_as<std::remove_cvref_t<C>, AnyCallback>)
  AnyCallback(C c) : self_(std::make_shared<Model<C>>(std::move(c))) {}  // NOLINT: any callback converts

  void after_step(const StepInfo& s, LoopControl& l) { self_->after_step(s, l); }
  void after_epoch(const EpochInfo& e, LoopControl& l) { self_->after_epoch(e, l); }
  [[nodiscard]] double learning_rate_factor() const { return self_->learning_rate_factor(); }
  void save(CallbackState& state) const { self_->save(state); }
  void load(const CallbackState& state) { self_->load(state); }
  /// Whether it has after_step: the loop then agrees on stopping after every step.
  [[nodiscard]] bool watches_steps() const noexcept { return self_->watches_steps(); }

 private:
  struct Base {
    virtual ~Base() = default;
    virtual void after_step(const StepInfo&, LoopControl&) = 0;
    virtual void after_epoch(const EpochInfo&, LoopControl&) = 0;
    [[nodiscard]] virtual double learning_rate_factor() const = 0;
    virtual void save(CallbackState&) const = 0;
    virtual void load(const CallbackState&) = 0;
    [[nodiscard]] virtual bool watches_steps() const noexcept = 0;
  };
  template <class C>
  struct Model final : Base {
    explicit Model(C c) : callback(std::move(c)) {}
    void after_step(const StepInfo& s, LoopControl& l) override {
      if constexpr (requires { callback.after_step(s, l); }) callback.after_step(s, l);
    }
    void after_epoch(const EpochInfo& e, LoopControl& l) override {
      if constexpr (requires { callback.after_epoch(e, l); }) callback.after_epoch(e, l);
    }
    [[nodiscard]] double learning_rate_factor() const override {
      if constexpr (requires { callback.learning_rate_factor(); }) return callback.learning_rate_factor();
      else return 1.0;
    }
    void save(CallbackState& state) const override {
      if constexpr (requires { callback.save(state); }) callback.save(state);
    }
    void load(const CallbackState& state) override {
      if constexpr (requires { callback.load(state); }) callback.load(state);
    }
    [[nodiscard]] bool watches_steps() const noexcept override {
      return requires(C& c, const StepInfo& s, LoopControl& l) { c.after_step(s, l); };
    }
    C callback;
  };
  std::shared_ptr<Base> self_;
};

}  // namespace paratrain
