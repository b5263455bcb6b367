// Tests for paratrain::detect_placement: each launcher, the precedence between nested
// launchers (Note [Launcher precedence]), every inconsistency, and the real-environment path.

#include "paratrain/comm/launch.hpp"

#include <doctest/doctest.h>

#include <array>
#include <cstdlib>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

template <>
struct doctest::StringMaker<paratrain::Placement> {
  static String convert(const paratrain::Placement& p) {
    const std::string s = "{rank " + std::to_string(p.rank) + " of " + std::to_string(p.world_size) + ", local " +
                          std::to_string(p.local_rank) + " of " + std::to_string(p.local_size) + ", " +
                          std::string(p.launcher) + "}";
    return String(s.c_str());
  }
};

namespace {

using paratrain::Placement;
using Env = std::map<std::string, std::string, std::less<>>;

paratrain::EnvironmentLookup lookup_in(const Env& env) {
  return [&env](std::string_view name) -> std::optional<std::string> {
    if (auto it = env.find(name); it != env.end()) return it->second;
    return std::nullopt;
  };
}

Placement detect(const Env& env) { return paratrain::detect_placement(lookup_in(env)); }

// The message detect_placement throws for `env`, or "" when it does not throw.
std::string failure(const Env& env) {
  try {
    detect(env);
  } catch (const paratrain::error& e) {
    CHECK(e.operation() == "detect_placement");
    CHECK(e.rank() == -1);
    return e.what();
  }
  return "";
}

bool contains(std::string_view text, std::string_view part) { return text.find(part) != std::string_view::npos; }

// A SLURM step of 4 tasks on 2 nodes, seen from task 3 (second node, local 1).
const Env srun_task3 = {{"SLURM_PROCID", "3"},   {"SLURM_NTASKS", "4"},
                        {"SLURM_LOCALID", "1"},  {"SLURM_NODEID", "1"},
                        {"SLURM_TASKS_PER_NODE", "2(x2)"}};

Env merged(Env base, const Env& more) {
  for (const auto& [name, value] : more) base.insert_or_assign(name, value);
  return base;
}

struct Case {
  const char* name;
  Env env;
  Placement expected;
};

// Consistent environments as each launcher writes them; also drives the guard-coverage test.
const std::vector<Case> launcher_cases = {
    {"no launcher", {}, {0, 1, 0, 1, "none"}},
    {"torchrun",
     {{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"}},
     {5, 8, 1, 4, "torchrun"}},
    {"RANK/WORLD_SIZE by hand assume one node", {{"RANK", "2"}, {"WORLD_SIZE", "4"}}, {2, 4, 2, 4, "torchrun"}},
    {"openmpi",
     {{"OMPI_COMM_WORLD_RANK", "3"},
      {"OMPI_COMM_WORLD_SIZE", "8"},
      {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
      {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}},
     {3, 8, 1, 2, "openmpi"}},
    {"pals under PBS mpiexec (also exports PMI_*)",
     {{"PALS_RANKID", "6"},
      {"PALS_LOCAL_RANKID", "2"},
      {"PALS_LOCAL_SIZE", "4"},
      {"PMI_RANK", "6"},
      {"PMI_SIZE", "8"},
      {"PMI_LOCAL_RANK", "2"},
      {"PMI_LOCAL_SIZE", "4"}},
     {6, 8, 2, 4, "pals"}},
    {"pals under srun --mpi=cray_shasta (no PALS_LOCAL_SIZE)",
     {{"PALS_RANKID", "6"}, {"PALS_LOCAL_RANKID", "2"}, {"PMI_SIZE", "8"}, {"PMI_LOCAL_SIZE", "4"}},
     {6, 8, 2, 4, "pals"}},
    {"pals with Cray PMI's local rank only",
     {{"PALS_RANKID", "6"}, {"PMI_LOCAL_RANK", "2"}, {"PMI_SIZE", "8"}, {"PMI_LOCAL_SIZE", "4"}},
     {6, 8, 2, 4, "pals"}},
    {"mpich hydra",
     {{"PMI_RANK", "5"}, {"PMI_SIZE", "6"}, {"MPI_LOCALRANKID", "2"}, {"MPI_LOCALNRANKS", "3"}},
     {5, 6, 2, 3, "mpich/pmi"}},
    {"srun --mpi=pmi2 takes the local pair from SLURM",
     merged(srun_task3, {{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}}),
     {3, 4, 1, 2, "mpich/pmi"}},
    {"srun --mpi=pmix takes every size from SLURM", merged(srun_task3, {{"PMIX_RANK", "3"}}), {3, 4, 1, 2, "pmix"}},
    {"srun", srun_task3, {3, 4, 1, 2, "slurm"}},
    {"srun with uneven nodes",
     {{"SLURM_PROCID", "4"},
      {"SLURM_NTASKS", "7"},
      {"SLURM_LOCALID", "0"},
      {"SLURM_NODEID", "2"},
      {"SLURM_TASKS_PER_NODE", "2(x2),3"}},
     {4, 7, 0, 3, "slurm"}},
    {"srun prefers the step's task list and reads SLURM_NPROCS",
     {{"SLURM_PROCID", "1"},
      {"SLURM_NPROCS", "2"},
      {"SLURM_LOCALID", "0"},
      {"SLURM_NODEID", "1"},
      {"SLURM_STEP_TASKS_PER_NODE", "1(x2)"},
      {"SLURM_TASKS_PER_NODE", "4(x2)"}},
     {1, 2, 0, 1, "slurm"}},
    {"srun with an even task list needs no SLURM_NODEID",
     {{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"}, {"SLURM_TASKS_PER_NODE", "4(x2)"}},
     {5, 8, 1, 4, "slurm"}},
    {"empty values count as unset", {{"RANK", ""}, {"WORLD_SIZE", ""}}, {0, 1, 0, 1, "none"}},
};

// Note [Launcher precedence], case by case: the inner launcher wins.
const std::vector<Case> precedence_cases = {
    {"sbatch then mpirun: openmpi over SLURM",
     {{"SLURM_PROCID", "0"},
      {"SLURM_NTASKS", "8"},
      {"SLURM_LOCALID", "0"},
      {"SLURM_NODEID", "0"},
      {"SLURM_TASKS_PER_NODE", "4(x2)"},
      {"OMPI_COMM_WORLD_RANK", "5"},
      {"OMPI_COMM_WORLD_SIZE", "8"},
      {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
      {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}},
     {5, 8, 1, 4, "openmpi"}},
    {"srun torchrun with MpiDefault=pmix: torchrun over SLURM and PMIx",
     {{"SLURM_PROCID", "1"},
      {"SLURM_NTASKS", "2"},
      {"SLURM_LOCALID", "0"},
      {"SLURM_NODEID", "1"},
      {"SLURM_TASKS_PER_NODE", "1(x2)"},
      {"PMIX_RANK", "1"},
      {"RANK", "6"},
      {"WORLD_SIZE", "8"},
      {"LOCAL_RANK", "2"},
      {"LOCAL_WORLD_SIZE", "4"}},
     {6, 8, 2, 4, "torchrun"}},
    {"Open MPI 5's mpirun also sets PMIX_RANK: openmpi over PMIx",
     {{"PMIX_RANK", "3"},
      {"OMPI_COMM_WORLD_RANK", "3"},
      {"OMPI_COMM_WORLD_SIZE", "4"},
      {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
      {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}},
     {3, 4, 1, 2, "openmpi"}},
    {"sbatch then Hydra's mpiexec: mpich/pmi over SLURM",
     merged(srun_task3, {{"SLURM_PROCID", "0"},
                         {"PMI_RANK", "6"},
                         {"PMI_SIZE", "8"},
                         {"MPI_LOCALRANKID", "2"},
                         {"MPI_LOCALNRANKS", "4"}}),
     {6, 8, 2, 4, "mpich/pmi"}},
    {"PMI without local variables ignores the SLURM of another process",
     merged(srun_task3, {{"SLURM_PROCID", "0"}, {"PMI_RANK", "3"}, {"PMI_SIZE", "4"}}),
     {3, 4, 3, 4, "mpich/pmi"}},
};

// Environments that must be refused, and what the message must cite.
struct Refusal {
  const char* name;
  Env env;
  std::vector<std::string> cited;
};

const std::vector<Refusal> refusals = {
    {"non-integer", {{"RANK", "abc"}, {"WORLD_SIZE", "4"}}, {"RANK='abc'", "not an integer"}},
    {"trailing junk", {{"RANK", "1"}, {"WORLD_SIZE", "4x"}}, {"WORLD_SIZE='4x'"}},
    {"surrounding space", {{"PMI_RANK", " 1"}, {"PMI_SIZE", "4"}}, {"PMI_RANK=' 1'"}},
    {"out of int range", {{"RANK", "99999999999"}, {"WORLD_SIZE", "4"}}, {"RANK='99999999999'"}},
    {"negative rank",
     {{"OMPI_COMM_WORLD_RANK", "-1"}, {"OMPI_COMM_WORLD_SIZE", "4"}},
     {"OMPI_COMM_WORLD_RANK=-1", "negative"}},
    {"negative local rank", {{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "-2"}, {"LOCAL_WORLD_SIZE", "2"}},
     {"LOCAL_RANK=-2", "negative"}},
    {"rank equal to world size",
     {{"PMI_RANK", "4"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "0"}, {"MPI_LOCALNRANKS", "1"}},
     {"PMI_RANK=4", "PMI_SIZE=4"}},
    {"zero world size", {{"RANK", "0"}, {"WORLD_SIZE", "0"}}, {"WORLD_SIZE=0", "at least 1"}},
    {"zero local size", {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "0"}},
     {"LOCAL_WORLD_SIZE=0"}},
    {"local rank equal to local size",
     {{"RANK", "4"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "4"}, {"LOCAL_WORLD_SIZE", "4"}},
     {"LOCAL_RANK=4", "LOCAL_WORLD_SIZE=4"}},
    {"local size above world size",
     {{"OMPI_COMM_WORLD_RANK", "1"},
      {"OMPI_COMM_WORLD_SIZE", "8"},
      {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
      {"OMPI_COMM_WORLD_LOCAL_SIZE", "16"}},
     {"OMPI_COMM_WORLD_LOCAL_SIZE=16", "OMPI_COMM_WORLD_SIZE=8"}},
    {"RANK without WORLD_SIZE", {{"RANK", "3"}}, {"RANK=3", "WORLD_SIZE"}},
    {"RANK with an empty WORLD_SIZE", {{"RANK", "3"}, {"WORLD_SIZE", ""}}, {"RANK=3", "WORLD_SIZE"}},
    {"OMPI rank without size", {{"OMPI_COMM_WORLD_RANK", "0"}}, {"OMPI_COMM_WORLD_RANK=0", "OMPI_COMM_WORLD_SIZE"}},
    {"PMI_RANK without PMI_SIZE", {{"PMI_RANK", "0"}}, {"PMI_RANK=0", "PMI_SIZE"}},
    {"PALS without PMI_SIZE", {{"PALS_RANKID", "1"}, {"PALS_LOCAL_RANKID", "1"}, {"PALS_LOCAL_SIZE", "2"}},
     {"PALS_RANKID=1", "PMI_SIZE"}},
    {"SLURM_PROCID without a task count", {{"SLURM_PROCID", "1"}}, {"SLURM_PROCID=1", "neither SLURM_NTASKS nor SLURM_NPROCS"}},
    {"LOCAL_RANK without LOCAL_WORLD_SIZE", {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}},
     {"LOCAL_RANK=1", "LOCAL_WORLD_SIZE"}},
    {"LOCAL_WORLD_SIZE without LOCAL_RANK", {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "2"}},
     {"LOCAL_WORLD_SIZE=2", "LOCAL_RANK"}},
    {"SLURM_LOCALID without a task list", {{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "1"}},
     {"SLURM_LOCALID=1", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}},
    {"PMIx alone", {{"PMIX_RANK", "2"}}, {"PMIX_RANK=2", "SLURM_PROCID is not set"}},
    {"PMIx under another process's SLURM",
     {{"PMIX_RANK", "2"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}},
     {"PMIX_RANK=2", "SLURM_PROCID=0"}},
    {"malformed task list", merged(srun_task3, {{"SLURM_TASKS_PER_NODE", "2(x"}}), {"SLURM_TASKS_PER_NODE=2(x"}},
    {"task list with a trailing comma", merged(srun_task3, {{"SLURM_TASKS_PER_NODE", "2(x2),"}}),
     {"SLURM_TASKS_PER_NODE=2(x2),"}},
    {"task list with a zero count", merged(srun_task3, {{"SLURM_TASKS_PER_NODE", "0(x2)"}}),
     {"SLURM_TASKS_PER_NODE=0(x2)"}},
    {"SLURM_NODEID beyond the task list", merged(srun_task3, {{"SLURM_NODEID", "2"}}),
     {"SLURM_NODEID=2", "SLURM_TASKS_PER_NODE=2(x2)"}},
    {"uneven task list without SLURM_NODEID",
     {{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "5"}, {"SLURM_LOCALID", "0"}, {"SLURM_TASKS_PER_NODE", "2(x2),1"}},
     {"SLURM_TASKS_PER_NODE=2(x2),1", "SLURM_NODEID"}},
    {"SLURM_LOCALID beyond this node's tasks", merged(srun_task3, {{"SLURM_LOCALID", "2"}}),
     {"SLURM_LOCALID=2", "SLURM_TASKS_PER_NODE=2(x2)"}},
    {"inconsistent SLURM local pair borrowed by PMIx", merged(srun_task3, {{"PMIX_RANK", "3"}, {"SLURM_LOCALID", "5"}}),
     {"SLURM_LOCALID=5"}},
};

// Every variable detect_placement may read. The guard clears all of them, because the test
// binary itself runs under mpirun and inherits OMPI_* (and PMIX_RANK from Open MPI 5).
constexpr std::array placement_variables = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
    "PALS_RANKID", "PALS_LOCAL_RANKID", "PALS_LOCAL_SIZE",
    "PMI_RANK", "PMI_SIZE", "PMI_LOCAL_RANK", "PMI_LOCAL_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
    "PMIX_RANK",
    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_LOCALID", "SLURM_NODEID",
    "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
};

/// Clears every placement variable and sets `values` for its lifetime, then restores each
/// variable it touched to its previous value or absence.
class ScopedEnvironment {
 public:
  explicit ScopedEnvironment(std::initializer_list<std::pair<const char*, const char*>> values = {}) {
    for (const char* name : placement_variables) {
      save(name);
      ::unsetenv(name);
    }
    for (const auto& [name, value] : values) {
      save(name);
      ::setenv(name, value, 1);
    }
  }
  ScopedEnvironment(const ScopedEnvironment&) = delete;
  ScopedEnvironment& operator=(const ScopedEnvironment&) = delete;

  // In reverse, so a variable saved twice ends at its first (original) value.
  ~ScopedEnvironment() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second)
        ::setenv(it->first.c_str(), it->second->c_str(), 1);
      else
        ::unsetenv(it->first.c_str());
    }
  }

 private:
  void save(const char* name) {
    const char* value = std::getenv(name);
    saved_.emplace_back(name, value ? std::optional<std::string>(value) : std::nullopt);
  }

  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

std::optional<std::string> getenv_string(const char* name) {
  const char* value = std::getenv(name);
  return value ? std::optional<std::string>(value) : std::nullopt;
}

}  // namespace

TEST_CASE("detect_placement reads each launcher's variables") {
  for (const Case& c : launcher_cases) {
    CAPTURE(c.name);
    CHECK(detect(c.env) == c.expected);
  }
}

TEST_CASE("detect_placement prefers the launcher that started the process most directly") {
  for (const Case& c : precedence_cases) {
    CAPTURE(c.name);
    CHECK(detect(c.env) == c.expected);
  }
}

TEST_CASE("detect_placement refuses inconsistent variables and names them") {
  for (const Refusal& r : refusals) {
    CAPTURE(r.name);
    const std::string message = failure(r.env);
    CAPTURE(message);
    REQUIRE_FALSE(message.empty());
    CHECK(contains(message, "paratrain: detect_placement: "));
    for (const std::string& part : r.cited) CHECK(contains(message, part));
  }
}

TEST_CASE("the test guard covers every variable detect_placement reads") {
  std::set<std::string, std::less<>> read;
  const auto record = [&](const Env& env) {
    paratrain::detect_placement([&](std::string_view name) -> std::optional<std::string> {
      read.emplace(name);
      return lookup_in(env)(name);
    });
  };
  for (const Case& c : launcher_cases) record(c.env);
  for (const Case& c : precedence_cases) record(c.env);
  for (const Refusal& r : refusals) CHECK_THROWS_AS(record(r.env), paratrain::error);

  // Equal both ways: nothing read escapes the guard, and the guard lists nothing stale.
  const std::set<std::string, std::less<>> listed(placement_variables.begin(), placement_variables.end());
  CHECK(read == listed);
  for (const std::string& name : read) {
    CAPTURE(name);
    CHECK(listed.count(name) == 1);
  }
}

TEST_CASE("detect_placement() reads the process environment") {
  SUBCASE("nothing set") {
    ScopedEnvironment env;
    CHECK(paratrain::detect_placement() == Placement{0, 1, 0, 1, "none"});
  }
  SUBCASE("Open MPI") {
    ScopedEnvironment env{{"OMPI_COMM_WORLD_RANK", "2"},
                          {"OMPI_COMM_WORLD_SIZE", "4"},
                          {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                          {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}};
    CHECK(paratrain::detect_placement() == Placement{2, 4, 0, 2, "openmpi"});
  }
  SUBCASE("srun torchrun") {
    ScopedEnvironment env{{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"},
                          {"SLURM_TASKS_PER_NODE", "1(x2)"}, {"PMIX_RANK", "1"},
                          {"RANK", "7"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "4"}};
    CHECK(paratrain::detect_placement() == Placement{7, 8, 3, 4, "torchrun"});
  }
  SUBCASE("an inconsistent environment") {
    ScopedEnvironment env{{"RANK", "8"}, {"WORLD_SIZE", "8"}};
    CHECK_THROWS_WITH_AS(paratrain::detect_placement(),
                         "paratrain: detect_placement: RANK=8 is not less than WORLD_SIZE=8; ranks run from 0 to the size minus 1", paratrain::error);
  }
}

TEST_CASE("ScopedEnvironment restores what it changed") {
  const char* const kept = "SLURM_NODEID";  // any placement variable will do
  const auto before_kept = getenv_string(kept);
  const auto before_rank = getenv_string("RANK");
  ::setenv(kept, "sentinel", 1);
  ::unsetenv("RANK");
  {
    ScopedEnvironment env{{"RANK", "1"}, {kept, "5"}};
    CHECK(getenv_string("RANK") == "1");
    CHECK(getenv_string(kept) == "5");
  }
  CHECK(getenv_string(kept) == "sentinel");
  CHECK_FALSE(getenv_string("RANK").has_value());
  {
    ScopedEnvironment env;
    CHECK_FALSE(getenv_string(kept).has_value());
  }
  CHECK(getenv_string(kept) == "sentinel");

  // Leave the process as it was for the tests that follow.
  if (before_kept) ::setenv(kept, before_kept->c_str(), 1); else ::unsetenv(kept);
  if (before_rank) ::setenv("RANK", before_rank->c_str(), 1); else ::unsetenv("RANK");
}
