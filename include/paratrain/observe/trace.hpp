#pragma once
/// \file
/// paratrain::observe::Trace — every rank's step phases and bucket all-reduces on one
/// time axis, in the Chrome trace format that ui.perfetto.dev and chrome://tracing open.

#include <ATen/ATen.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "paratrain/core/reduce_op.hpp"
#include "paratrain/util/group_size.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/core/timeline.hpp"

namespace paratrain::observe {

// The step timeline is vocabulary every strategy speaks (core/timeline.hpp); its old
// spellings, observe::StepTimeline, observe::Phase, ..., for one release.
using paratrain::Phase;
using paratrain::phase_name;
using paratrain::PhaseTimer;
using paratrain::StepTimeline;

// Note [Clock alignment]
// Each rank stamps events with its own std::chrono::steady_clock. On one host that is
// CLOCK_MONOTONIC for every process, but on several hosts the clocks have unrelated
// origins (seconds since boot), so the trace must shift each rank onto rank 0's clock.
// A strategy offers only all_reduce, so the offset is measured with it:
//   all ranks leave an all-reduce at nearly the same instant; each then reads its clock
//   (t_r), and the next all-reduce (of the table [t_0, ..., t_{n-1}]) tells every rank
//   t_0. offset_r = t_0 - t_r. This is repeated `rounds` times (each all-reduce also
//   being the next round's starting line) and the median taken, which discards rounds
//   in which a rank was descheduled.
// The error of one round is how far apart the ranks left the previous all-reduce: about
// one message latency (a few µs within a node, 10-50 µs over a network with MPI), more
// with more ranks than cores. `spread_us` (the median absolute deviation of the rounds)
// is recorded in the trace's otherData as an estimate of it. Drift over a long run is
// not corrected (steady clocks drift by ~10 µs/s at worst, NTP-disciplined much less).

/// This rank's clock against rank 0's: Note [Clock alignment].
struct ClockOffset {
  double offset_us = 0;  ///< add to this rank's clock (µs) to get rank 0's
  double origin_us = 0;  ///< rank 0's clock at the end of the measurement: the trace's time 0
  double spread_us = 0;  ///< median absolute deviation of the rounds' estimates
};

namespace detail {

using paratrain::detail::group_size;

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  const auto mid = v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2);
  std::nth_element(v.begin(), mid, v.end());
  return *mid;
}

/// Collective over `group`: Note [Clock alignment]. `now_us` reads this rank's clock
/// in µs (a parameter so that tests can give ranks deliberately different clocks).
template <class Group, class Now>
ClockOffset measure_clock_offset(Group& group, Now now_us, int rounds = 15) {
  const int n = group_size(group), rank = group.rank();
  auto table = at::zeros({n}, at::kDouble);
  group.all_reduce(table, reduce_op::sum);  // the starting line
  std::vector<double> estimates;
  double origin = 0;
  for (int round = 0; round < rounds; ++round) {
    const double t = now_us();
    table.zero_();
    table.data_ptr<double>()[rank] = t;
    group.all_reduce(table, reduce_op::sum);
    origin = table.data_ptr<double>()[0];
    estimates.push_back(origin - t);
  }
  ClockOffset c;
  c.offset_us = median(estimates);
  for (auto& e : estimates) e = std::abs(e - c.offset_us);
  c.spread_us = median(estimates);
  c.origin_us = origin;
  return c;
}

inline double steady_us(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double, std::micro>(t.time_since_epoch()).count();
}

}  // namespace detail

/// Records this rank's steps (a StepTimeline per step) and, at `write`, gathers every
/// rank's events to rank 0 and writes one Chrome trace:
///
///   {"traceEvents": [{"name": "forward", "ph": "X", "ts": µs, "dur": µs, "pid": rank, "tid": 0}, ...]}
///
/// pid is the rank. tid 0 holds the steps with their phases nested inside (data,
/// forward, backward, sync, optimizer); bucket all-reduces overlap backward and each
/// other, so they go on tids 1, 2, ... ("communication" lanes), a new lane only when
/// every earlier one is still busy. Complete ("X") events on one tid therefore never
/// overlap partially.
///
/// fit() makes one when ObserveOptions::trace_file is set.
class Trace {
 public:
  using clock = std::chrono::steady_clock;

  /// Collective over `group` (a strategy or a communicator): measures the clock offset.
  template <class Group>
  explicit Trace(Group& group) : Trace(group.rank(), detail::measure_clock_offset(group, now_us)) {}

  /// For a rank whose offset is already known (or a single process: {}).
  Trace(int rank, ClockOffset clock) : rank_(rank), clock_(clock) {}

  /// One step from `begin` to `end`, with the phases and transfers in `timeline`.
  void step(std::int64_t step, clock::time_point begin, clock::time_point end, const StepTimeline& timeline) {
    add(step_code, 0, begin, end, step);
    for (const auto& s : timeline.spans()) add(phase_code + static_cast<int>(s.phase), 0, s.begin, s.end, step);
    for (const auto& t : timeline.transfers()) {
      if (t.done == clock::time_point{}) continue;  // never seen complete: nothing to draw
      const double launch = to_us(t.launch);
      std::size_t lane = 0;
      while (lane < lane_end_.size() && lane_end_[lane] > launch) ++lane;
      if (lane == lane_end_.size()) lane_end_.push_back(0);
      lane_end_[lane] = to_us(t.done);
      add(bucket_code + static_cast<int>(t.bucket), static_cast<int>(lane) + 1, t.launch, t.done, step);
    }
  }

  [[nodiscard]] std::size_t size() const noexcept { return events_.size(); }
  [[nodiscard]] const ClockOffset& clock_offset() const noexcept { return clock_; }

  /// Collective over `group`: every rank's events go to rank 0, which writes `file`.
  template <class Group>
  void write(Group& group, const std::filesystem::path& file) {
    const int n = detail::group_size(group);
    // Per rank: event count, clock offset, spread.
    auto info = at::zeros({n, 3}, at::kDouble);
    auto* in = info.data_ptr<double>();
    in[3 * rank_] = static_cast<double>(events_.size());
    in[3 * rank_ + 1] = clock_.offset_us;
    in[3 * rank_ + 2] = clock_.spread_us;
    group.all_reduce(info, reduce_op::sum);
    std::vector<std::vector<Event>> all(static_cast<std::size_t>(n));
    if (rank_ == 0) all[0] = events_;
    // One rank at a time, in chunks, through all_reduce (the one collective every
    // strategy has): memory stays at one chunk, whatever the run's length.
    constexpr std::int64_t chunk = std::int64_t{1} << 16;
    for (int r = 1; r < n; ++r) {
      const auto count = static_cast<std::int64_t>(in[3 * r]);
      for (std::int64_t first = 0; first < count; first += chunk) {
        const auto len = std::min(chunk, count - first);
        auto buf = at::zeros({len, Event::fields}, at::kDouble);
        if (rank_ == r)
          for (std::int64_t i = 0; i < len; ++i) events_[static_cast<std::size_t>(first + i)].pack(buf.data_ptr<double>() + i * Event::fields);
        group.all_reduce(buf, reduce_op::sum);
        if (rank_ == 0)
          for (std::int64_t i = 0; i < len; ++i) all[static_cast<std::size_t>(r)].push_back(Event::unpack(buf.data_ptr<double>() + i * Event::fields));
      }
    }
    if (rank_ == 0) write_json(file, all, info);
  }

 private:
  static double now_us() { return detail::steady_us(clock::now()); }

  static constexpr int step_code = 0, phase_code = 1, bucket_code = 100;

  struct Event {
    static constexpr std::int64_t fields = 5;
    int code = 0, tid = 0;
    double ts = 0, dur = 0;
    std::int64_t step = 0;
    void pack(double* out) const {
      out[0] = code, out[1] = tid, out[2] = ts, out[3] = dur, out[4] = static_cast<double>(step);
    }
    static Event unpack(const double* in) {
      return {static_cast<int>(in[0]), static_cast<int>(in[1]), in[2], in[3], static_cast<std::int64_t>(in[4])};
    }
  };

  [[nodiscard]] double to_us(clock::time_point t) const { return detail::steady_us(t) + clock_.offset_us - clock_.origin_us; }

  void add(int code, int tid, clock::time_point begin, clock::time_point end, std::int64_t step) {
    const double b = to_us(begin);
    events_.push_back({code, tid, b, std::max(0.0, to_us(end) - b), step});
  }

  static std::string name(int code) {
    if (code == step_code) return "step";
    if (code < bucket_code) return phase_name(static_cast<Phase>(code - phase_code));
    return "all_reduce bucket " + std::to_string(code - bucket_code);
  }

  static void write_json(const std::filesystem::path& file, const std::vector<std::vector<Event>>& all,
                         const at::Tensor& info) {
    std::error_code ec;
    if (file.has_parent_path()) std::filesystem::create_directories(file.parent_path(), ec);
    std::FILE* f = std::fopen(file.c_str(), "w");
    if (f == nullptr)
      throw error("Trace::write", 0, "cannot create '" + file.string() + "': " + std::strerror(errno));
    const auto* in = info.data_ptr<double>();
    std::fprintf(f, "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"clock_alignment\":\"median of all_reduce rounds, "
                    "see paratrain Note [Clock alignment]\",\"clock_offset_us\":[");
    for (std::size_t r = 0; r < all.size(); ++r) std::fprintf(f, "%s%.3f", r ? "," : "", in[3 * r + 1]);
    std::fprintf(f, "],\"clock_spread_us\":[");
    for (std::size_t r = 0; r < all.size(); ++r) std::fprintf(f, "%s%.3f", r ? "," : "", in[3 * r + 2]);
    std::fprintf(f, "]},\n\"traceEvents\":[\n");
    bool first = true;
    const auto sep = [&] { return std::exchange(first, false) ? "" : ",\n"; };
    for (std::size_t r = 0; r < all.size(); ++r) {
      int lanes = 0;
      for (const auto& e : all[r]) lanes = std::max(lanes, e.tid);
      std::fprintf(f, "%s{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%zu,\"tid\":0,\"args\":{\"name\":\"rank %zu\"}}",
                   sep(), r, r);
      std::fprintf(f, ",\n{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":%zu,\"tid\":0,\"args\":{\"sort_index\":%zu}}",
                   r, r);
      std::fprintf(f, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%zu,\"tid\":0,\"args\":{\"name\":\"steps\"}}", r);
      for (int t = 1; t <= lanes; ++t)
        std::fprintf(f,
                     ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%zu,\"tid\":%d,\"args\":{\"name\":\"communication "
                     "%d\"}}",
                     r, t, t);
      for (const auto& e : all[r]) {
        const char* cat = e.code == step_code ? "step" : e.code >= bucket_code ? "communication" : "phase";
        std::fprintf(f,
                     ",\n{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"X\",\"ts\":%.3f,\"dur\":%.3f,\"pid\":%zu,\"tid\":%d,"
                     "\"args\":{\"step\":%lld}}",
                     name(e.code).c_str(), cat, e.ts, e.dur, r, e.tid, static_cast<long long>(e.step));
      }
    }
    std::fprintf(f, "\n]}\n");
    const bool failed = std::ferror(f) != 0;
    if (std::fclose(f) != 0 || failed) throw error("Trace::write", 0, "cannot write '" + file.string() + "'");
  }

  int rank_;
  ClockOffset clock_;
  std::vector<Event> events_;
  std::vector<double> lane_end_;  // when each communication lane is free again (µs)
};

}  // namespace paratrain::observe
