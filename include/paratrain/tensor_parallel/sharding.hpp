#pragma once
/// \file
/// Which parameters of a model are cut over its tensor group, and how: what strategies
/// (clipping, checks) and checkpoints ask of tensor-parallel layers.

#include <torch/nn/module.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "paratrain/tensor_parallel/group.hpp"

namespace paratrain::tensor_parallel {

/// A parameter of a tensor-parallel layer that each rank of the group holds a slice of:
/// along `dim`, the elements [offset, offset + its size) of `whole`.
struct ShardedParameter {
  std::string name;  ///< within its layer ("weight")
  std::int64_t dim = 0;
  std::int64_t offset = 0;
  std::int64_t whole = 0;
};

/// What a tensor-parallel layer says of itself. Its parameters not named here are whole on
/// every rank of its group (replicated): layer norms, a row-parallel layer's bias.
class ShardedLayer {
 public:
  virtual ~ShardedLayer() = default;
  /// This rank's slices.
  [[nodiscard]] virtual std::vector<ShardedParameter> tensor_shards() const = 0;
  [[nodiscard]] virtual const Group& tensor_group() const = 0;
};

/// A tensor-sharded parameter of a model, by its full name.
struct ModelShard {
  ShardedParameter slice;
  const void* impl = nullptr;  ///< the parameter's TensorImpl
  int degree = 1;              ///< its group's size
};

/// Every tensor-sharded parameter of `model` (degree > 1 only), by full name (as
/// named_parameters() spells it).
[[nodiscard]] inline std::map<std::string, ModelShard> tensor_shards_of(const torch::nn::Module& model) {
  std::map<std::string, ModelShard> out;
  for (const auto& m : model.named_modules()) {
    const auto* layer = dynamic_cast<const ShardedLayer*>(m.value().get());
    if (layer == nullptr || layer->tensor_group().size() == 1) continue;
    const auto params = m.value()->named_parameters(/*recurse=*/false);
    for (auto& s : layer->tensor_shards()) {
      const auto* p = params.find(s.name);
      if (p == nullptr) continue;
      const auto full = m.key().empty() ? s.name : m.key() + "." + s.name;
      out.emplace(full, ModelShard{s, p->unsafeGetTensorImpl(), layer->tensor_group().size()});
    }
  }
  return out;
}

}  // namespace paratrain::tensor_parallel
