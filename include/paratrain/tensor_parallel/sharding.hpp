#pragma once
/// \file
/// Which parameters of a model are cut over a group of the mesh, and how: what strategies
/// (clipping, checks, averaging) and checkpoints ask of tensor-parallel layers and of
/// mixtures of experts.

#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "paratrain/tensor_parallel/group.hpp"

namespace paratrain::tensor_parallel {

/// A parameter of a sliced layer that each rank of the layer's group holds a slice of:
/// along `dim`, the elements [offset, offset + its size) of `whole`.
struct ShardedParameter {
  std::string name;  ///< within its layer ("weight")
  std::int64_t dim = 0;
  std::int64_t offset = 0;
  std::int64_t whole = 0;
};

/// What a layer whose parameters are cut over a group of the mesh says of itself: a
/// tensor-parallel layer (over the tensor dimension: slices of its matrices) or a mixture of
/// experts (over the expert dimension: its experts). Its parameters not named here are whole
/// on every rank of its group (replicated): layer norms, a row-parallel layer's bias, a router.
class ShardedLayer {
 public:
  virtual ~ShardedLayer() = default;
  /// This rank's slices.
  [[nodiscard]] virtual std::vector<ShardedParameter> slices() const = 0;
  /// The ranks that hold the other slices.
  [[nodiscard]] virtual const Group& slice_group() const = 0;
  /// The mesh dimension that group is.
  [[nodiscard]] virtual Dim slice_dim() const { return Dim::tensor; }
};

/// A sliced parameter of a model, by its full name.
struct ModelShard {
  ShardedParameter slice;
  const void* impl = nullptr;  ///< the parameter's TensorImpl
  int degree = 1;              ///< its group's size
  Dim over = Dim::tensor;      ///< the mesh dimension it is cut over
};

/// Every sliced parameter of `model` (degree > 1 only), by full name (as named_parameters()
/// spells it). `model` need not be held by a shared_ptr (a Unit while it is built: Note
/// [Sharded construction]).
[[nodiscard]] inline std::map<std::string, ModelShard> sliced_parameters_of(const torch::nn::Module& model) {
  std::map<std::string, ModelShard> out;
  const auto add = [&](const std::string& prefix, const torch::nn::Module& m) {
    const auto* layer = dynamic_cast<const ShardedLayer*>(&m);
    if (layer == nullptr || layer->slice_group().size() == 1) return;
    const auto params = m.named_parameters(/*recurse=*/false);
    for (auto& s : layer->slices())
      if (const auto* p = params.find(s.name))
        out.emplace(prefix.empty() ? s.name : prefix + "." + s.name,
                    ModelShard{s, p->unsafeGetTensorImpl(), layer->slice_group().size(), layer->slice_dim()});
  };
  add("", model);  // named_modules() would take the model itself from a shared_ptr
  for (const auto& m : model.named_modules("", /*include_self=*/false)) add(m.key(), *m.value());
  return out;
}

/// The TensorImpls of the parameters of `model` cut over mesh dimension `over`: the experts,
/// for Dim::expert (Note [Expert buckets]).
[[nodiscard]] inline std::set<const void*> parameters_cut_over(const torch::nn::Module& model, Dim over) {
  std::set<const void*> out;
  for (const auto& [name, shard] : sliced_parameters_of(model))
    if (shard.over == over) out.insert(shard.impl);
  return out;
}

}  // namespace paratrain::tensor_parallel
