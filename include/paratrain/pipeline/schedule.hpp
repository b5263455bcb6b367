#pragma once
/// \file
/// paratrain::pipeline schedules as plain data: which forward and backward passes each
/// pipeline rank runs, and in which order (GPipe, 1F1B, interleaved 1F1B, ZB-H1); a
/// checker that proves a schedule cannot deadlock, and a simulator that measures its
/// bubble and activation memory. Standard library only: no LibTorch, so schedules can be
/// designed and tested without a GPU. Note [Schedules as data].

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

/// Throws paratrain::error (operation "pipeline::check") naming the first problem: an
/// action with an unknown op, a stage or micro-batch out of range, or on a rank that does
/// not own its stage; a (stage, micro) without exactly one forward and either one
/// backward or one backward_input and one backward_weight; a backward before its forward,
/// or a backward_weight before its backward_input, on its rank; a deadlock, reported as
/// the cycle of ranks waiting for each other (Note [Schedules as data]).
inline void check(const Schedule& s) {
  constexpr std::string_view operation = "pipeline::check";
  detail::require_shape(operation, s.ranks, s.micro_batches, s.virtual_stages);
  if (s.actions.size() != static_cast<std::size_t>(s.ranks))
    throw error(operation, -1,
                "Schedule::actions has " + std::to_string(s.actions.size()) + " lists for " + std::to_string(s.ranks) +
                    " ranks; give every rank exactly one list of actions");
  const int stages = s.stages();
  const int m_count = s.micro_batches;
  constexpr std::size_t absent = static_cast<std::size_t>(-1);
  struct Seen {
    std::size_t at[4] = {absent, absent, absent, absent};  // position in the rank's list, per Op
  };
  std::vector<Seen> seen(static_cast<std::size_t>(stages) * m_count);

  for (int r = 0; r < s.ranks; ++r) {
    for (std::size_t i = 0; i < s.actions[r].size(); ++i) {
      const Action& a = s.actions[r][i];
      const auto op = static_cast<unsigned>(a.op);
      if (op > 3)
        throw error(operation, -1, detail::on_rank(r, i) + " has Op value " + std::to_string(op) + ", which is no Op");
      const std::string what = detail::on_rank(r, i) + ", " + detail::describe_action(a);
      if (a.stage < 0 || a.stage >= stages)
        throw error(operation, -1,
                    what + ": the stage is out of range; stages run 0.." + std::to_string(stages - 1) +
                        " (ranks * virtual_stages - 1)");
      if (a.micro < 0 || a.micro >= m_count)
        throw error(operation, -1,
                    what + ": the micro-batch is out of range; micro-batches run 0.." + std::to_string(m_count - 1));
      if (s.rank_of(a.stage) != r)
        throw error(operation, -1,
                    what + ": stage " + std::to_string(a.stage) + " lives on rank " +
                        std::to_string(s.rank_of(a.stage)) +
                        " (stage s lives on rank s % ranks); move the action to that rank's list");
      std::size_t& first = seen[static_cast<std::size_t>(a.stage) * m_count + a.micro].at[op];
      if (first != absent)
        throw error(operation, -1,
                    detail::describe_action(a) + " appears twice on rank " + std::to_string(r) + " (actions #" +
                        std::to_string(first) + " and #" + std::to_string(i) + "); run each action exactly once");
      first = i;
    }
  }

  for (int stage = 0; stage < stages; ++stage) {
    for (int m = 0; m < m_count; ++m) {
      const auto& at = seen[static_cast<std::size_t>(stage) * m_count + m].at;
      const auto has = [&](Op op) { return at[static_cast<unsigned>(op)] != absent; };
      const auto name = [&](Op op) { return detail::describe_action({op, m, stage}); };
      const std::string rank = "rank " + std::to_string(s.rank_of(stage));
      if (!has(Op::forward))
        throw error(operation, -1, name(Op::forward) + " is missing; add it to " + rank + "'s list");
      if (has(Op::backward) && (has(Op::backward_input) || has(Op::backward_weight)))
        throw error(operation, -1,
                    "(stage " + std::to_string(stage) + ", micro " + std::to_string(m) +
                        ") has both a backward and a split backward on " + rank +
                        "; run either backward or backward_input + backward_weight");
      if (!has(Op::backward) && !has(Op::backward_input) && !has(Op::backward_weight))
        throw error(operation, -1,
                    name(Op::backward) + " is missing: " + rank +
                        " never runs a backward for it; add a backward, or a "
                        "backward_input and a backward_weight");
      if (!has(Op::backward) && !has(Op::backward_input))
        throw error(operation, -1,
                    name(Op::backward_input) + " is missing; a split backward needs both halves on " + rank);
      if (!has(Op::backward) && !has(Op::backward_weight))
        throw error(operation, -1,
                    name(Op::backward_weight) + " is missing; a split backward needs both halves on " + rank);
      const Op gradient = has(Op::backward) ? Op::backward : Op::backward_input;
      const auto before = [&](Op later, Op earlier, std::string_view why) {
        if (at[static_cast<unsigned>(later)] < at[static_cast<unsigned>(earlier)])
          throw error(operation, -1,
                      rank + " runs " + name(later) + " (action #" + std::to_string(at[static_cast<unsigned>(later)]) +
                          ") before " + name(earlier) + " (action #" +
                          std::to_string(at[static_cast<unsigned>(earlier)]) + "); " + std::string(why));
      };
      before(gradient, Op::forward, "a backward needs its forward's activations: move the forward earlier");
      if (gradient == Op::backward_input)
        before(Op::backward_weight, Op::backward_input,
               "backward_weight needs backward_input's output gradient: move it after the backward_input");
    }
  }

  if (auto run = detail::replay(s, Costs{}); !run.deadlock.empty()) throw error(operation, -1, run.deadlock);
}

/// Runs `s` with `costs` and no communication time (Note [Schedules as data]): each action
/// starts as soon as its rank is free and its input exists. Calls check() first; throws
/// paratrain::error for a cost that is not a finite number > 0.
[[nodiscard]] inline Timeline simulate(const Schedule& s, Costs costs = {}) {
  detail::require_costs("pipeline::simulate", costs);
  check(s);
  const detail::Replay run = detail::replay(s, costs);
  Timeline t;
  t.starts.resize(s.actions.size());
  for (std::size_t r = 0; r < s.actions.size(); ++r) {
    double busy = 0;
    int alive = 0, peak = 0;
    for (std::size_t i = 0; i < s.actions[r].size(); ++i) {
      const Action& a = s.actions[r][i];
      t.starts[r].emplace_back(run.start[r][i], a);
      busy += detail::cost_of(a.op, costs);
      t.makespan = std::max(t.makespan, run.start[r][i] + detail::cost_of(a.op, costs));
      if (a.op == Op::forward) peak = std::max(peak, ++alive);
      if (a.op == Op::backward || a.op == Op::backward_weight) --alive;
    }
    t.busy.push_back(busy);
    t.peak_alive.push_back(peak);
  }
  for (double busy : t.busy) t.bubble.push_back(1 - busy / t.makespan);
  return t;
}

/// The published idle share of each rank, idle / (idle + busy), for M micro-batches on K
/// ranks (the arguments are validated as make_schedule does). The papers state a ratio
/// idle / busy (their "bubble time fraction"); idle / (idle + busy) = ratio / (1 + ratio).
///   GPipe, 1F1B   (K-1) / (M + K - 1): GPipe's bubble overhead O((K-1)/(M+K-1)) (Huang et
///                 al. 2019, arXiv:1811.06965); for 1F1B the ratio (K-1)/M of Narayanan et
///                 al. 2021 (arXiv:2104.04473, Section 2.2.1)
///   interleaved   (K-1) / (v M + K - 1): the ratio (K-1)/(v M), same paper, Section 2.2.2
///   ZB-H1         idle / (idle + busy) with idle = (K-1)(F + B - W) and busy = M (F + B + W),
///                 F, B, W the costs of forward, backward_input, backward_weight: Qi et al.
///                 2023 (arXiv:2401.10241, Section 2.1, Figure 3), which assumes M >= K;
///                 idle is clamped at 0 for W > F + B
/// The first three do not depend on the costs: idle and busy time scale alike.
[[nodiscard]] inline double theoretical_bubble(Kind kind, int ranks, int micro_batches, int v, Costs costs) {
  constexpr std::string_view operation = "pipeline::theoretical_bubble";
  detail::validate(operation, kind, ranks, micro_batches, v);
  detail::require_costs(operation, costs);
  const double k = ranks, m = micro_batches;
  switch (kind) {
    case Kind::gpipe:
    case Kind::one_f_one_b: return (k - 1) / (m + k - 1);
    case Kind::interleaved_1f1b: return (k - 1) / (v * m + k - 1);
    case Kind::zero_bubble_h1: {
      const double idle = std::max(0.0, (k - 1) * (costs.forward + costs.backward_input - costs.backward_weight));
      const double busy = m * (costs.forward + costs.backward_input + costs.backward_weight);
      return idle / (idle + busy);
    }
  }
  throw error(operation, -1, "unknown Kind; use one of gpipe, one_f_one_b, interleaved_1f1b, zero_bubble_h1");
}

/// The simulated run as a Markdown table: a header line, then one row per rank and one
/// column per tick, a tick being the gcd of the costs. Cells: F3 forward, B3 backward
/// (repeated over every tick it spans), b3 backward_input, w3 backward_weight, micro-batches
/// numbered from 0, with ".c" for the rank's model chunk c when v > 1 (F3.1: micro-batch 3
/// on stage 1 * ranks + r); an empty cell is idle. Throws paratrain::error unless every cost
/// is a whole number from 1 to 10^6.
[[nodiscard]] inline std::string table(const Schedule& s, Costs costs = {}) {
  std::int64_t whole[3] = {};
  const double given[3] = {costs.forward, costs.backward_input, costs.backward_weight};
  for (int i = 0; i < 3; ++i) {
    if (!(given[i] >= 1 && given[i] <= 1e6 && given[i] == std::floor(given[i])))
      throw error("pipeline::table", -1,
                  "Costs::" +
                      std::string(i == 0   ? "forward"
                                  : i == 1 ? "backward_input"
                                           : "backward_weight") +
                      " is " + std::to_string(given[i]) +
                      "; table() draws one column per tick, so every cost must be a whole number from 1 to 10^6 "
                      "(scale them, e.g. 1.5, 1, 1 to 3, 2, 2)");
    whole[i] = static_cast<std::int64_t>(given[i]);
  }
  const std::int64_t tick = std::gcd(std::gcd(whole[0], whole[1]), whole[2]);
  const Timeline t = simulate(s, costs);
  const auto ticks = static_cast<std::size_t>(std::llround(t.makespan) / tick);
  std::vector<std::vector<std::string>> cells(s.actions.size(), std::vector<std::string>(ticks));
  for (std::size_t r = 0; r < t.starts.size(); ++r) {
    for (const auto& [start, a] : t.starts[r]) {
      static constexpr std::string_view letter = "FBbw";
      std::string label(1, letter[static_cast<unsigned>(a.op)]);
      label += std::to_string(a.micro);
      if (s.virtual_stages > 1) label.append(".").append(std::to_string(a.stage / s.ranks));
      const auto first = static_cast<std::size_t>(std::llround(start) / tick);
      const auto span = static_cast<std::size_t>(std::llround(detail::cost_of(a.op, costs)) / tick);
      for (std::size_t c = first; c < first + span; ++c) cells[r][c] = label;
    }
  }
  std::string out = s.name + ", " + std::to_string(s.ranks) + " ranks, " + std::to_string(s.micro_batches) +
                    " micro-batches (numbered from 0)";
  if (s.virtual_stages > 1)
    out += ", " + std::to_string(s.virtual_stages) + " stages per rank (suffix .c: the rank's chunk c, stage c * " +
           std::to_string(s.ranks) + " + rank)";
  out += ". One column per " + std::to_string(tick) + (tick == 1 ? " time unit" : " time units") + ". F forward (" +
         std::to_string(whole[0]) + "), B backward (" + std::to_string(whole[1] + whole[2]) + "), b backward_input (" +
         std::to_string(whole[1]) + "), w backward_weight (" + std::to_string(whole[2]) + "); blank: idle.\n\n| rank |";
  for (std::size_t c = 0; c < ticks; ++c) out += " " + std::to_string(c) + " |";
  out += "\n|---|";
  for (std::size_t c = 0; c < ticks; ++c) out += "---|";
  out += "\n";
  for (std::size_t r = 0; r < cells.size(); ++r) {
    out += "| " + std::to_string(r) + " |";
    for (const std::string& cell : cells[r]) out += " " + cell + " |";
    out += "\n";
  }
  return out;
}

}  // namespace paratrain::pipeline
