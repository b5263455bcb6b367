#pragma once
/// \file
/// What paratrain keeps for the whole process: the seed every rank started from
/// (paratrain::seed) and what ends with paratrain::main (detail::at_runtime_end).

#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace paratrain {

namespace detail {

struct ProcessState {
  std::mutex mutex;
  std::optional<std::uint64_t> seed;
  std::vector<std::function<void()>> at_end;  // run last-in, first-out
};

inline ProcessState& process_state() {
  static ProcessState s;
  return s;
}

inline void set_seed(std::uint64_t seed) {
  auto& s = process_state();
  const std::scoped_lock lock(s.mutex);
  s.seed = seed;
}

/// Runs `f` when paratrain::main returns (or at exit, where nothing calls main): what the
/// library started for the program (the MPI environment comm::Mpi starts) ends there.
inline void at_runtime_end(std::function<void()> f) {
  auto& s = process_state();
  const std::scoped_lock lock(s.mutex);
  s.at_end.push_back(std::move(f));
}

/// Runs and forgets what at_runtime_end registered, the latest first.
inline void end_runtime() noexcept {
  auto& s = process_state();
  std::vector<std::function<void()>> todo;
  {
    const std::scoped_lock lock(s.mutex);
    todo.swap(s.at_end);
  }
  for (auto it = todo.rbegin(); it != todo.rend(); ++it) {
    try {
      (*it)();
    } catch (...) {  // ending: nothing left to report it to
    }
  }
}

}  // namespace detail

/// The seed every rank started from: RuntimeOptions::seed under paratrain::main, else 0.
/// fit's sample order (FitOptions::seed) defaults to it, so one number drives both the
/// initial weights and the order of the samples.
[[nodiscard]] inline std::uint64_t seed() noexcept {
  auto& s = detail::process_state();
  const std::scoped_lock lock(s.mutex);
  return s.seed.value_or(0);
}

}  // namespace paratrain
