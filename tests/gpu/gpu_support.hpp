#pragma once
// What the GPU suite's files share (tests/gpu/, compiled as one unit with gloo_main.cpp): the
// device under test, a case's visible skip, a per-launch scratch path, and comm::Nccl made
// over the launch's processes.
#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>

#include "paratrain/comm/device.hpp"
#include "paratrain/core/config.hpp"
#include "support/case_count.hpp"
#if PARATRAIN_HAS_NCCL
#include "paratrain/comm/nccl/bootstrap_over_store.hpp"
#include "paratrain/comm/nccl/nccl.hpp"
#endif
#include "support/doctest.hpp"
#include "support/gloo_world.hpp"

namespace gpu_suite {

// The device under test: the GPU; PARATRAIN_TEST_DEVICE=cpu runs the same checks on the CPU
// (the suite's own logic, checked in CI where there is no GPU).
inline torch::Device gpu() {
  const char* device = std::getenv("PARATRAIN_TEST_DEVICE");
  return paratrain::local_device(device != nullptr ? device : "cuda");
}

// A case that cannot run here says so, instead of passing having checked nothing: doctest has
// no skip at run time, so the case prints "skipped: <why>" (MESSAGE is always printed), is
// counted as skipped (support/case_count.hpp: the driver reports the counts, and fails a run
// in which every case skipped) and returns.
inline bool skipped(bool cannot_run, const std::string& why) {
  if (cannot_run) {
    MESSAGE("skipped: " << why);
    paratrain_test::case_count().current_skipped = true;
  }
  return cannot_run;
}

// A path unique to this launch (its port) and to `what`, the same on every rank.
inline std::filesystem::path scratch(const std::string& what) {
  const char* port = std::getenv("MASTER_PORT");
  return std::filesystem::temp_directory_path() / ("paratrain-gpu-" + what + "-" + (port ? port : "0"));
}

#if PARATRAIN_HAS_NCCL
// Whether comm::Nccl can span the launch's processes: one GPU each (NCCL refuses two ranks of
// one communicator on the same device).
inline bool nccl_across() {
  const int ranks = gloo_world().size();
  return ranks > 1 && ranks <= paratrain::comm::Nccl::device_count();
}

// comm::Nccl over the launch's processes where nccl_across(), else a world of one in each
// process (which still runs every NCCL call). Collective over gloo_world(); each call meets in
// a fresh file.
inline paratrain::comm::Nccl nccl_world(paratrain::comm::Nccl::Options options = {}) {
  namespace comm = paratrain::comm;
  auto& world = gloo_world();
  if (!nccl_across()) {
    comm::Rendezvous alone({.rank = 0, .world_size = 1, .local_rank = world.rank(), .master_addr = "", .file = ""});
    return comm::Nccl(alone, std::move(options));
  }
  static int meetings = 0;
  const auto file = scratch("nccl-store-" + std::to_string(meetings++));
  if (world.rank() == 0) std::filesystem::remove(file);
  world.barrier();
  std::optional<comm::Nccl> made;
  {
    comm::Rendezvous meeting(
        {.rank = world.rank(), .world_size = world.size(), .local_rank = world.rank(), .file = file.string()});
    made.emplace(meeting, std::move(options));
  }  // the store closed on every rank: its file can go
  world.barrier();
  if (world.rank() == 0) std::filesystem::remove(file);
  return std::move(*made);
}
#endif

}  // namespace gpu_suite
