#pragma once
/// \file
/// Progress output of fit(): a bar on a terminal, plain lines otherwise; rank 0 only; and
/// the text and log values of its rates.

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <string_view>

#include "paratrain/fit/options.hpp"

namespace paratrain::detail {

/// printf's formatting, into a string.
inline std::string format(const char* fmt, auto... args) {
  std::string out(static_cast<std::size_t>(std::max(std::snprintf(nullptr, 0, fmt, args...), 0)), '\0');
  std::snprintf(out.data(), out.size() + 1, fmt, args...);
  return out;
}

/// "12345 samples/s", with tokens/s, TFLOP/s and MFU where `t` gives them.
inline std::string rates_text(const Throughput& t, const Rates& r) {
  auto text = format("%.0f samples/s", r.samples_per_second);
  if (t.tokens_per_sample > 0) text += format(", %.0f tokens/s", r.tokens_per_second);
  if (t.sample_flops() > 0) text += format(", %.3g TFLOP/s", r.tflops);
  if (t.sample_flops() > 0 && t.peak_flops_per_rank > 0) text += format(", MFU %.1f%%", 100 * r.mfu);
  return text;
}

/// The rates `t` gives, as values of the logs (train/tokens_per_second, ...).
inline void add_rates(std::map<std::string, double>& m, const Throughput& t, const Rates& r) {
  if (t.tokens_per_sample > 0) m["tokens_per_second"] = r.tokens_per_second;
  if (t.sample_flops() > 0) m["tflops"] = r.tflops;
  if (t.sample_flops() > 0 && t.peak_flops_per_rank > 0) m["mfu"] = r.mfu;
}

class Progress {
 public:
  Progress(bool enabled, std::FILE* out) : enabled_(enabled), out_(out), tty_(enabled && interactive(out)) {}

  /// A step ended; `line` describes it. On a terminal the bar is redrawn (at most 10
  /// times a second); otherwise a line is printed when `periodic` says so.
  void step(int epoch, int epochs, std::int64_t step, std::int64_t steps, const std::string& line, bool periodic) {
    if (!enabled_) return;
    if (tty_) {
      const auto now = std::chrono::steady_clock::now();
      if (step < steps && now - last_draw_ < std::chrono::milliseconds(100)) return;
      last_draw_ = now;
      constexpr int width = 30;
      const int filled = steps > 0 ? static_cast<int>(width * step / steps) : width;
      std::fprintf(out_, "\r\033[Kepoch %d/%d [%s%s] %lld/%lld %s", epoch, epochs, std::string(filled, '#').c_str(),
                   std::string(width - filled, '.').c_str(), static_cast<long long>(step),
                   static_cast<long long>(steps), line.c_str());
    } else if (periodic) {
      std::fprintf(out_, "epoch %d/%d step %lld/%lld %s\n", epoch, epochs, static_cast<long long>(step),
                   static_cast<long long>(steps), line.c_str());
    }
    std::fflush(out_);
  }

  /// A line that stays (epoch summaries).
  void line(const std::string& text) {
    if (!enabled_) return;
    std::fprintf(out_, "%s%s\n", tty_ ? "\r\033[K" : "", text.c_str());
    std::fflush(out_);
  }

 private:
  // Note [Progress in logs]
  // A bar redrawn with "\r\033[K" is for a person at a terminal; in a log file it becomes
  // hundreds of frames. isatty is not enough: Open MPI's mpirun hands its ranks a
  // pseudo-terminal even when its own output goes to a file or a CI log (and passes TERM
  // on). So where the launcher gave this process a terminal, the bar also needs the
  // launcher's own stdout to be one: the parent's /proc/<pid>/fd/1 (mpirun here, orted on
  // other nodes, whose output is never a terminal). PARATRAIN_PROGRESS=bar or =lines
  // overrides the guess.
  static bool interactive(std::FILE* out) {
    if (const char* forced = std::getenv("PARATRAIN_PROGRESS"); forced != nullptr && *forced != '\0')
      return std::string_view(forced) == "bar";
    const char* term = std::getenv("TERM");
    if (!isatty(fileno(out)) || term == nullptr || *term == '\0' || std::string_view(term) == "dumb") return false;
    if (std::getenv("OMPI_COMM_WORLD_RANK") == nullptr && std::getenv("PMI_RANK") == nullptr) return true;
    return parent_writes_to_terminal();
  }

  static bool parent_writes_to_terminal() {
    char target[256] = {};
    const auto path = "/proc/" + std::to_string(getppid()) + "/fd/1";
    const auto n = readlink(path.c_str(), target, sizeof target - 1);
    if (n <= 0) return false;
    const std::string_view t(target, static_cast<std::size_t>(n));
    return t.rfind("/dev/pts/", 0) == 0 || t.rfind("/dev/tty", 0) == 0;
  }

  bool enabled_;
  std::FILE* out_;
  bool tty_;
  std::chrono::steady_clock::time_point last_draw_{};
};

}  // namespace paratrain::detail
