#pragma once
/// \file
/// paratrain::pipeline::simulate — a schedule run with given costs and no communication:
/// its bubble, its peak activation memory, the published bubble it should have, and a table
/// of it (Note [Schedules as data]). Standard library only.

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "paratrain/core/error.hpp"
#include "paratrain/pipeline/schedule.hpp"
#include "paratrain/pipeline/schedule_check.hpp"

namespace paratrain::pipeline {

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
