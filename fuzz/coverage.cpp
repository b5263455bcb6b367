// Coverage feedback for libFuzzer from g++ (fuzz/CMakeLists.txt). LibTorch's headers do not
// compile with Debian's clang 14 in C++20 against libstdc++ 12 (LibTorch's vector of a type
// not yet complete), so the targets are built with g++, which has no -fsanitize=fuzzer, and
// libFuzzer 14 no longer reads g++'s -fsanitize-coverage=trace-pc. Two kinds of feedback
// remain, both g++'s: -fsanitize-coverage=trace-cmp (libFuzzer's value profile:
// -use_value_profile=1) and -finstrument-functions on paratrain's and the target's code,
// whose every (function, call site) pair bumps one of libFuzzer's extra counters below.
#include <cstddef>
#include <cstdint>

namespace {
constexpr std::size_t counters = 1 << 16;
__attribute__((section("__libfuzzer_extra_counters"), used)) std::uint8_t extra_counters[counters];
}  // namespace

extern "C" {
__attribute__((no_instrument_function)) void __cyg_profile_func_enter(void* fn, void* site) {
  const auto h = (reinterpret_cast<std::uintptr_t>(fn) * 31) ^ reinterpret_cast<std::uintptr_t>(site);
  auto& c = extra_counters[(h ^ (h >> 16)) % counters];
  c = static_cast<std::uint8_t>(c + 1 == 0 ? c : c + 1);
}
__attribute__((no_instrument_function)) void __cyg_profile_func_exit(void*, void*) {}
// g++'s trace-cmp also reports floating-point comparisons, which libFuzzer does not take.
void __sanitizer_cov_trace_cmpf(float, float) {}
void __sanitizer_cov_trace_cmpd(double, double) {}
}
