#pragma once
/// \file
/// paratrain::pipeline::check — the proof that a schedule runs: every stage's passes once
/// each, in an order its rank can keep, and no cycle of ranks waiting for each other
/// (Note [Schedules as data]). Standard library only.

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "paratrain/core/error.hpp"
#include "paratrain/pipeline/schedule.hpp"

namespace paratrain::pipeline {

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

}  // namespace paratrain::pipeline
