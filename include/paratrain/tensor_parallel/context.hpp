#pragma once
/// \file
/// paratrain::tp::Context and tp::Construction — which tensor group a tensor-parallel
/// layer joins, and whether it runs sequence-parallel (Note [Building a tensor-parallel model]).

#include <optional>
#include <string>

#include "paratrain/core/error.hpp"
#include "paratrain/tensor_parallel/group.hpp"

namespace paratrain::tensor_parallel {

// Note [Building a tensor-parallel model]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A tensor-parallel layer needs its group the moment it is built: it keeps only its slice
// of each matrix. The strategy that owns the mesh builds the model (its build function, or
// the model's default constructor: `Strategy s(torch::optim::SGDOptions(0.1), {.tensor_parallel
// = 2})`) inside a Construction, a scope that says which group and mode the layers built on
// this thread join, as ShardedConstruction tells ZeRO-3's units where they shard (Note
// [Sharded construction]). A layer built outside any scope and without a Context of its own
// has no group to join: an error naming the layer, never a silent degree 1. Tests and tools
// that build layers by hand give each a Context (a Group of one rank is the plain layer).

/// The group a tensor-parallel layer joins, and whether its activations between blocks are
/// cut along the sequence (Korthikanti et al. 2022); and the context group the model's
/// sequences are cut over (context parallelism: its attention runs over it, cp::attention).
struct Context {
  Group group{};
  bool sequence_parallel = false;
  Group context{};  ///< the mesh's context dimension; one rank: sequences whole
  Group expert{};   ///< the mesh's expert dimension; one rank: every expert on every rank
};

/// The context group of the model being built on this thread (Context::context of the
/// strategy's Construction), or a group of one outside any: what a model's attention runs
/// over (cp::attention), taken where the model is built.
[[nodiscard]] inline Group context_group();

/// The expert group of the model being built on this thread (Context::expert of the
/// strategy's Construction), or a group of one outside any: what its moe::MixtureOfExperts
/// layers cut their experts over, taken where the model is built.
[[nodiscard]] inline Group expert_group();

/// While one exists on this thread, every tensor-parallel layer built without a Context of
/// its own joins this one (Note [Building a tensor-parallel model]). Scopes do not nest.
class Construction {
 public:
  explicit Construction(Context context) : context_(std::move(context)) {
    if (current_ != nullptr)
      throw error("tp::Construction", context_.group.world_rank(),
                  "a tensor-parallel model is already being built on this thread");
    current_ = this;
  }
  Construction(const Construction&) = delete;
  Construction& operator=(const Construction&) = delete;
  ~Construction() { current_ = nullptr; }

  /// The scope's context on this thread, or null.
  [[nodiscard]] static const Context* current() noexcept { return current_ ? &current_->context_ : nullptr; }

 private:
  Context context_;
  static inline thread_local Construction* current_ = nullptr;
};

inline Group context_group() {
  const auto* c = Construction::current();
  return c ? c->context : Group{};
}
inline Group expert_group() {
  const auto* c = Construction::current();
  return c ? c->expert : Group{};
}

/// The context a layer named `layer` joins: `given`, else the scope's, else an error.
[[nodiscard]] inline Context context_for(const std::string& layer, const std::optional<Context>& given) {
  if (given) return *given;
  if (const auto* c = Construction::current()) return *c;
  throw error(layer, -1,
              "a tensor-parallel layer was built where no tensor group exists: build the model inside its strategy "
              "(a build function or the model's default constructor; DataParallelOptions::tensor_parallel sets the "
              "degree), or give the layer a tp::Context (Note [Building a tensor-parallel model])");
}

/// `n` cut over `ranks`: an error naming the layer and the sizes where it does not divide.
[[nodiscard]] inline std::int64_t divided(const std::string& layer, const char* what, std::int64_t n,
                                          const Group& group) {
  if (n % group.size() != 0)
    throw error(layer, group.world_rank(),
                std::string("its ") + what + " (" + std::to_string(n) + ") is not a multiple of the tensor degree (" +
                    std::to_string(group.size()) + "); choose a degree that divides it");
  return n / group.size();
}

}  // namespace paratrain::tensor_parallel
