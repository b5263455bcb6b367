#pragma once
// The benchmarks' command lines, by CLI11 as every example's and tool's: --help on stdout
// from one rank and exit 0, --name=value, a malformed value an error naming the option.
#include <CLI/CLI.hpp>

#include <cstddef>
#include <optional>
#include <string>

#include "paratrain/reliability/failure.hpp"  // detail::known_rank

namespace paratrain::bench {

/// Parses the command line into `app`'s options; returns the exit status when the program
/// should end now (--help, a bad value). Every rank parses the same line; one prints.
inline std::optional<int> parse(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    if (paratrain::detail::known_rank() <= 0) return app.exit(e);
    return e.get_exit_code();
  }
}

/// The size options of the collective benchmarks: the largest message, and comm::Mpi's
/// segmenting of large ones (Note [Segmented all-reduce], Note [Segmented reduce-scatter and
/// all-gather]), where given.
struct Sizes {
  std::size_t max_bytes = std::size_t{256} << 20;
  std::optional<std::size_t> segment_bytes, segment_above_bytes;

  void add_to(CLI::App& app) {
    app.add_option("--max-bytes", max_bytes, "the largest message, in bytes (from 4096, doubling)")
        ->check(CLI::Range(std::size_t{4096}, std::size_t{1} << 40))
        ->capture_default_str();
    app.add_option("--segment-bytes", segment_bytes, "comm::Mpi's segment size, in bytes (default: its own)")
        ->check(CLI::Range(std::size_t{1}, std::size_t{1} << 40));
    app.add_option("--segment-above-bytes", segment_above_bytes,
                   "comm::Mpi segments messages above this many bytes (default: its own)")
        ->check(CLI::Range(std::size_t{0}, std::size_t{1} << 62));
  }
};

}  // namespace paratrain::bench
