#pragma once
/// \file
/// paratrain::detect_placement — this process's rank, world size, local rank and local size,
/// read from the variables its launcher exported (docs/launch.md lists them).

#include <array>
#include <charconv>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include "paratrain/core/error.hpp"

namespace paratrain {

/// Where this process sits in the job.
///
/// `launcher` names the source the numbers came from: "torchrun", "openmpi", "pals",
/// "mpich/pmi", "pmix", "slurm", or "none" (one process). It views a string literal, so it
/// never dangles.
struct Placement {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;  ///< rank among the processes on this node
  int local_size = 1;  ///< number of processes on this node
  std::string_view launcher = "none";

  friend bool operator==(const Placement&, const Placement&) = default;
};

/// Reads one environment variable: its value, or nullopt when it is not set.
using EnvironmentLookup = std::function<std::optional<std::string>(std::string_view)>;

// Note [Launcher precedence]
// Launchers nest, and an inner one inherits the outer one's variables: an sbatch script that
// calls mpirun leaves SLURM_PROCID=0 on every rank, and `srun torchrun` leaves each worker the
// SLURM_PROCID (and, where slurm.conf says MpiDefault=pmix, the PMIX_RANK) of the torchrun that
// spawned it. So the source that started the process most directly wins:
//   1. torchrun   RANK                  starts workers only, never another launcher: innermost
//   2. openmpi    OMPI_COMM_WORLD_RANK  Open MPI 5's mpirun also sets PMIX_RANK
//   3. pals       PALS_RANKID           Cray PALS also sets PMI_RANK, which must not pick plain PMI
//   4. mpich/pmi  PMI_RANK              Hydra's mpiexec; also srun --mpi=pmi2
//   5. pmix       PMIX_RANK             srun --mpi=pmix; PMIx exports the rank and nothing else
//   6. slurm      SLURM_PROCID          seen by every process of an allocation, so it comes last
// A source is chosen by its rank variable alone, and its numbers come from that source only,
// so two launches are never mixed. The one exception: what the chosen source does not export
// (PMIx: the sizes; srun --mpi=pmi2 or a hand-written RANK/WORLD_SIZE: the local pair) is taken
// from SLURM's variables when they describe the same process (SLURM_PROCID equals the rank and
// the world sizes agree). A local pair found nowhere means one node: local = global.
// The price of putting torchrun first: RANK/WORLD_SIZE exported by hand in a batch script
// that then calls mpirun would override mpirun's ranks, so do not export them there.

namespace detail::launch {

inline constexpr std::string_view operation = "detect_placement";

[[noreturn]] inline void fail(const std::string& message) { throw error(operation, -1, message); }

/// A number read from the environment, with the "NAME=value" an error message should cite.
struct Reading {
  std::string cited;
  int value = 0;
};

/// Alternative names for one quantity; the first that is set is read.
using Names = std::array<std::string_view, 2>;

// An empty value counts as unset: scripts write `export RANK=$SLURM_PROCID` outside srun too.
inline std::optional<std::string> get(const EnvironmentLookup& lookup, std::string_view name) {
  auto text = lookup(name);
  if (text && text->empty()) return std::nullopt;
  return text;
}

inline std::string cite(std::string_view name, std::string_view text) {
  return std::string(name) + "=" + std::string(text);
}

// "X is not" or "neither X nor Y is": the tail of "... is set but <this> set".
inline std::string unset(const Names& names) {
  if (names[1].empty()) return std::string(names[0]) + " is not";
  return "neither " + std::string(names[0]) + " nor " + std::string(names[1]) + " is";
}

inline std::optional<Reading> read(const EnvironmentLookup& lookup, const Names& names) {
  for (std::string_view name : names) {
    if (name.empty()) continue;
    auto text = get(lookup, name);
    if (!text) continue;
    int value = 0;
    const char* end = text->data() + text->size();
    auto [stop, ec] = std::from_chars(text->data(), end, value);
    if (ec != std::errc{} || stop != end)
      fail(std::string(name) + "='" + *text + "' is not an integer that fits in an int");
    if (value < 0) fail(cite(name, *text) + " is negative; ranks and sizes count up from 0");
    return Reading{cite(name, *text), value};
  }
  return std::nullopt;
}

// SLURM exports no local size, only the tasks of every node of the step in compressed form:
// "2(x3),1" is three nodes with two tasks, then one with one. This node is entry SLURM_NODEID;
// without it only a list that is the same for every node can be read.
inline std::optional<Reading> slurm_local_size(const EnvironmentLookup& lookup, const Names& names) {
  std::string_view name;
  std::optional<std::string> text;
  for (std::string_view candidate : names)
    if ((text = get(lookup, candidate))) {
      name = candidate;
      break;
    }
  if (!text) return std::nullopt;
  const std::string list = cite(name, *text);
  const auto node = read(lookup, {"SLURM_NODEID"});
  const auto malformed = [&] { fail(list + " is not a task list like 2(x3),1"); };

  const char* at = text->data();
  const char* const end = at + text->size();
  long long first_node = 0;  // index of the first node the current entry covers
  std::optional<int> mine, previous;
  bool uniform = true;
  while (true) {
    int count = 0, repeat = 1;
    auto parsed = std::from_chars(at, end, count);
    if (parsed.ec != std::errc{} || count < 1) malformed();
    at = parsed.ptr;
    if (end - at >= 2 && at[0] == '(' && at[1] == 'x') {
      parsed = std::from_chars(at + 2, end, repeat);
      if (parsed.ec != std::errc{} || repeat < 1 || parsed.ptr == end || *parsed.ptr != ')') malformed();
      at = parsed.ptr + 1;
    }
    if (node && node->value >= first_node && node->value < first_node + repeat) mine = count;
    uniform = uniform && (!previous || *previous == count);
    previous = count;
    first_node += repeat;
    if (at == end) break;
    if (*at != ',') malformed();
    ++at;
  }
  if (node && !mine)
    fail(node->cited + " is beyond the " + std::to_string(first_node) + " nodes listed in " + list);
  if (!node && !uniform)
    fail(list + " differs between nodes and SLURM_NODEID is not set, so this node's task count is unknown");
  const int count = mine ? *mine : *previous;
  return Reading{list + " (" + std::to_string(count) + " tasks on this node)", count};
}

struct Source {
  std::string_view launcher;
  std::string_view rank;  // its presence selects the source
  Names world_size;       // all empty: the launcher exports none
  Names local_rank;
  Names local_size;       // SLURM's names task lists, read by slurm_local_size
};

// In precedence order; see Note [Launcher precedence].
inline constexpr std::array<Source, 6> sources{{
    {"torchrun", "RANK", {"WORLD_SIZE"}, {"LOCAL_RANK"}, {"LOCAL_WORLD_SIZE"}},
    {"openmpi", "OMPI_COMM_WORLD_RANK", {"OMPI_COMM_WORLD_SIZE"}, {"OMPI_COMM_WORLD_LOCAL_RANK"},
     {"OMPI_COMM_WORLD_LOCAL_SIZE"}},
    // PALS has no world-size variable of its own; it exports Cray PMI's alongside.
    {"pals", "PALS_RANKID", {"PMI_SIZE"}, {"PALS_LOCAL_RANKID", "PMI_LOCAL_RANK"},
     {"PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE"}},
    {"mpich/pmi", "PMI_RANK", {"PMI_SIZE"}, {"MPI_LOCALRANKID"}, {"MPI_LOCALNRANKS"}},
    {"pmix", "PMIX_RANK", {}, {}, {}},
    {"slurm", "SLURM_PROCID", {"SLURM_NTASKS", "SLURM_NPROCS"}, {"SLURM_LOCALID"},
     {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}},
}};

/// What one source says, before the gaps are filled and the ranges checked.
struct Partial {
  std::string_view launcher;
  Reading rank;
  std::optional<Reading> world_size, local_rank, local_size;
};

// nullopt when the source's rank variable is unset; throws when a partner is missing.
inline std::optional<Partial> read_source(const Source& source, const EnvironmentLookup& lookup) {
  auto rank = read(lookup, {source.rank});
  if (!rank) return std::nullopt;
  Partial p{source.launcher, *rank, read(lookup, source.world_size), read(lookup, source.local_rank),
            source.launcher == "slurm" ? slurm_local_size(lookup, source.local_size)
                                        : read(lookup, source.local_size)};
  if (!p.world_size && !source.world_size[0].empty())
    fail(p.rank.cited + " is set but " + unset(source.world_size) +
         "; a rank needs its world size, so set both or neither");
  if (p.local_rank && !p.local_size)
    fail(p.local_rank->cited + " is set but " + unset(source.local_size) + "; set both or neither");
  if (p.local_size && !p.local_rank)
    fail(p.local_size->cited + " is set but " + unset(source.local_rank) + "; set both or neither");
  return p;
}

inline Placement check(const Partial& p) {
  const Reading &rank = p.rank, &world = *p.world_size, &local_rank = *p.local_rank, &local = *p.local_size;
  if (world.value < 1) fail(world.cited + " is not a world size: it must be at least 1");
  if (rank.value >= world.value)
    fail(rank.cited + " is not less than " + world.cited + "; ranks run from 0 to the size minus 1");
  if (local.value < 1) fail(local.cited + " is not a local size: it must be at least 1");
  if (local.value > world.value)
    fail(local.cited + " is larger than " + world.cited + "; one node cannot hold more processes than the job");
  if (local_rank.value >= local.value)
    fail(local_rank.cited + " is not less than " + local.cited + "; ranks run from 0 to the size minus 1");
  return {rank.value, world.value, local_rank.value, local.value, p.launcher};
}

inline Placement resolve(Partial p, const EnvironmentLookup& lookup) {
  if ((!p.world_size || !p.local_rank) && p.launcher != "slurm") {
    const auto slurm = read_source(sources.back(), lookup);
    const bool same_process = slurm && slurm->rank.value == p.rank.value &&
                              (!p.world_size || p.world_size->value == slurm->world_size->value);
    if (same_process) {
      if (!p.world_size) p.world_size = slurm->world_size;
      if (!p.local_rank) {
        p.local_rank = slurm->local_rank;
        p.local_size = slurm->local_size;
      }
    } else if (!p.world_size) {
      fail(p.rank.cited + " is set, but PMIx exports no world size and " +
           (slurm ? slurm->rank.cited + " is another process's" : std::string("SLURM_PROCID is not set")) +
           "; launch with srun --mpi=pmix or Open MPI's mpirun, or export RANK, WORLD_SIZE, "
           "LOCAL_RANK and LOCAL_WORLD_SIZE");
    }
  }
  // No local variables at all: assume one node, the usual case for processes started by hand.
  if (!p.local_rank) {
    p.local_rank = p.rank;
    p.local_size = p.world_size;
  }
  return check(p);
}

}  // namespace detail::launch

/// This process's placement, read through `lookup` instead of the process environment
/// (for tests, or to read a recorded environment).
///
/// Throws paratrain::error (operation "detect_placement") naming the variables and their
/// values when the chosen launcher's variables are malformed or inconsistent.
inline Placement detect_placement(const EnvironmentLookup& lookup) {
  using namespace detail::launch;
  for (const Source& source : sources)
    if (auto partial = read_source(source, lookup)) return resolve(std::move(*partial), lookup);
  return Placement{};
}

/// This process's placement, from the variables its launcher exported; rank 0 of 1 with
/// launcher "none" when no launcher is found. See Note [Launcher precedence] for which wins.
///
///     const paratrain::Placement where = paratrain::detect_placement();
///     auto device = torch::Device(torch::kCUDA, where.local_rank);
///
/// Reads with std::getenv, so do not call it while another thread changes the environment.
inline Placement detect_placement() {
  return detect_placement([](std::string_view name) -> std::optional<std::string> {
    if (const char* value = std::getenv(std::string(name).c_str())) return std::string(value);
    return std::nullopt;
  });
}

/// Where the launcher variables contradict the MPI world this process joined: empty when
/// they agree or there are none, else the sentence to report. Two mistakes show up so:
/// torchrun's RANK and WORLD_SIZE exported by hand around mpirun, which win by Note
/// [Launcher precedence] (every rank would then take the same GPU and Gloo would
/// rendezvous the wrong ranks), and a comm::Mpi program started by torchrun, where every
/// process is an MPI world of one that would train alone. A process a batch script runs
/// itself (SLURM_PROCID set, outside srun) is an MPI world of one legitimately.
inline std::string contradiction_with_mpi(const Placement& p, int mpi_rank, int mpi_size) {
  if (p.launcher == "none" || (p.rank == mpi_rank && p.world_size == mpi_size)) return {};
  if (mpi_size == 1 && p.launcher == "slurm") return {};
  const auto where = [](int rank, int size) { return "rank " + std::to_string(rank) + " of " + std::to_string(size); };
  std::string s = "the launcher variables (" + std::string(p.launcher) + ") say this process is " +
                  where(p.rank, p.world_size) + ", but MPI says " + where(mpi_rank, mpi_size) + ": ";
  if (p.launcher == "torchrun" && mpi_size > 1)
    return s + "RANK and WORLD_SIZE were set for another launch (exported around mpirun or srun?); unset them";
  if (p.launcher == "torchrun")
    return s + "torchrun started it, and comm::Mpi needs an MPI launcher (mpirun, srun); under torchrun use "
               "comm::Gloo";
  return s + "the environment holds another launch's variables; start the job with one launcher";
}

}  // namespace paratrain
