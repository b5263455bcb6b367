#pragma once
/// \file
/// comm::NcclOptions (spelled comm::Nccl::Options): a group's device, timeout and validation.

#include <chrono>

#include "paratrain/reliability/collective_signature.hpp"
#include "paratrain/reliability/watchdog.hpp"

namespace paratrain::comm {

struct NcclOptions {
  /// The CUDA device of this rank; -1 picks the rank within its node.
  int device = -1;
  /// How long an operation may stay pending (from its start to the end of its wait()
  /// or test()) before the watchdog reports it and ends the job: Note [Watchdog].
  std::chrono::milliseconds timeout = detail::default_timeout();
  /// As comm::Mpi::Options::validate: check that every rank calls the same collective with
  /// the same dtype, element count and root, and throw on every rank if not. Costs one
  /// small all-reduce (and two host-device copies) per collective.
  bool validate = detail::env_flag("PARATRAIN_VALIDATE");
};

}  // namespace paratrain::comm
