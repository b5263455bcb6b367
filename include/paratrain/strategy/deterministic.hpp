#pragma once
/// \file
/// paratrain::Deterministic — the same bits at every world size and under every strategy:
/// the option, how a global batch is cut into virtual shards, and what the mode checks.

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/core/Generator.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "paratrain/collectives/agree.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/core/reduce_op.hpp"
#include "paratrain/core/shard_plan.hpp"

namespace paratrain {

// Note [Deterministic training]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A sum of floating-point numbers depends on its order, and an all-reduce's order on the
// world size and the library (NCCL's is not even fixed). With
// DataParallelOptions::deterministic = {.shards = K}, a step's result depends on the
// global batch alone:
// - the global batch of B samples is cut into K virtual shards, shard k holding B/K
//   (+1 for k < B mod K) consecutive samples (numpy's array_split); rank r of W computes
//   shards r, r + W, r + 2W, ... (K/W rounds), each with a forward and a backward of its
//   own: the same computation, on the same bits, whichever rank runs it;
// - in round j every rank's shard gradient (shard jW + r on rank r) is all-gathered, and
//   each rank adds the round's W gradients to its sums in shard order: over the rounds,
//   acc = g_0; acc += g_1; ...; acc += g_{K-1}, in fp32, which is what one process
//   computes accumulating the K shards' gradients in order. No collective reduces: the
//   all-gather moves bytes and the order of every addition is fixed;
// - the sum is divided by B, as in every step (Note [Exact averaging]); clipping's norm is
//   summed per parameter, in the model's order, from the whole gradient every rank then
//   holds; the NaN count is an integer;
// - ZeRO cuts the optimizer's state at other boundaries at other world sizes; an
//   elementwise optimizer (paratrain::elementwise_optimizer: SGD, Adam, AdamW, RMSprop,
//   Adagrad) computes every element alike wherever the cut is, others are refused;
// - random draws inside a shard (dropout) come from the default generators reseeded with
//   shard_seed(seed, step, k) for that shard, and restored after it;
// - LibTorch's kernels must be deterministic themselves: the mode turns on
//   at::globalContext().setDeterministicAlgorithms and requires one intra-op thread on a
//   CPU (a reduction split over threads is cut by their number) and CUBLAS_WORKSPACE_CONFIG
//   on a GPU (checked at construction, on every rank).
// K must be a multiple of every world size the run will see: 12 for 1, 2, 3, 4 ranks.
// The price: K/W forward and backward passes per rank of smaller batches, an all-gather
// of each round's gradients (W - 1 of them in, where a ring all-reduce moves 2(W-1)/W),
// and the sums kept between steps. docs/deterministic.md has the guarantees and limits.

/// DataParallelOptions::deterministic: Note [Deterministic training].
struct Deterministic {
  /// The virtual shards each global batch is cut into, a multiple of every world size the
  /// run will use (12 covers 1, 2, 3, 4, 6 and 12 ranks; 24 adds 8 and 24); 0: off. Each shard needs at
  /// least one sample; data::DeterministicSampler gives each rank its shards' samples.
  std::int64_t shards = 0;
  /// The seed of the random draws inside each shard's forward and backward (dropout).
  std::uint64_t seed = 0;
  [[nodiscard]] bool on() const noexcept { return shards > 0; }
};

/// Whether an optimizer's step is elementwise (every element's update reads that element's
/// gradient, value and state only), so that ZeRO's cuts, which move with the world size,
/// do not change its arithmetic: true for torch::optim::SGD, Adam, AdamW, RMSprop and
/// Adagrad. Deterministic mode refuses the others; specialize it for one of your own.
template <class Optimizer>
inline constexpr bool elementwise_optimizer = false;
template <>
inline constexpr bool elementwise_optimizer<torch::optim::SGD> = true;
template <>
inline constexpr bool elementwise_optimizer<torch::optim::Adam> = true;
template <>
inline constexpr bool elementwise_optimizer<torch::optim::AdamW> = true;
template <>
inline constexpr bool elementwise_optimizer<torch::optim::RMSprop> = true;
template <>
inline constexpr bool elementwise_optimizer<torch::optim::Adagrad> = true;


namespace detail {

/// For one shard's forward and backward: the default generators of the CPU and of
/// `device` (a GPU's) reseeded with `seed`, and put back as they were afterwards, so that
/// the draws of a shard are the same on any rank and the user's own stream goes on.
class ShardRandomness {
 public:
  ShardRandomness(const at::Device& device, std::uint64_t seed) {
    generators_.push_back(at::detail::getDefaultCPUGenerator());
    if (!device.is_cpu()) generators_.push_back(at::globalContext().defaultGenerator(device));
    for (auto& g : generators_) {
      const std::lock_guard<std::mutex> lock(g.mutex());
      saved_.push_back(g.get_state());
      g.set_current_seed(seed);
    }
  }
  ShardRandomness(const ShardRandomness&) = delete;
  ShardRandomness& operator=(const ShardRandomness&) = delete;
  ~ShardRandomness() {
    for (std::size_t i = 0; i < generators_.size(); ++i) {
      const std::lock_guard<std::mutex> lock(generators_[i].mutex());
      generators_[i].set_state(saved_[i]);
    }
  }

 private:
  std::vector<at::Generator> generators_;
  std::vector<at::Tensor> saved_;
};

/// Why deterministic mode cannot hold here, or empty: checked at construction (every rank
/// raises the first rank's answer). `buffer`: the name of a buffer of the model, if any.
template <class Optimizer>
std::string deterministic_problem(const Deterministic& d, int world_size, const at::Device& device,
                                  const std::string& buffer, bool narrow_reduction, bool all_gather) {
  if (!d.on()) return d.shards < 0 ? "DataParallelOptions::deterministic.shards is " + std::to_string(d.shards) +
                                         "; it is the virtual shards of a global batch, at least 1 (0: off)"
                                   : std::string();
  if (d.shards % world_size != 0)
    return "DataParallelOptions::deterministic.shards is " + std::to_string(d.shards) + ", not a multiple of the " +
           std::to_string(world_size) +
           " ranks; choose a multiple of every world size the run will use (12 for 1, 2, 3 and 4 ranks)";
  if (!all_gather)
    return "deterministic mode combines gradients with all_gather, which this communicator lacks (a "
           "sharding_communicator has it; docs/communicators.md)";
  if (!elementwise_optimizer<Optimizer>)
    return "deterministic mode needs an elementwise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad), whose result "
           "does not depend on where ZeRO cuts the parameters; specialize paratrain::elementwise_optimizer for one "
           "of your own that is";
  if (!buffer.empty())
    return "deterministic mode trains models without buffers: buffer '" + buffer +
           "' (running statistics, say) would be updated only by the shards a rank computes, which depend on the "
           "world size";
  if (narrow_reduction)
    return "deterministic mode sums gradients in fp32 in a fixed order; leave Precision::reduce unset";
  if (device.is_cpu() && at::get_num_threads() != 1)
    return "deterministic mode on a CPU needs one intra-op thread (at::set_num_threads(1), OMP_NUM_THREADS=1): "
           "LibTorch splits reductions among " +
           std::to_string(at::get_num_threads()) + " threads, and their number changes the sums";
  if (device.is_cuda()) {
    const char* cublas = std::getenv("CUBLAS_WORKSPACE_CONFIG");
    const std::string value = cublas != nullptr ? cublas : "";
    if (value != ":4096:8" && value != ":16:8")
      return "deterministic mode on a GPU needs CUBLAS_WORKSPACE_CONFIG=:4096:8 (or :16:8) in the environment "
             "before CUDA starts, for cuBLAS's deterministic kernels; it is '" +
             value + "'";
  }
  return {};
}

/// Every rank's sample count and whether its batch is usable (`problem`), in one
/// all-reduce of integers over the data ranks `group` (exact in any order): the global
/// batch's shard plan, known and checked alike on every rank, which all throw when one
/// rank's samples do not fit it. Collective.
template <class Group>
ShardPlan agree_on_shards(Group& group, std::int64_t samples, const std::string& problem,
                                         std::int64_t shards) {
  const int ranks = group.size(), me = group.rank();
  auto counts = at::zeros({ranks + 1}, at::kDouble);
  counts[me] = static_cast<double>(samples);
  counts[ranks] = problem.empty() ? 0.0 : 1.0;
  group.all_reduce(counts, reduce_op::sum);
  const auto c = counts.cpu();
  if (c[ranks].item<double>() > 0) raise_everywhere(group, "DataParallel::step", problem);
  std::int64_t total = 0;
  for (int r = 0; r < ranks; ++r) total += static_cast<std::int64_t>(c[r].item<double>());
  const ShardPlan plan(total, shards);
  std::string mismatch;
  for (int r = 0; r < ranks && mismatch.empty(); ++r) {
    const auto got = static_cast<std::int64_t>(c[r].item<double>()), want = plan.rank_samples(r, ranks);
    if (total < shards)
      mismatch = "a global batch of " + std::to_string(total) + " samples cannot fill " + std::to_string(shards) +
                 " virtual shards (DataParallelOptions::deterministic.shards): each needs at least one";
    else if (got != want)
      mismatch = "rank " + std::to_string(r) + " was given " + std::to_string(got) + " samples, but its shards of " +
                 "the global batch of " + std::to_string(total) + " hold " + std::to_string(want) + " (shards " +
                 std::to_string(r) + ", " + std::to_string(r + ranks) + ", ... of " + std::to_string(shards) +
                 "); feed the steps from data::DeterministicSampler";
  }
  if (!mismatch.empty()) throw error("DataParallel::step", me, mismatch);
  return plan;
}

}  // namespace detail
}  // namespace paratrain
