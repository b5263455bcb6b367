// paratrain::pipeline schedules against their definitions and published bubble formulas:
// GPipe (Huang et al. 2019), 1F1B and interleaved 1F1B (Narayanan et al. 2021), ZB-H1
// (Qi et al. 2023). Its own executable: schedule.hpp needs neither MPI nor LibTorch.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <paratrain/pipeline/schedule.hpp>
#include <paratrain/pipeline/schedule_check.hpp>
#include <paratrain/pipeline/schedule_simulation.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace pipeline = paratrain::pipeline;
using pipeline::Action;
using pipeline::Kind;
using pipeline::Op;

namespace {

constexpr std::array<Kind, 4> kinds{Kind::gpipe, Kind::one_f_one_b, Kind::interleaved_1f1b, Kind::zero_bubble_h1};

// Every (kind, K, M, v) the sweep covers: K 1..6, M 1..16, v 1..3 where make_schedule accepts it.
struct Case {
  Kind kind;
  int ranks, micro_batches, v;
};

std::vector<Case> sweep() {
  std::vector<Case> cases;
  for (Kind kind : kinds)
    for (int k = 1; k <= 6; ++k)
      for (int m = 1; m <= 16; ++m)
        for (int v = 1; v <= 3; ++v) {
          if (v > 1 && (kind != Kind::interleaved_1f1b || m % k != 0)) continue;
          cases.push_back({kind, k, m, v});
        }
  return cases;
}

std::string label(const Case& c) {
  return "kind " + std::to_string(static_cast<int>(c.kind)) + ", K " + std::to_string(c.ranks) + ", M " +
         std::to_string(c.micro_batches) + ", v " + std::to_string(c.v);
}

// Swap rank r's actions i and j of a copy of s.
pipeline::Schedule swapped(pipeline::Schedule s, int r, std::size_t i, std::size_t j) {
  std::swap(s.actions[r][i], s.actions[r][j]);
  return s;
}

std::size_t position(const pipeline::Schedule& s, int r, Action a) {
  return static_cast<std::size_t>(std::find(s.actions[r].begin(), s.actions[r].end(), a) - s.actions[r].begin());
}

}  // namespace

TEST_CASE("every kind's schedule passes check() for K 1..6, M 1..16, v 1..3") {
  for (const Case& c : sweep()) {
    INFO(label(c));
    CHECK_NOTHROW(pipeline::check(pipeline::make_schedule(c.kind, c.ranks, c.micro_batches, c.v)));
  }
}

TEST_CASE("each (stage, micro) has exactly its forward and its backward, on the rank that owns the stage") {
  for (const Case& c : sweep()) {
    INFO(label(c));
    const auto s = pipeline::make_schedule(c.kind, c.ranks, c.micro_batches, c.v);
    REQUIRE(s.stages() == c.ranks * c.v);
    REQUIRE(s.actions.size() == static_cast<std::size_t>(c.ranks));
    // count[stage][micro][op], counted here rather than by check().
    std::vector<std::vector<std::array<int, 4>>> count(s.stages(), std::vector<std::array<int, 4>>(c.micro_batches));
    bool owned = true, in_range = true;
    for (int r = 0; r < c.ranks; ++r)
      for (const Action& a : s.actions[r]) {
        in_range = in_range && a.stage >= 0 && a.stage < s.stages() && a.micro >= 0 && a.micro < c.micro_batches;
        if (!in_range) break;
        owned = owned && a.stage % c.ranks == r;
        ++count[a.stage][a.micro][static_cast<int>(a.op)];
      }
    REQUIRE(in_range);
    CHECK(owned);
    const std::array<int, 4> expected =
        c.kind == Kind::zero_bubble_h1 ? std::array<int, 4>{1, 0, 1, 1} : std::array<int, 4>{1, 1, 0, 0};
    bool exact = true;
    for (const auto& per_stage : count)
      for (const auto& ops : per_stage) exact = exact && ops == expected;
    CHECK(exact);
  }
}

TEST_CASE("1F1B holds at most K - r micro-batches on rank r, ZB-H1 at most K, GPipe all M") {
  for (int k = 1; k <= 6; ++k)
    for (int m = 1; m <= 16; ++m) {
      INFO("K " << k << ", M " << m);
      const auto gpipe = pipeline::simulate(pipeline::gpipe(k, m));
      const auto one_f_one_b = pipeline::simulate(pipeline::one_f_one_b(k, m));
      const auto zb = pipeline::simulate(pipeline::zero_bubble_h1(k, m));
      for (int r = 0; r < k; ++r) {
        CHECK(gpipe.peak_alive[r] == m);
        CHECK(one_f_one_b.peak_alive[r] == std::min(k - r, m));
        CHECK(one_f_one_b.peak_alive[r] <= k);
        CHECK(zb.peak_alive[r] <= k);
        // ZB-H1 keeps the same number of micro-batches in flight on every rank.
        CHECK(zb.peak_alive[r] == std::min(k, m));
      }
    }
}

TEST_CASE("the simulated bubble is the published one: GPipe, 1F1B, interleaved 1F1B with M % K == 0") {
  const pipeline::Costs unit{.forward = 1, .backward_input = 1, .backward_weight = 1};  // F = 1, B = 2
  for (const Case& c : sweep()) {
    if (c.kind == Kind::zero_bubble_h1) continue;
    if (c.kind == Kind::interleaved_1f1b && c.micro_batches % c.ranks != 0) continue;
    INFO(label(c));
    const auto t = pipeline::simulate(pipeline::make_schedule(c.kind, c.ranks, c.micro_batches, c.v), unit);
    const double published = pipeline::theoretical_bubble(c.kind, c.ranks, c.micro_batches, c.v, unit);
    if (c.kind == Kind::interleaved_1f1b)
      CHECK(published == doctest::Approx((c.ranks - 1.0) / (c.v * c.micro_batches + c.ranks - 1.0)).epsilon(1e-15));
    else
      CHECK(published == doctest::Approx((c.ranks - 1.0) / (c.micro_batches + c.ranks - 1.0)).epsilon(1e-15));
    for (double bubble : t.bubble) CHECK(bubble == doctest::Approx(published).epsilon(1e-12));
  }
}

TEST_CASE("GPipe over virtual stages (interleaved 1F1B's steps whose M is no multiple of K) passes the checker") {
  for (int k = 1; k <= 6; ++k)
    for (int m = 1; m <= 16; ++m)
      for (int v = 2; v <= 3; ++v) {
        INFO("K " << k << ", M " << m << ", v " << v);
        const auto s = pipeline::gpipe(k, m, v);
        CHECK_NOTHROW(pipeline::check(s));
        // Every stage of the rank, forward and backward, for every micro-batch.
        for (const auto& actions : s.actions) CHECK(actions.size() == static_cast<std::size_t>(2 * m * v));
      }
}

TEST_CASE("GPipe's and 1F1B's makespan is (M + K - 1)(F + B) for other costs too") {
  const pipeline::Costs costs{.forward = 2, .backward_input = 3, .backward_weight = 1};
  for (int k = 1; k <= 6; ++k)
    for (int m = 1; m <= 16; ++m) {
      INFO("K " << k << ", M " << m);
      const double expected = (m + k - 1) * (2.0 + 3.0 + 1.0);
      CHECK(pipeline::simulate(pipeline::gpipe(k, m), costs).makespan == expected);
      CHECK(pipeline::simulate(pipeline::one_f_one_b(k, m), costs).makespan == expected);
    }
}

TEST_CASE("ZB-H1 reaches Qi et al.'s (K-1)(F+B-W) idle time with equal costs and M >= K") {
  const pipeline::Costs unit{};
  for (int k = 1; k <= 6; ++k)
    for (int m = k; m <= 16; ++m) {
      INFO("K " << k << ", M " << m);
      const auto t = pipeline::simulate(pipeline::zero_bubble_h1(k, m), unit);
      const double published = pipeline::theoretical_bubble(Kind::zero_bubble_h1, k, m, 1, unit);
      CHECK(published == doctest::Approx((k - 1.0) / ((k - 1.0) + 3.0 * m)).epsilon(1e-15));
      for (double bubble : t.bubble) CHECK(bubble == doctest::Approx(published).epsilon(1e-12));
    }
}

TEST_CASE("ZB-H1's simulated bubble is below 1F1B's for K >= 2, M >= K") {
  for (const pipeline::Costs costs : {pipeline::Costs{1, 1, 1}, pipeline::Costs{1, 2, 1}, pipeline::Costs{2, 2, 1}})
    for (int k = 2; k <= 6; ++k)
      for (int m = k; m <= 16; ++m) {
        INFO("K " << k << ", M " << m << ", costs " << costs.forward << " " << costs.backward_input << " "
                  << costs.backward_weight);
        const auto zb = pipeline::simulate(pipeline::zero_bubble_h1(k, m), costs);
        const auto one_f_one_b = pipeline::simulate(pipeline::one_f_one_b(k, m), costs);
        for (int r = 0; r < k; ++r) CHECK(zb.bubble[r] < one_f_one_b.bubble[r]);
      }
}

TEST_CASE("check() names a deadlock as a cycle of waiting ranks") {
  // 1F1B K=2 M=3: rank 0 runs F0 F1 B0 F2 B1 B2, rank 1 runs F0 B0 F1 B1 F2 B2. Swapping rank
  // 1's B0 and F2 (F0 F2 F1 B1 B0 B2) keeps every backward after its forward, but rank 0 now
  // waits at B0 for rank 1's B0 while rank 1 waits at F2 for rank 0's F2.
  const auto bad = swapped(pipeline::one_f_one_b(2, 3), 1, 1, 4);
  CHECK_THROWS_WITH_AS(pipeline::check(bad), doctest::Contains("deadlock"), paratrain::error);
  CHECK_THROWS_WITH_AS(pipeline::check(bad),
                       doctest::Contains("rank 0's action #2, backward(stage 0, micro 0), waits for backward(stage 1, "
                                         "micro 0), which rank 1 holds (rank 1's action #4)"),
                       paratrain::error);
  CHECK_THROWS_WITH_AS(pipeline::check(bad),
                       doctest::Contains("rank 1's action #1, forward(stage 1, micro 2), waits for forward(stage 0, "
                                         "micro 2), which rank 0 holds (rank 0's action #3)"),
                       paratrain::error);
  CHECK_THROWS_WITH_AS((void)pipeline::simulate(bad), doctest::Contains("pipeline::check"), paratrain::error);

  // One rank waiting for itself: K=1 v=2 with chunk 1's forward before chunk 0's.
  auto self = pipeline::interleaved_1f1b(1, 1, 2);  // F(s0) F(s1) B(s1) B(s0)
  std::swap(self.actions[0][0], self.actions[0][1]);
  CHECK_THROWS_WITH_AS(pipeline::check(self), doctest::Contains("deadlock"), paratrain::error);
  CHECK_THROWS_WITH_AS(pipeline::check(self), doctest::Contains("which it runs itself later"), paratrain::error);
}

TEST_CASE("check() rejects a missing action, a wrong rank, a W before its B, and other malformed schedules") {
  SUBCASE("a missing backward") {
    auto s = pipeline::one_f_one_b(3, 4);
    s.actions[2].pop_back();  // rank 2's last backward, micro 3
    CHECK_THROWS_WITH_AS(pipeline::check(s), doctest::Contains("backward(stage 2, micro 3) is missing"),
                         paratrain::error);
  }
  SUBCASE("a missing forward") {
    auto s = pipeline::gpipe(2, 3);
    s.actions[1].erase(s.actions[1].begin());
    CHECK_THROWS_WITH_AS(pipeline::check(s), doctest::Contains("forward(stage 1, micro 0) is missing"),
                         paratrain::error);
  }
  SUBCASE("an action on a rank that does not own its stage") {
    auto s = pipeline::one_f_one_b(2, 2);
    s.actions[1].push_back(s.actions[0].back());
    s.actions[0].pop_back();
    CHECK_THROWS_WITH_AS(pipeline::check(s), doctest::Contains("stage 0 lives on rank 0"), paratrain::error);
  }
  SUBCASE("a backward_weight before its backward_input") {
    auto s = pipeline::zero_bubble_h1(2, 3);
    const auto b = position(s, 1, {Op::backward_input, 2, 1});
    const auto w = position(s, 1, {Op::backward_weight, 2, 1});
    REQUIRE(b < w);
    std::swap(s.actions[1][b], s.actions[1][w]);
    const std::string message = "rank 1 runs backward_weight(stage 1, micro 2) (action #" + std::to_string(b) +
                                ") before backward_input(stage 1, micro 2)";
    CHECK_THROWS_WITH_AS(pipeline::check(s), doctest::Contains(message.c_str()), paratrain::error);
  }
  SUBCASE("a backward before its forward") {
    auto s = pipeline::gpipe(1, 2);  // F0 F1 B1 B0
    auto bad = swapped(s, 0, 1, 2);
    CHECK_THROWS_WITH_AS(pipeline::check(bad),
                         doctest::Contains("runs backward(stage 0, micro 1) (action #1) before forward"),
                         paratrain::error);
  }
  SUBCASE("a forward twice") {
    auto s = pipeline::gpipe(2, 2);
    s.actions[0].push_back({Op::forward, 0, 0});
    CHECK_THROWS_WITH_AS(pipeline::check(s), doctest::Contains("forward(stage 0, micro 0) appears twice on rank 0"),
                         paratrain::error);
  }
  SUBCASE("a backward mixed with a split backward") {
    auto s = pipeline::gpipe(2, 2);
    s.actions[1].push_back({Op::backward_weight, 0, 1});
    CHECK_THROWS_WITH_AS(pipeline::check(s), doctest::Contains("has both a backward and a split backward"),
                         paratrain::error);
  }
  SUBCASE("micro-batch and stage out of range") {
    auto s = pipeline::gpipe(2, 2);
    s.actions[0].push_back({Op::forward, 2, 0});
    CHECK_THROWS_WITH_AS(pipeline::check(s), doctest::Contains("micro-batches run 0..1"), paratrain::error);
    s = pipeline::gpipe(2, 2);
    s.actions[0].push_back({Op::forward, 0, 4});
    CHECK_THROWS_WITH_AS(pipeline::check(s), doctest::Contains("stages run 0..1"), paratrain::error);
  }
  SUBCASE("a list per rank") {
    auto s = pipeline::gpipe(2, 2);
    s.actions.pop_back();
    CHECK_THROWS_WITH_AS(pipeline::check(s), doctest::Contains("has 1 lists for 2 ranks"), paratrain::error);
  }
}

TEST_CASE("make_schedule rejects bad arguments with the fix") {
  CHECK_THROWS_WITH_AS((void)pipeline::make_schedule(Kind::gpipe, 0, 4), doctest::Contains("ranks is 0"),
                       paratrain::error);
  CHECK_THROWS_WITH_AS((void)pipeline::make_schedule(Kind::one_f_one_b, 2, 0), doctest::Contains("micro_batches is 0"),
                       paratrain::error);
  CHECK_THROWS_WITH_AS((void)pipeline::make_schedule(Kind::interleaved_1f1b, 2, 4, 0),
                       doctest::Contains("virtual_stages is 0"), paratrain::error);
  CHECK_THROWS_WITH_AS((void)pipeline::make_schedule(Kind::zero_bubble_h1, 2, 4, 2),
                       doctest::Contains("only Kind::interleaved_1f1b runs several stages per rank"), paratrain::error);
  CHECK_THROWS_WITH_AS((void)pipeline::make_schedule(Kind::interleaved_1f1b, 4, 6, 2),
                       doctest::Contains("micro_batches is 6 and ranks is 4; use 4 or 8 micro-batches"),
                       paratrain::error);
  CHECK_THROWS_WITH_AS((void)pipeline::theoretical_bubble(Kind::gpipe, 2, 4, 1, {.forward = 0}),
                       doctest::Contains("Costs::forward is 0"), paratrain::error);
  CHECK_NOTHROW((void)pipeline::make_schedule(Kind::interleaved_1f1b, 4, 6, 1));
}

TEST_CASE("table() draws GPipe K=2 M=2 tick by tick") {
  // By hand: F = b = w = 1, so B = 2. Rank 0 runs F0, F1 at ticks 0, 1; rank 1 runs them one
  // tick later, then B1 (ticks 3-4) and B0 (5-6); rank 0's B1 waits for rank 1's (5-6), then B0 (7-8).
  const std::string expected =
      "GPipe, 2 ranks, 2 micro-batches (numbered from 0). One column per 1 time unit. F forward (1), B backward (2), "
      "b backward_input (1), w backward_weight (1); blank: idle.\n"
      "\n"
      "| rank | 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 | 8 |\n"
      "|---|---|---|---|---|---|---|---|---|---|\n"
      "| 0 | F0 | F1 |  |  |  | B1 | B1 | B0 | B0 |\n"
      "| 1 |  | F0 | F1 | B1 | B1 | B0 | B0 |  |  |\n";
  CHECK(pipeline::table(pipeline::gpipe(2, 2)) == expected);
}

TEST_CASE("table() draws ZB-H1 K=2 M=2 and interleaved chunks") {
  // By hand: rank 0 runs F0 F1 b0 w0 b1 w1, rank 1 runs F0 b0 F1 b1 w0 w1 (its W delayed by one).
  const std::string zb =
      "ZB-H1, 2 ranks, 2 micro-batches (numbered from 0). One column per 1 time unit. F forward (1), B backward (2), "
      "b backward_input (1), w backward_weight (1); blank: idle.\n"
      "\n"
      "| rank | 0 | 1 | 2 | 3 | 4 | 5 | 6 |\n"
      "|---|---|---|---|---|---|---|---|\n"
      "| 0 | F0 | F1 |  | b0 | w0 | b1 | w1 |\n"
      "| 1 |  | F0 | b0 | F1 | b1 | w0 | w1 |\n";
  CHECK(pipeline::table(pipeline::zero_bubble_h1(2, 2)) == zb);

  // K=1 v=2 M=1 with F = 2, b = w = 2: a tick is 2 time units; F0.0 F0.1 B0.1 B0.0 back to back.
  const std::string interleaved =
      "interleaved 1F1B, 1 ranks, 1 micro-batches (numbered from 0), 2 stages per rank (suffix .c: the rank's chunk c, "
      "stage c * 1 + rank). One column per 2 time units. F forward (2), B backward (4), b backward_input (2), "
      "w backward_weight (2); blank: idle.\n"
      "\n"
      "| rank | 0 | 1 | 2 | 3 | 4 | 5 |\n"
      "|---|---|---|---|---|---|---|\n"
      "| 0 | F0.0 | F0.1 | B0.1 | B0.1 | B0.0 | B0.0 |\n";
  CHECK(pipeline::table(pipeline::interleaved_1f1b(1, 1, 2),
                        {.forward = 2, .backward_input = 2, .backward_weight = 2}) == interleaved);

  CHECK_THROWS_WITH_AS((void)pipeline::table(pipeline::gpipe(2, 2), {.forward = 1.5}),
                       doctest::Contains("every cost must be a whole number"), paratrain::error);
}
