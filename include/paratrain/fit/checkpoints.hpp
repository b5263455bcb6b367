#pragma once
/// \file
/// What paratrain::fit saves and resumes: its options (FitOptions::checkpoint) and the
/// loop's position (epoch, step, place in the sample order, learning-rate schedule,
/// the epoch's running metrics) next to the strategy's state.

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "paratrain/checkpoint/checkpointer.hpp"
#include "paratrain/checkpoint/load.hpp"
#include "paratrain/concepts/checkpointable.hpp"
#include "paratrain/concepts/strategy.hpp"
#include "paratrain/collectives/agree.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/core/message.hpp"
#include "paratrain/fit/callback.hpp"
#include "paratrain/fit/metrics.hpp"
#include "paratrain/fit/monitor.hpp"

namespace paratrain {

/// Checkpoints during fit, and resuming from them (docs/checkpoints.md).
///
/// \code
///   fit(s, train, {.epochs = 10, .checkpoint = {.directory = "ckpt", .every_steps = 500}});
///   // killed, then the same command again: it resumes from ckpt's newest checkpoint
/// \endcode
struct CheckpointOptions {
  std::filesystem::path directory{};  ///< where checkpoints go; empty: none are saved or resumed from
  std::int64_t every_steps = 0;       ///< save after every this many optimizer steps; 0: not by steps
  bool every_epoch = false;           ///< save at the end of each epoch, after its evaluation
  int keep = 2;                       ///< keep the newest this many; 0: all
  bool async = true;                  ///< write in the background (checkpoint::Options::async)
  /// Resume from the newest complete checkpoint in `directory`, if there is one; so the
  /// same command starts a run and continues it after an interruption.
  bool resume = true;
  /// Resume from this checkpoint instead (it must exist): another directory, an older one.
  std::filesystem::path resume_from{};
  /// Also keep the checkpoint of the best epoch by this value, in `directory`/best
  /// (Lightning's ModelCheckpoint(monitor=...)): saved after an epoch's evaluation whenever
  /// the value improves on every earlier epoch's. Empty name: none.
  Monitor best{};
};

namespace detail {

/// Where the loop is: after `epoch_step` steps of epoch `epoch`, which visited the first
/// `position` places of the epoch's sample order (Note [Resuming mid-epoch]).
struct FitPosition {
  std::int64_t epoch = 0;
  std::int64_t epoch_step = 0;
  std::int64_t position = 0;
  std::int64_t step = 0;          ///< optimizer steps since the run began
  std::vector<double> base_lrs;   ///< the groups' learning rates before fit's schedule
  // What the sample order depends on: a resume must see the same.
  std::int64_t dataset_size = 0;
  std::int64_t seed = 0;
  bool shuffle = true;
  bool drop_last = false;
  /// The data-parallel replicas that visited `position` (0 in checkpoints from before it
  /// was recorded): a sampler without set_epoch(epoch, start) resumes only at as many.
  std::int64_t replicas = 0;
  /// The samples of each optimizer step over all replicas (0 in checkpoints from before it
  /// was recorded): a resume keeps it, at any number of replicas (Note [The global batch]).
  std::int64_t global_batch = 0;
  /// What the loop's callbacks keep (Note [Loop callbacks]): early stopping's and the best
  /// checkpoint's values seen, reduce-on-plateau's cut, ..., so that a resumed run stops,
  /// keeps the best and schedules as the uninterrupted one would.
  CallbackState callbacks;
  double loss_scale = 0;  ///< the strategy's loss scale (Note [Loss scaling]); 0: none
  std::int64_t loss_scale_tracker = 0;
};

inline checkpoint::Dict to_dict(const FitPosition& p) {
  auto d = checkpoint::make_dict();
  d.insert("epoch", p.epoch);
  d.insert("epoch_step", p.epoch_step);
  d.insert("position", p.position);
  d.insert("step", p.step);
  d.insert("base_lrs", c10::List<double>(p.base_lrs));
  d.insert("dataset_size", p.dataset_size);
  d.insert("seed", p.seed);
  d.insert("shuffle", p.shuffle);
  d.insert("drop_last", p.drop_last);
  d.insert("replicas", p.replicas);
  d.insert("global_batch", p.global_batch);
  auto callbacks = checkpoint::make_dict();
  for (const auto& [key, value] : p.callbacks) callbacks.insert(key, value);
  d.insert("callbacks", callbacks);
  d.insert("loss_scale", p.loss_scale);
  d.insert("loss_scale_tracker", p.loss_scale_tracker);
  return d;
}

inline FitPosition position_from(const std::filesystem::path& path, const checkpoint::Dict& extra) {
  const auto it = extra.find("fit");
  if (it == extra.end() || !it->value().isGenericDict())
    throw checkpoint::detail::file_error(path, "was not saved by paratrain::fit: it has no loop position to resume", 0);
  const auto d = it->value().toGenericDict();
  const auto index = path / checkpoint::detail::index_name;
  using checkpoint::detail::field;
  FitPosition p;
  p.epoch = field<std::int64_t>(index, d, "epoch");
  p.epoch_step = field<std::int64_t>(index, d, "epoch_step");
  p.position = field<std::int64_t>(index, d, "position");
  p.step = field<std::int64_t>(index, d, "step");
  const auto typed = [&](const char* key, bool ok) {
    if (!ok) throw checkpoint::detail::file_error(index, std::string("has a malformed fit entry '") + key + "' (corrupt)", 0);
  };
  typed("base_lrs", d.contains("base_lrs") && d.at("base_lrs").isDoubleList());
  typed("shuffle", d.contains("shuffle") && d.at("shuffle").isBool());
  typed("drop_last", d.contains("drop_last") && d.at("drop_last").isBool());
  p.base_lrs = d.at("base_lrs").toDoubleVector();
  p.dataset_size = field<std::int64_t>(index, d, "dataset_size");
  p.seed = field<std::int64_t>(index, d, "seed");
  p.shuffle = d.at("shuffle").toBool();
  p.drop_last = d.at("drop_last").toBool();
  if (d.contains("replicas")) p.replicas = field<std::int64_t>(index, d, "replicas");
  if (d.contains("global_batch")) p.global_batch = field<std::int64_t>(index, d, "global_batch");
  // Absent from checkpoints saved before they were recorded: nothing seen yet.
  const auto number = [&](const char* key, double& out) {
    if (!d.contains(key)) return;
    typed(key, d.at(key).isDouble());
    out = d.at(key).toDouble();
  };
  if (d.contains("callbacks")) {
    typed("callbacks", d.at("callbacks").isGenericDict());
    for (const auto& entry : d.at("callbacks").toGenericDict()) {
      typed("callbacks", entry.key().isString() && entry.value().isDouble());
      p.callbacks[entry.key().toStringRef()] = entry.value().toDouble();
    }
  } else {
    // Saved before the loop's callbacks (Note [Loop callbacks]): the same values, by their
    // old names.
    const std::pair<const char*, const char*> renamed[] = {
        {"early_best", "early_stopping.best"}, {"early_bad", "early_stopping.bad"}, {"best_saved", "best.value"},
        {"plateau_factor", "plateau.factor"},  {"plateau_best", "plateau.best"},   {"plateau_bad", "plateau.bad"}};
    for (const auto& [old_key, key] : renamed)
      if (d.contains(old_key)) {
        const auto& v = d.at(old_key);
        typed(old_key, v.isDouble() || v.isInt());
        p.callbacks[key] = v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
      }
  }
  number("loss_scale", p.loss_scale);
  if (d.contains("loss_scale_tracker")) p.loss_scale_tracker = field<std::int64_t>(index, d, "loss_scale_tracker");
  return p;
}

inline checkpoint::Dict metrics_dict(const Metrics& m) {
  auto d = checkpoint::make_dict();
  for (const auto& [name, sw] : m.sums()) d.insert(name, c10::List<double>({sw.first, sw.second}));
  return d;
}

/// The checkpoint a run resumes from, and where the loop stood in it.
struct ResumePoint {
  std::filesystem::path path;
  FitPosition position;
};

/// The checkpoint to resume from under `options` (CheckpointOptions::resume_from, else the
/// newest complete one in the directory as rank 0 sees it, so every rank takes the same one
/// even if one is published while they look), with its loop position read from its index;
/// none for a fresh start. Collective; a malformed index throws on every rank.
template <strategy S>
std::optional<ResumePoint> resume_point(S& s, const CheckpointOptions& options) {
  std::optional<std::filesystem::path> path;
  if (!options.resume_from.empty()) {
    path = options.resume_from;
  } else if (options.resume && !options.directory.empty()) {
    path = checkpoint::agreed_latest(s, options.directory);
  }
  if (!path) return std::nullopt;
  ResumePoint out{*path, {}};
  std::string problem;
  try {
    out.position = position_from(*path, checkpoint::read_extra(*path));
  } catch (const std::exception& e) {
    problem = message_of(e);
  }
  agree(s, "fit", problem);
  return out;
}

/// The loop's position after the last step this rank completed, as a checkpoint of it would
/// record it: what elastic::fit's survivors save when a rank is lost (Note [A snapshot of the
/// survivors]). fit keeps one only when asked (Trainer's `journal`).
struct Journal {
  std::int64_t step = -1;  ///< optimizer steps done; -1: none completed yet
  checkpoint::Dict extra = checkpoint::make_dict();
  checkpoint::Dict rank_extra = checkpoint::make_dict();
  /// The entry before this one: survivors a step apart save the older step's state, whose
  /// position a rank a step ahead must still be able to write (Note [A snapshot of the survivors]).
  std::int64_t previous_step = -1;
  checkpoint::Dict previous_extra = checkpoint::make_dict();
  checkpoint::Dict previous_rank_extra = checkpoint::make_dict();

  /// Records a state: the current entry becomes the previous one.
  void keep(std::int64_t s, checkpoint::Dict e, checkpoint::Dict r) {
    previous_step = std::exchange(step, s);
    previous_extra = std::exchange(extra, std::move(e));
    previous_rank_extra = std::exchange(rank_extra, std::move(r));
  }
  /// The entry of step `s`: the current one or the previous; nullptr for neither.
  [[nodiscard]] const checkpoint::Dict* extra_at(std::int64_t s) const noexcept {
    return s == step ? &extra : s == previous_step && s >= 0 ? &previous_extra : nullptr;
  }
  [[nodiscard]] const checkpoint::Dict* rank_extra_at(std::int64_t s) const noexcept {
    return s == step ? &rank_extra : s == previous_step && s >= 0 ? &previous_rank_extra : nullptr;
  }
  /// How many ranks wait to join, as this rank knows (elastic::Membership::waiting): after
  /// each mid-epoch checkpoint the ranks agree on it, and fit stops there when it is not 0
  /// (joining_reason), so that they are let in and resume from that checkpoint.
  std::function<std::int64_t()> waiting;
};

template <class S, bool Possible>
struct saver_of {
  struct type {};
};
template <class S>
struct saver_of<S, true> {
  using type = checkpoint::Checkpointer<S>;
};

/// fit's checkpointing: nothing at all unless FitOptions::checkpoint names a directory.
template <strategy S>
class FitCheckpoints {
 public:
  static constexpr bool possible = checkpointable<S> && checkpoint::known_optimizer<checkpoint::detail::optimizer_t<S>>;

 private:
  using Saver = typename saver_of<S, possible>::type;

 public:
  FitCheckpoints(S& s, const CheckpointOptions& options) : s_(&s), options_(options) {
    if (options.directory.empty() && options.resume_from.empty()) return;
    if (options.every_steps < 0 || options.keep < 0)
      throw error("fit", s.rank(), "checkpoint.every_steps and checkpoint.keep must be >= 0");
    if (!options.best.name.empty() && options.directory.empty())
      throw error("fit", s.rank(), "checkpoint.best needs checkpoint.directory: the best checkpoint goes to its best/");
    if constexpr (possible) {
      if (!options.directory.empty())
        saver_ = std::make_unique<Saver>(
            s, checkpoint::Options{.directory = options.directory, .keep = options.keep, .async = options.async});
      // Where fit saves checkpoints, any callback may keep an epoch as the best
      // (LoopControl::keep_as_best), not only CheckpointOptions::best's monitor.
      if (!options.directory.empty())
        best_ = std::make_unique<Saver>(
            s, checkpoint::Options{.directory = best_directory(), .keep = 1, .async = options.async});
    } else {
      throw error("fit", s.rank(),
                  "FitOptions::checkpoint is set, and this strategy or its optimizer cannot be checkpointed "
                  "(paratrain::checkpointable; SGD, Adam, AdamW, Adagrad, RMSprop)");
    }
  }

  /// Loads the checkpoint `from` (resume_point's) into the strategy and `metrics`. Collective.
  void load(const ResumePoint& from, Metrics& metrics) {
    if constexpr (possible) {
      const auto loaded = checkpoint::load(*s_, from.path);
      // Each rank's own metric sums, where the world is the one that saved them (at another
      // size the epoch's running metrics start afresh): a malformed entry is reported on every rank.
      std::string malformed;
      if (const auto it = loaded.rank_extra.find("metrics"); it != loaded.rank_extra.end()) {
        if (!it->value().isGenericDict()) malformed = "its metrics are not a dict";
        else
          for (const auto& item : it->value().toGenericDict()) {
            if (!item.key().isString() || !item.value().isDoubleList() || item.value().toDoubleList().size() != 2) {
              malformed = "a metric entry is not a name with two numbers";
              break;
            }
            const auto sw = item.value().toDoubleVector();
            metrics.add_sums(item.key().toStringRef(), sw[0], sw[1]);
          }
      }
      paratrain::detail::agree(*s_, "fit", malformed.empty() ? "" : from.path.string() + ": " + malformed + " (corrupt)");
      resumed_from_ = from.path;
    } else {
      static_cast<void>(from), static_cast<void>(metrics);
    }
  }

  /// Saves the strategy and the loop's position. Collective.
  void save(const FitPosition& p, const Metrics& metrics) {
    if constexpr (possible) {
      if (!saver_) return;
      saver_->save(p.step, extra_of(p), rank_extra_of(metrics));
    }
  }

  /// What a checkpoint at `p` records in its index, and in this rank's table.
  static checkpoint::Dict extra_of(const FitPosition& p) {
    auto extra = checkpoint::make_dict();
    extra.insert("fit", to_dict(p));
    return extra;
  }
  static checkpoint::Dict rank_extra_of(const Metrics& metrics) {
    auto rank_extra = checkpoint::make_dict();
    rank_extra.insert("metrics", metrics_dict(metrics));
    return rank_extra;
  }

  /// Saves the strategy and the loop's position as the best checkpoint, in best/, in place
  /// of the one before. Collective.
  void save_best(const FitPosition& p) {
    if constexpr (possible) {
      if (!best_) return;
      best_->save(p.step, extra_of(p), checkpoint::make_dict());
    }
  }

  /// Publishes a background save whose files are all written. Collective while one is in flight.
  void poll() {
    if constexpr (possible) {
      if (saver_) saver_->poll();
      if (best_) best_->poll();
    }
  }
  void wait() {
    if constexpr (possible) {
      if (saver_) saver_->wait();
      if (best_) best_->wait();
    }
  }

  /// Where CheckpointOptions::best keeps its checkpoint.
  [[nodiscard]] std::filesystem::path best_directory() const { return options_.directory / "best"; }

  [[nodiscard]] bool saving() const noexcept { return saver_ != nullptr; }
  [[nodiscard]] const std::optional<std::filesystem::path>& resumed_from() const noexcept { return resumed_from_; }

 private:
  S* s_;
  CheckpointOptions options_;
  std::unique_ptr<Saver> saver_;
  std::unique_ptr<Saver> best_;  // CheckpointOptions::best's
  std::optional<std::filesystem::path> resumed_from_;
};

}  // namespace detail
}  // namespace paratrain
