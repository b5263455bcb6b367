#pragma once
/// \file
/// A strategy's memory plan for its model (paratrain::plan::peak), and the check at
/// construction that it fits what the process may still use (Note [Checking the plan]).

#include <sys/resource.h>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <string>

#include "paratrain/strategy/buckets/bucket_layout.hpp"
#include "paratrain/plan/plan.hpp"
#include "paratrain/strategy/unit.hpp"

namespace paratrain {

// Note [Checking the plan]
// With DataParallelOptions::memory.check on, a strategy computes, once its model exists
// and before it allocates anything of its own, the peak paratrain::plan::peak predicts
// for this model, stage and world size (Note [Peak memory model]), and compares what is
// still to come (the peak less the parameters the model already holds) with what the
// process may still use: memory.limit_bytes where given, else the least of RLIMIT_DATA
// and RLIMIT_AS (less the process's current data and address-space sizes) and its cgroup's
// memory.max (less memory.current); with none of these set, nothing limits it and the
// check passes. A plan that does not fit is an error on every rank (agreed, so no rank
// goes on alone) naming the plan's figure, the limit, and the smallest ZeRO stage and
// world size whose plan fits, before any of it is allocated: a clear message instead of
// the OOM killer or an allocation failure in the middle of the first step.

/// What DataParallel checks about memory at construction: Note [Checking the plan].
struct MemoryCheck {
  /// Check that the plan fits before allocating anything.
  bool check = false;
  /// What this rank may still use, in bytes; 0: read the process's limits.
  std::size_t limit_bytes = 0;
  /// The activations of a step on this rank, the user's estimate, added to the plan.
  std::size_t activation_bytes = 0;
};

namespace detail {

/// K, the optimizer-state bytes per fp32 parameter, and the step's scratch bytes per
/// element, of a LibTorch optimizer's options (plan::optimizer_bytes, plan::scratch_bytes).
struct OptimizerBytes {
  double state = 0;
  double scratch = 0;
};
inline OptimizerBytes optimizer_bytes_of(const torch::optim::SGDOptions& o) {
  return {o.momentum() != 0 ? 4.0 : 0.0, o.weight_decay() != 0 ? 4.0 : 0.0};
}
inline OptimizerBytes optimizer_bytes_of(const torch::optim::AdamOptions& o) { return {o.amsgrad() ? 12.0 : 8.0, 8.0}; }
inline OptimizerBytes optimizer_bytes_of(const torch::optim::AdamWOptions& o) { return {o.amsgrad() ? 12.0 : 8.0, 8.0}; }
inline OptimizerBytes optimizer_bytes_of(const torch::optim::AdagradOptions&) { return {4.0, 8.0}; }
inline OptimizerBytes optimizer_bytes_of(const torch::optim::RMSpropOptions& o) {
  return {4.0 + (o.centered() ? 4.0 : 0.0) + (o.momentum() != 0 ? 4.0 : 0.0), 8.0};
}
template <class Options>
OptimizerBytes optimizer_bytes_of(const Options&) {
  return {};  // an optimizer plan does not know: its state is not counted
}

/// The elements of a layout's largest bucket (padded): what the plan counts a bucket as.
inline double largest_bucket(const BucketLayout& layout) {
  double largest = 0;
  for (const auto& b : layout.buckets()) largest = std::max(largest, static_cast<double>(b.padded));
  return largest;
}

/// The plan of `model` trained on `ranks` ranks: sizes read off its parameters and units;
/// `bucket_elements`, the largest bucket of its layout.
template <class OptimOptions>
plan::Model plan_of(torch::nn::Module& model, std::int64_t ranks, double bucket_elements, int prefetch,
                    const OptimOptions& optimizer, bool autocast, bool narrow_reduce, std::size_t activation_bytes) {
  plan::Model m{.ranks = ranks, .activation_bytes = static_cast<double>(activation_bytes), .prefetch = prefetch};
  std::set<const void*> seen;
  double bytes = 0;
  for (const auto& p : model.parameters(/*recurse=*/true))
    if (p.requires_grad() && seen.insert(p.unsafeGetTensorImpl()).second) {
      m.parameters += static_cast<double>(p.numel());
      bytes += static_cast<double>(p.numel()) * static_cast<double>(p.element_size());
      m.largest_parameter = std::max(m.largest_parameter, static_cast<double>(p.numel()));
    }
  const double element = m.parameters > 0 ? bytes / m.parameters : 4.0;
  m.param_bytes = m.grad_bytes = element;
  const auto k = optimizer_bytes_of(optimizer);
  m.optimizer_bytes = k.state * element / 4;  // K is per fp32 parameter
  m.scratch_bytes = k.scratch * element / 4;
  m.autocast_bytes = autocast ? 2.0 : 0.0;
  m.reduce_bytes = narrow_reduce ? 2.0 : 0.0;
  m.bucket_elements = bucket_elements;
  for (const auto& unit : model.modules(/*include_self=*/true))
    if (dynamic_cast<UnitBase*>(unit.get()) != nullptr) {
      double n = 0;
      for (const auto& p : unit->parameters(/*recurse=*/true)) n += static_cast<double>(p.numel());
      m.unit_elements = std::max(m.unit_elements, n);
    }
  return m;
}

/// A "Name: <kB> kB" line of /proc/self/status, in bytes; 0 where it cannot be read.
inline double proc_status_bytes(const std::string& name) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(name + ":", 0) == 0) {
      std::istringstream s(line.substr(name.size() + 1));
      double kb = 0;
      s >> kb;
      return kb * 1024;
    }
  return 0;
}

/// What this process may still allocate, and what says so; empty: nothing limits it.
struct Headroom {
  double bytes = std::numeric_limits<double>::infinity();
  std::string source;
  void consider(double limit, double used, const std::string& what) {
    if (limit - used < bytes) bytes = limit - used, source = what;
  }
};

inline Headroom process_headroom() {
  Headroom h;
  rlimit r{};
  if (getrlimit(RLIMIT_DATA, &r) == 0 && r.rlim_cur != RLIM_INFINITY)
    h.consider(static_cast<double>(r.rlim_cur), proc_status_bytes("VmData"), "RLIMIT_DATA");
  if (getrlimit(RLIMIT_AS, &r) == 0 && r.rlim_cur != RLIM_INFINITY)
    h.consider(static_cast<double>(r.rlim_cur), proc_status_bytes("VmSize"), "RLIMIT_AS");
  // cgroup v2: "0::/path" in /proc/self/cgroup.
  std::ifstream cgroup("/proc/self/cgroup");
  std::string line;
  while (std::getline(cgroup, line))
    if (line.rfind("0::", 0) == 0) {
      const std::string dir = "/sys/fs/cgroup" + line.substr(3);
      std::ifstream max(dir + "/memory.max"), current(dir + "/memory.current");
      std::string limit;
      double used = 0;
      if (max >> limit && limit != "max" && current >> used)
        h.consider(std::stod(limit), used, "the cgroup's memory.max");
    }
  return h;
}

inline std::string mib(double bytes) {
  std::ostringstream s;
  s.setf(std::ios::fixed);
  s.precision(1);
  s << bytes / (1 << 20) << " MiB";
  return s.str();
}

/// Why the plan does not fit (empty when it does): Note [Checking the plan]. `held`: the
/// bytes of parameters the model holds already on this rank.
inline std::string plan_problem(const plan::Model& m, plan::stage s, double held, const MemoryCheck& check) {
  Headroom room;
  if (check.limit_bytes > 0) room.consider(static_cast<double>(check.limit_bytes), 0, "MemoryCheck::limit_bytes");
  else room = process_headroom();
  const auto need = plan::peak(m, s);
  if (need.total() - held <= room.bytes) return {};
  // What would fit: the whole peak within what the process may use plus what it holds now.
  const auto fits = [&](const plan::Model& x, plan::stage y) { return plan::peak(x, y).total() <= room.bytes + held; };
  std::string fix;
  for (auto stage : plan::stages)
    if (static_cast<int>(stage) > static_cast<int>(s) && fits(m, stage)) {
      fix = std::string(plan::to_string(stage)) + " at " + std::to_string(m.ranks) + " ranks plans " +
            mib(plan::peak(m, stage).total());
      break;
    }
  for (std::int64_t n = m.ranks + 1; n <= 65536 && fix.empty(); ++n) {
    auto more = m;
    more.ranks = n;
    if (fits(more, plan::stage::stage3))
      fix = "ZeRO-3 at " + std::to_string(n) + " ranks plans " + mib(plan::peak(more, plan::stage::stage3).total());
  }
  const auto t = need;
  return "the memory plan of " + std::string(plan::to_string(s)) + " at " + std::to_string(m.ranks) +
         " ranks is " + mib(t.total()) + " per rank (model states " + mib(t.states.total()) + ", gradient buckets " + mib(t.gradient_buckets) +
         ", gathered units " + mib(t.gathered_units) + ", the larger of gradients " + mib(t.gradients) +
         " and optimizer scratch " + mib(t.optimizer_scratch) + "; paratrain::plan::peak), of which " + mib(t.total() - held) +
         " is still to be allocated, but this process may use only " + mib(room.bytes) + " more (" + room.source +
         "); " + (fix.empty() ? std::string("no stage or world size up to 65536 fits") : fix + ", which fits") +
         " (docs/plan.md)";
}

}  // namespace detail

}  // namespace paratrain
