#pragma once
/// \file
/// Progress output of fit(): a bar on a terminal, plain lines otherwise; rank 0 only.

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

namespace paratrain::detail {

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
  // mpirun hands its ranks a pseudo-terminal even when its own output goes to a file or a
  // CI log, so isatty alone would draw bars into logs: a terminal also needs a TERM that
  // can move the cursor (mpirun passes the user's TERM on).
  static bool interactive(std::FILE* out) {
    const char* term = std::getenv("TERM");
    return isatty(fileno(out)) && term != nullptr && *term != '\0' && std::string_view(term) != "dumb";
  }

  bool enabled_;
  std::FILE* out_;
  bool tty_;
  std::chrono::steady_clock::time_point last_draw_{};
};

}  // namespace paratrain::detail
