#pragma once
/// \file
/// paratrain::pipeline schedules as plain data: which forward and backward passes each
/// pipeline rank runs, and in which order (GPipe, 1F1B, interleaved 1F1B, ZB-H1), and the
/// replay both the checker (schedule_check.hpp: a schedule cannot deadlock) and the
/// simulator (schedule_simulation.hpp: its bubble and activation memory) run. Standard
/// library only: no LibTorch, so schedules can be designed and tested without a GPU. Note
/// [Schedules as data].

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "paratrain/core/error.hpp"

namespace paratrain::pipeline {

// Note [Schedules as data]
// The model is cut into S = ranks * v consecutive stages; stage s lives on rank s % ranks
// (with v > 1 every rank holds v model chunks: chunk c of rank r is stage c * ranks + r).
// A schedule is, for every rank, the list of compute actions it runs in that order.
// Communication is implied by the actions, never listed:
//   forward(s, m), s > 0, needs the output of forward(s - 1, m);
//   backward(s, m) or backward_input(s, m), s < S - 1, needs the input gradient that
//     backward or backward_input of (s + 1, m) produces; the last stage's backward needs
//     only its own forward (the loss);
//   backward_weight(s, m) needs only backward_input(s, m), on the same rank.
// A producer on another rank sends its result as soon as it finishes; a consumer on the
// same rank simply finds it. A rank therefore blocks only just before an action whose
// input comes from another rank, waiting for that one message.
//
// Why check()'s simulation proves the real run cannot deadlock: assume sends never block
// (buffered or non-blocking), a receive blocks until its message arrives, and messages
// are matched by (kind, stage, micro), not by arrival order. Then a rank's progress
// depends only on which producer actions have finished, exactly as in the simulation:
// it runs its list in order and may run the next action once that action's producer is
// done. Being done never reverts, so an action that may run stays runnable until it runs;
// hence every execution order reaches the same end state, and the simulation's sweep is
// one of them. If the sweep runs every action, so does every real run; if it stops with
// actions left, each stuck rank waits for an action that a stuck rank holds, and
// following the waits from any stuck rank closes a cycle, which check() reports.
// Dependencies on the same rank (a backward after its forward, backward_weight after
// backward_input) need no message: check() requires them in list order.

/// What one action computes for one micro-batch on one stage.
///
///   forward          the stage's forward pass; its activations stay alive until the backward
///   backward         the whole backward pass: input and weight gradients together
///   backward_input   the input-gradient half of a split backward (zero-bubble schedules);
///                    it sends the gradient on to the previous stage
///   backward_weight  the weight-gradient half; runs after backward_input, on the same rank
enum class Op : std::uint8_t { forward, backward, backward_input, backward_weight };

/// One action: `op` for micro-batch `micro` (0..M-1) on stage `stage` (0..stages()-1).
struct Action {
  Op op;
  int micro;
  int stage;
  friend bool operator==(const Action&, const Action&) = default;
};

/// A pipeline schedule: every rank's actions in the order it runs them.
struct Schedule {
  std::string name;                          ///< "GPipe", "1F1B", "interleaved 1F1B", "ZB-H1"
  int ranks = 1;                             ///< K, the pipeline ranks
  int micro_batches = 1;                     ///< M
  int virtual_stages = 1;                    ///< v, stages per rank; stage s lives on rank s % ranks
  std::vector<std::vector<Action>> actions;  ///< actions[r]: rank r's actions, in order

  [[nodiscard]] int stages() const { return ranks * virtual_stages; }
  [[nodiscard]] int rank_of(int stage) const { return stage % ranks; }
};

/// The schedules make_schedule builds.
///
///   gpipe             all forwards, then all backwards; every micro-batch alive at once
///   one_f_one_b       PipeDream-Flush / Megatron 1F1B: same bubble, at most K - r alive on rank r
///   interleaved_1f1b  Megatron's interleaved 1F1B: v chunks per rank cut the bubble by v
///   zero_bubble_h1    ZB-H1 (Qi et al. 2023): split backward, a third of 1F1B's bubble
///                     (equal costs), peak memory of 1F1B's first rank
enum class Kind : std::uint8_t { gpipe, one_f_one_b, interleaved_1f1b, zero_bubble_h1 };

/// Time of each action in a simulated run. A whole backward costs backward_input + backward_weight.
struct Costs {
  double forward = 1;
  double backward_input = 1;
  double backward_weight = 1;
};

/// A simulated run (simulate()): zero communication time, every action starting as soon as
/// its rank is free and its input has been produced.
struct Timeline {
  std::vector<std::vector<std::pair<double, Action>>> starts;  ///< per rank: (start time, action), in list order
  double makespan = 0;                                         ///< when the last action ends
  std::vector<double> busy;                                    ///< per rank: total compute time
  std::vector<double> bubble;                                  ///< per rank: 1 - busy / makespan
  /// Per rank: the most (stage, micro) activations stashed at once, each alive from its
  /// forward until its backward, or until its backward_weight for a split backward.
  std::vector<int> peak_alive;
};

namespace detail {

[[nodiscard]] inline std::string_view name_of(Op op) {
  switch (op) {
    case Op::forward: return "forward";
    case Op::backward: return "backward";
    case Op::backward_input: return "backward_input";
    case Op::backward_weight: return "backward_weight";
  }
  return "?";
}

/// "forward(stage 1, micro 0)": how every message names an action.
[[nodiscard]] inline std::string describe_action(const Action& a) {
  return std::string(name_of(a.op)) + "(stage " + std::to_string(a.stage) + ", micro " + std::to_string(a.micro) + ")";
}

[[nodiscard]] inline std::string on_rank(int rank, std::size_t index) {
  return "rank " + std::to_string(rank) + "'s action #" + std::to_string(index);
}

inline void require_shape(std::string_view operation, int ranks, int micro_batches, int v) {
  if (ranks < 1)
    throw error(operation, -1,
                "ranks is " + std::to_string(ranks) + "; a pipeline needs at least 1 rank (pass the pipeline size K)");
  if (micro_batches < 1)
    throw error(operation, -1,
                "micro_batches is " + std::to_string(micro_batches) +
                    "; split the batch into at least 1 micro-batch (M >= ranks keeps the bubble small)");
  if (v < 1)
    throw error(operation, -1,
                "virtual_stages is " + std::to_string(v) +
                    "; pass 1, or v > 1 model chunks per rank with Kind::interleaved_1f1b");
  if (static_cast<std::int64_t>(ranks) * v * micro_batches > (std::int64_t{1} << 28))
    throw error(operation, -1, "ranks * virtual_stages * micro_batches is over 2^28 actions; use fewer micro-batches");
}

inline void require_costs(std::string_view operation, const Costs& c) {
  for (auto [field, value] : {std::pair<std::string_view, double>{"forward", c.forward},
                              {"backward_input", c.backward_input},
                              {"backward_weight", c.backward_weight}})
    if (!std::isfinite(value) || value <= 0)
      throw error(operation, -1,
                  "Costs::" + std::string(field) + " is " + std::to_string(value) +
                      "; every cost must be a finite time > 0 (relative times are enough, e.g. 1, 1, 1)");
}

[[nodiscard]] inline double cost_of(Op op, const Costs& c) {
  switch (op) {
    case Op::forward: return c.forward;
    case Op::backward: return c.backward_input + c.backward_weight;
    case Op::backward_input: return c.backward_input;
    case Op::backward_weight: return c.backward_weight;
  }
  return 0;
}

/// The action on another stage that `a` waits for, if any: Note [Schedules as data].
/// `gradient_op(stage, micro)` says whether that (stage, micro) uses backward or backward_input.
template <class GradientOp>
[[nodiscard]] std::optional<Action> producer_of(const Action& a, int stages, GradientOp gradient_op) {
  if (a.op == Op::forward && a.stage > 0) return Action{Op::forward, a.micro, a.stage - 1};
  if ((a.op == Op::backward || a.op == Op::backward_input) && a.stage + 1 < stages)
    return Action{gradient_op(a.stage + 1, a.micro), a.micro, a.stage + 1};
  return std::nullopt;
}

/// Every rank running its list in order (Note [Schedules as data]); `start[r][i]` is when
/// rank r's action i starts, and `deadlock` says why the run stopped early ("" if it did not).
/// Requires the static checks of check() to have passed.
struct Replay {
  std::vector<std::vector<double>> start;
  std::string deadlock;
};

[[nodiscard]] inline Replay replay(const Schedule& s, const Costs& costs) {
  const int stages = s.stages();
  const int m_count = s.micro_batches;
  const auto at = [m_count](int stage, int micro) { return static_cast<std::size_t>(stage) * m_count + micro; };
  std::vector<Op> gradient_op(static_cast<std::size_t>(stages) * m_count, Op::backward);
  for (const auto& list : s.actions)
    for (const Action& a : list)
      if (a.op == Op::backward_input) gradient_op[at(a.stage, a.micro)] = Op::backward_input;
  const auto gradient = [&](int stage, int micro) { return gradient_op[at(stage, micro)]; };

  constexpr double pending = -1;  // finish times are > 0
  std::vector<double> forward_done(gradient_op.size(), pending), gradient_done(gradient_op.size(), pending);
  const auto done_at = [&](const Action& a) {
    return a.op == Op::forward ? forward_done[at(a.stage, a.micro)] : gradient_done[at(a.stage, a.micro)];
  };

  Replay out;
  out.start.resize(s.actions.size());
  std::vector<std::size_t> next(s.actions.size(), 0);
  std::vector<double> free_at(s.actions.size(), 0);
  for (bool moved = true; moved;) {
    moved = false;
    for (std::size_t r = 0; r < s.actions.size(); ++r) {
      for (; next[r] < s.actions[r].size(); ++next[r], moved = true) {
        const Action& a = s.actions[r][next[r]];
        double ready = 0;
        if (auto p = producer_of(a, stages, gradient)) {
          ready = done_at(*p);
          if (ready == pending) break;
        }
        const double start = std::max(free_at[r], ready);
        free_at[r] = start + cost_of(a.op, costs);
        out.start[r].push_back(start);
        if (a.op == Op::forward) forward_done[at(a.stage, a.micro)] = free_at[r];
        if (a.op == Op::backward || a.op == Op::backward_input) gradient_done[at(a.stage, a.micro)] = free_at[r];
      }
    }
  }

  // Stuck: follow the waits from the first stuck rank until a rank repeats.
  int r = 0;
  while (r < s.ranks && next[r] == s.actions[r].size()) ++r;
  if (r == s.ranks) return out;
  std::vector<int> path, place(s.ranks, -1);
  while (place[r] < 0) {
    place[r] = static_cast<int>(path.size());
    path.push_back(r);
    r = s.rank_of(producer_of(s.actions[r][next[r]], stages, gradient)->stage);
  }
  out.deadlock = "deadlock: no rank can go on, and these ranks wait for each other in a cycle: ";
  for (std::size_t k = static_cast<std::size_t>(place[r]); k < path.size(); ++k) {
    const int waiter = path[k];
    const Action& blocked = s.actions[waiter][next[waiter]];
    const Action wanted = *producer_of(blocked, stages, gradient);
    const int holder = s.rank_of(wanted.stage);
    const auto& list = s.actions[holder];
    const auto held =
        static_cast<std::size_t>(std::find(list.begin() + next[holder], list.end(), wanted) - list.begin());
    out.deadlock +=
        on_rank(waiter, next[waiter]) + ", " + describe_action(blocked) + ", waits for " + describe_action(wanted) +
        (holder == waiter ? ", which it runs itself later" : ", which rank " + std::to_string(holder) + " holds") +
        " (" + on_rank(holder, held) + "); ";
  }
  out.deadlock += "move one of the waited-for actions ahead of the action its rank is blocked at";
  return out;
}

inline void validate(std::string_view operation, Kind kind, int ranks, int micro_batches, int v) {
  require_shape(operation, ranks, micro_batches, v);
  if (v != 1 && kind != Kind::interleaved_1f1b)
    throw error(operation, -1,
                "virtual_stages is " + std::to_string(v) +
                    ", but only Kind::interleaved_1f1b runs several stages per rank; pass virtual_stages = 1 "
                    "or use Kind::interleaved_1f1b");
  if (kind == Kind::interleaved_1f1b && v > 1 && micro_batches % ranks != 0) {
    const int below = micro_batches / ranks * ranks;
    throw error(
        operation, -1,
        "interleaved 1F1B needs micro_batches to be a multiple of ranks, as Megatron-LM does: micro_batches is " +
            std::to_string(micro_batches) + " and ranks is " + std::to_string(ranks) + "; use " +
            (below > 0 ? std::to_string(below) + " or " : std::string()) + std::to_string(below + ranks) +
            " micro-batches, or virtual_stages = 1");
  }
}

[[nodiscard]] inline Schedule empty(std::string name, int ranks, int micro_batches, int v) {
  Schedule s{
      .name = std::move(name), .ranks = ranks, .micro_batches = micro_batches, .virtual_stages = v, .actions = {}};
  s.actions.resize(static_cast<std::size_t>(ranks));
  return s;
}

/// The 1F1B pattern every schedule but GPipe shares: `warmup` forwards, then one forward
/// and one backward in turn, then the backwards left; forward(k) and backward(k) add the
/// k-th of `total` of each.
template <class Forward, class Backward>
void one_forward_one_backward(int total, int warmup, Forward&& forward, Backward&& backward) {
  for (int k = 0; k < warmup; ++k) forward(k);
  for (int k = 0; k + warmup < total; ++k) {
    forward(warmup + k);
    backward(k);
  }
  for (int k = total - warmup; k < total; ++k) backward(k);
}

}  // namespace detail

/// GPipe (Huang et al. 2019): every rank runs all M forwards, then all M backwards, the
/// backwards in reverse micro-batch order (M-1 first), as in GPipe's Figure 2: the last
/// rank starts the backward of the micro-batch it has just finished. Every micro-batch's
/// activations are alive at once on every rank.
[[nodiscard]] inline Schedule gpipe(int ranks, int micro_batches, int virtual_stages = 1) {
  detail::require_shape("pipeline::gpipe", ranks, micro_batches, virtual_stages);
  Schedule s = detail::empty("GPipe", ranks, micro_batches, virtual_stages);
  // With v > 1 (a pipeline laid out for interleaving, on a step whose M is no multiple of
  // K) each rank runs its chunks in order, forwards then backwards, chunk by chunk.
  for (int r = 0; r < ranks; ++r) {
    for (int c = 0; c < virtual_stages; ++c)
      for (int m = 0; m < micro_batches; ++m) s.actions[r].push_back({Op::forward, m, c * ranks + r});
    for (int c = virtual_stages - 1; c >= 0; --c)
      for (int m = micro_batches - 1; m >= 0; --m) s.actions[r].push_back({Op::backward, m, c * ranks + r});
  }
  return s;
}

/// 1F1B with a flush (PipeDream-Flush, Narayanan et al. 2021; Megatron-LM's non-interleaved
/// schedule): rank r runs min(K - r - 1, M) warm-up forwards, then alternates one forward
/// and one backward, then runs the backwards left. GPipe's bubble, but at most
/// min(K - r, M) micro-batches alive on rank r.
[[nodiscard]] inline Schedule one_f_one_b(int ranks, int micro_batches) {
  detail::validate("pipeline::one_f_one_b", Kind::one_f_one_b, ranks, micro_batches, 1);
  Schedule s = detail::empty("1F1B", ranks, micro_batches, 1);
  for (int r = 0; r < ranks; ++r) {
    auto& list = s.actions[r];
    detail::one_forward_one_backward(
        micro_batches, std::min(ranks - r - 1, micro_batches), [&](int m) { list.push_back({Op::forward, m, r}); },
        [&](int m) { list.push_back({Op::backward, m, r}); });
  }
  return s;
}

/// Megatron-LM's interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language
/// Model Training on GPU Clusters Using Megatron-LM", Section 2.2): rank r holds v model
/// chunks, stages r, r + K, ..., r + (v-1) K. Forwards go through micro-batches in groups
/// of K: micro-batches 0..K-1 through chunk 0, then through chunk 1, ..., then the next
/// group; backwards follow the same order with the chunks reversed. Rank r runs
/// (K - r - 1) * 2 + (v - 1) * K warm-up forwards, then alternates, then drains.
/// Needs M % K == 0 when v > 1, as Megatron-LM does; v = 1 is one_f_one_b's schedule
/// (the doubled warm-up only pairs chunk-to-chunk messages, which v = 1 has none of).
[[nodiscard]] inline Schedule interleaved_1f1b(int ranks, int micro_batches, int v) {
  detail::validate("pipeline::interleaved_1f1b", Kind::interleaved_1f1b, ranks, micro_batches, v);
  if (v == 1) {
    Schedule s = one_f_one_b(ranks, micro_batches);
    s.name = "interleaved 1F1B";
    return s;
  }
  Schedule s = detail::empty("interleaved 1F1B", ranks, micro_batches, v);
  const int total = micro_batches * v;
  // The k-th forward (or backward) of a rank: micro-batch and model chunk.
  const auto micro_of = [&](int k) { return k / (ranks * v) * ranks + k % ranks; };
  const auto chunk_of = [&](int k) { return k / ranks % v; };
  for (int r = 0; r < ranks; ++r) {
    auto& list = s.actions[r];
    const auto forward = [&](int k) { list.push_back({Op::forward, micro_of(k), chunk_of(k) * ranks + r}); };
    const auto backward = [&](int k) {
      list.push_back({Op::backward, micro_of(k), (v - 1 - chunk_of(k)) * ranks + r});
    };
    detail::one_forward_one_backward(total, std::min((ranks - r - 1) * 2 + (v - 1) * ranks, total), forward,
                                     backward);
  }
  return s;
}

/// ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Section 2.1, Figure 3 top):
/// 1F1B's forwards and input-gradient backwards (B) in 1F1B's order, K - r - 1 warm-up
/// forwards on rank r, with each weight-gradient pass (W) delayed: in the steady state rank
/// r runs W(i - r) right after B(i), so every rank holds min(K, M) micro-batches (until
/// their W), the most 1F1B holds on rank 0; in the cool-down each B is followed by the
/// oldest pending W, and the W's left close the list, filling the tail bubble.
/// With equal costs and M >= K its idle time is (K-1)(F + B - W), a third of 1F1B's.
[[nodiscard]] inline Schedule zero_bubble_h1(int ranks, int micro_batches) {
  detail::validate("pipeline::zero_bubble_h1", Kind::zero_bubble_h1, ranks, micro_batches, 1);
  Schedule s = detail::empty("ZB-H1", ranks, micro_batches, 1);
  for (int r = 0; r < ranks; ++r) {
    auto& list = s.actions[r];
    int next_w = 0;
    const auto weight = [&] { list.push_back({Op::backward_weight, next_w++, r}); };
    const int warmup = std::min(ranks - r - 1, micro_batches);
    detail::one_forward_one_backward(
        micro_batches, warmup, [&](int m) { list.push_back({Op::forward, m, r}); },
        [&](int i) {
          list.push_back({Op::backward_input, i, r});
          // Steady state: W(i - r); cool-down (the last `warmup` B's): the oldest pending W.
          if (i >= r || i >= micro_batches - warmup) weight();
        });
    while (next_w < micro_batches) weight();
  }
  return s;
}

/// The schedule of `kind` for `ranks` pipeline ranks and `micro_batches` micro-batches.
///
/// Throws paratrain::error naming the fix for ranks < 1, micro_batches < 1,
/// virtual_stages < 1, virtual_stages > 1 with a kind other than interleaved_1f1b, and
/// interleaved_1f1b with virtual_stages > 1 and micro_batches not a multiple of ranks.
/// \code
///   auto s = pipeline::make_schedule(pipeline::Kind::one_f_one_b, 4, 8);
///   pipeline::simulate(s).bubble[0];   // 3/11, the published (K-1)/(M+K-1)
/// \endcode
[[nodiscard]] inline Schedule make_schedule(Kind kind, int ranks, int micro_batches, int virtual_stages = 1) {
  detail::validate("pipeline::make_schedule", kind, ranks, micro_batches, virtual_stages);
  switch (kind) {
    case Kind::gpipe: return gpipe(ranks, micro_batches);
    case Kind::one_f_one_b: return one_f_one_b(ranks, micro_batches);
    case Kind::interleaved_1f1b: return interleaved_1f1b(ranks, micro_batches, virtual_stages);
    case Kind::zero_bubble_h1: return zero_bubble_h1(ranks, micro_batches);
  }
  throw error("pipeline::make_schedule", -1,
              "unknown Kind; use one of gpipe, one_f_one_b, interleaved_1f1b, zero_bubble_h1");
}

}  // namespace paratrain::pipeline
