#pragma once
/// \file
/// paratrain::Sharded — the ZeRO policy: `DataParallel<Net, Comm, Sharded<Optim, Stage>>`
/// trains like DDP while each rank holds only its share of the model states.

#include <concepts>
#include <type_traits>

#include "paratrain/concepts/communicator.hpp"
#include "paratrain/concepts/optimizer.hpp"

namespace paratrain {

/// The ZeRO stages (Rajbhandari et al. 2019). Per rank, with Ψ parameters, N ranks and
/// K bytes of optimizer state per parameter (fp32 Adam: K = 8), parameters and gradients
/// in fp32:
///
/// | stage            | shards                             | bytes per rank        | when                          |
/// |------------------|------------------------------------|-----------------------|-------------------------------|
/// | (DDP)            | nothing                            | (4 + 4 + K)Ψ          | the model states fit          |
/// | `zero::stage1`   | optimizer state                    | (4 + 4)Ψ + KΨ/N       | Adam's state is what overflows |
/// | `zero::stage2`   | + gradients (reduce-scattered)     | 4Ψ + (4 + K)Ψ/N       | the default choice: DDP's traffic |
/// | `zero::stage3`   | + parameters (gathered per Unit)   | (4 + 4 + K)Ψ/N        | the parameters themselves overflow |
///
/// Stage 2 moves as many bytes as DDP (a reduce-scatter and an all-gather are one
/// all-reduce); stage 1 all-reduces whole gradients, as DDP, and all-gathers the updated
/// parameters after, 1.5x; stage 3 gathers each unit's parameters twice (forward and
/// backward), 1.5x too.
/// `paratrain::plan` computes the table for your model; docs/sharding.md explains it.
namespace zero {
struct stage1 {
  static constexpr int value = 1;
};
struct stage2 {
  static constexpr int value = 2;
};
struct stage3 {
  static constexpr int value = 3;
};
template <class S>
concept stage = std::is_same_v<S, stage1> || std::is_same_v<S, stage2> || std::is_same_v<S, stage3>;
}  // namespace zero

/// The default of a strategy's update (DataParallel's `Update`, LocalDataParallel's `Optim`):
/// none. `DataParallel<Net>` used to mean SGD silently; naming the update is the user's
/// choice, and a strategy without one is a compile-time error that says so.
struct update_not_named {};

/// `Optim` (any torch::optim optimizer, unmodified) stepping only this rank's shard of
/// the parameters: the third argument of DataParallel.
///
/// \code
///   using Strategy = paratrain::DataParallel<Net, paratrain::comm::Mpi,
///                                            paratrain::Sharded<torch::optim::AdamW, paratrain::zero::stage2>>;
///   Strategy s(Net(), torch::optim::AdamWOptions(1e-3));
/// \endcode
///
/// `ShardGroup` G > 0 is hybrid sharding as a type: the state is sharded over groups of G
/// consecutive ranks and replicated across the groups, as DataParallelOptions::shard_group = G
/// spells it (Note [Hybrid sharding]): `Sharded<torch::optim::Adam, zero::stage3, 8>` shards
/// within each node of 8 GPUs. 0: over all data-parallel ranks, or as shard_group says.
template <class Optim, class Stage = zero::stage2, int ShardGroup = 0>
struct Sharded {
  static_assert(explain_optimizer<Optim>());
  static_assert(zero::stage<Stage>,
                "paratrain: the second argument of Sharded is the ZeRO stage: paratrain::zero::stage1, stage2 or stage3");
  static_assert(ShardGroup >= 0,
                "paratrain: the third argument of Sharded is the ranks of a shard group (hybrid sharding), or 0 for all");
  using optimizer_type = Optim;
  using stage_type = Stage;
  static constexpr int shard_group = ShardGroup;
};

namespace detail {
/// 0 for an optimizer (DDP), else the ZeRO stage of Sharded<Optim, Stage>.
template <class T>
inline constexpr int zero_stage_of = 0;
template <class O, class S, int G>
inline constexpr int zero_stage_of<Sharded<O, S, G>> = S::value;

/// The shard group Sharded<Optim, Stage, G> names: G, or 0 (none named).
template <class T>
inline constexpr int shard_group_of = 0;
template <class O, class S, int G>
inline constexpr int shard_group_of<Sharded<O, S, G>> = G;

/// The optimizer DataParallel drives: `Optim` itself, or the one inside Sharded<Optim, ...>.
template <class T>
struct optimizer_of {
  using type = T;
};
template <class O, class S, int G>
struct optimizer_of<Sharded<O, S, G>> {
  using type = O;
};
}  // namespace detail

/// DataParallel's third argument: an optimizer (DDP) or a Sharded<Optimizer, Stage> (ZeRO).
template <class P>
concept update_policy = optimizer<P> || (detail::zero_stage_of<P> > 0);

/// Checks `Update` (DataParallel's third argument) and what it asks of `Comm`, one
/// requirement a message: the update policy is an optimizer or a Sharded one; ZeRO needs a
/// communicator that overlaps sharding; stage 3 one that splits (its gathers' communicator).
template <class Update, class Comm>
consteval bool explain_update() {
  static_assert(update_policy<Update>,
                "paratrain: DataParallel's third argument is an optimizer type (torch::optim::Adam, ...) or "
                "paratrain::Sharded<Optimizer, paratrain::zero::stageN>");
  static_assert(explain_optimizer<typename detail::optimizer_of<Update>::type>());
  static_assert(detail::zero_stage_of<Update> == 0 || explain_async_sharding_communicator<Comm>());
  static_assert(detail::zero_stage_of<Update> < 3 || requires(const Comm& c) {
    { c.split(0, 0) } -> std::same_as<Comm>;
  }, "paratrain: ZeRO stage 3 gathers parameters on a communicator of its own and needs `Comm split(int "
     "color, int key) const`; see docs/communicators.md (or use stage 2)");
  return true;
}

}  // namespace paratrain
