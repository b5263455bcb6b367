#pragma once
/// \file
/// paratrain::tp::ColumnParallelLinear — a linear layer whose output features are cut over
/// the tensor group (Megatron-LM's column-parallel linear).

#include <ATen/ATen.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "paratrain/tensor_parallel/context.hpp"
#include "paratrain/tensor_parallel/init.hpp"
#include "paratrain/tensor_parallel/regions.hpp"
#include "paratrain/tensor_parallel/sharding.hpp"

namespace paratrain::tensor_parallel {

/// Activations are [batch, sequence, features]; sequence parallelism cuts this dimension.
inline constexpr std::int64_t sequence_dim = 1;

struct ColumnParallelLinearOptions {
  ColumnParallelLinearOptions(std::int64_t in_features, std::int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(std::int64_t, in_features);
  TORCH_ARG(std::int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  /// Gather every rank's output features (for a last layer whose output is used whole);
  /// off: each rank returns its own, for a RowParallelLinear or a vocabulary-parallel loss.
  TORCH_ARG(bool, gather_output) = false;
  /// The group and mode; default: the Construction's (Note [Building a tensor-parallel model]).
  TORCH_ARG(std::optional<Context>, context) = std::nullopt;
};

/// y = x Wᵀ + b with W's rows (the output features) cut over the group: rank r holds rows
/// [r·out/t, (r+1)·out/t), initialised as torch::nn::Linear(in, out) would initialise them
/// (Note [Initialising a slice]). The input is whole on every rank (its gradient all-reduced:
/// Note [Regions]), or under sequence parallelism this rank's sequence shard (gathered).
class ColumnParallelLinearImpl : public torch::nn::Module, public ShardedLayer {
 public:
  ColumnParallelLinearImpl(std::int64_t in_features, std::int64_t out_features)
      : ColumnParallelLinearImpl(ColumnParallelLinearOptions(in_features, out_features)) {}
  explicit ColumnParallelLinearImpl(const ColumnParallelLinearOptions& options)
      : options_(options), context_(context_for("tp::ColumnParallelLinear", options.context())) {
    const auto& g = context_.group;
    const auto in = options.in_features(), out = options.out_features();
    part_ = divided("tp::ColumnParallelLinear(" + std::to_string(in) + ", " + std::to_string(out) + ")",
                    "output features", out, g);
    weight = register_parameter("weight", linear_weight_slice(in, out, g.rank() * part_, part_, 0, in));
    if (options.bias()) bias = register_parameter("bias", linear_bias_slice(in, out, g.rank() * part_, part_));
  }

  at::Tensor forward(const at::Tensor& x) {
    auto y = local(enter(x));
    return options_.gather_output() ? gather_from_region(y, context_.group, -1) : y;
  }
  /// The region's entry (Note [Regions]): x whole on every rank, its gradient all-reduced;
  /// or, under sequence parallelism, the sequence shards gathered. Layers that share one
  /// input (attention's q, k, v) enter once and call local() on each.
  [[nodiscard]] at::Tensor enter(const at::Tensor& x) const {
    return context_.sequence_parallel ? gather_sequence(x, context_.group, sequence_dim)
                                      : copy_to_region(x, context_.group);
  }
  /// This rank's output features of an input that entered the region.
  [[nodiscard]] at::Tensor local(const at::Tensor& entered) const { return at::linear(entered, weight, bias); }

  [[nodiscard]] std::vector<ShardedParameter> tensor_shards() const override {
    const auto off = context_.group.rank() * part_;
    std::vector<ShardedParameter> out{{"weight", 0, off, options_.out_features()}};
    if (bias.defined()) out.push_back({"bias", 0, off, options_.out_features()});
    return out;
  }
  [[nodiscard]] const Group& tensor_group() const override { return context_.group; }
  [[nodiscard]] const Context& context() const noexcept { return context_; }
  [[nodiscard]] const ColumnParallelLinearOptions& options() const noexcept { return options_; }

  at::Tensor weight, bias;

 private:
  ColumnParallelLinearOptions options_;
  Context context_;
  std::int64_t part_ = 0;
};
TORCH_MODULE(ColumnParallelLinear);

}  // namespace paratrain::tensor_parallel
