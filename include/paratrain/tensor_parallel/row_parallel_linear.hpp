#pragma once
/// \file
/// paratrain::tp::RowParallelLinear — a linear layer whose input features are cut over the
/// tensor group (Megatron-LM's row-parallel linear).

#include <ATen/ATen.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "paratrain/tensor_parallel/column_parallel_linear.hpp"
#include "paratrain/tensor_parallel/context.hpp"
#include "paratrain/tensor_parallel/init.hpp"
#include "paratrain/tensor_parallel/regions.hpp"
#include "paratrain/tensor_parallel/sharding.hpp"

namespace paratrain::tensor_parallel {

struct RowParallelLinearOptions {
  RowParallelLinearOptions(std::int64_t in_features, std::int64_t out_features)
      : in_features_(in_features), out_features_(out_features) {}
  TORCH_ARG(std::int64_t, in_features);
  TORCH_ARG(std::int64_t, out_features);
  TORCH_ARG(bool, bias) = true;
  /// The input is cut over the group already (a ColumnParallelLinear's output): the usual
  /// case. Off: the input is whole, and each rank takes its part.
  TORCH_ARG(bool, input_is_parallel) = true;
  TORCH_ARG(std::optional<Context>, context) = std::nullopt;
};

/// y = x Wᵀ + b with W's columns (the input features) cut over the group: rank r holds
/// columns [r·in/t, (r+1)·in/t) of the weight torch::nn::Linear(in, out) would draw (Note
/// [Initialising a slice]), and the whole bias. The partial products are all-reduced (Note
/// [Regions]), or under sequence parallelism reduce-scattered along the sequence; the bias
/// is added after, once.
class RowParallelLinearImpl : public torch::nn::Module, public ShardedLayer {
 public:
  RowParallelLinearImpl(std::int64_t in_features, std::int64_t out_features)
      : RowParallelLinearImpl(RowParallelLinearOptions(in_features, out_features)) {}
  explicit RowParallelLinearImpl(const RowParallelLinearOptions& options)
      : options_(options), context_(context_for("tp::RowParallelLinear", options.context())) {
    const auto& g = context_.group;
    const auto in = options.in_features(), out = options.out_features();
    part_ = divided("tp::RowParallelLinear(" + std::to_string(in) + ", " + std::to_string(out) + ")",
                    "input features", in, g);
    weight = register_parameter("weight", linear_weight_slice(in, out, 0, out, g.rank() * part_, part_));
    if (options.bias()) bias = register_parameter("bias", linear_bias_slice(in, out, 0, out));
  }

  at::Tensor forward(const at::Tensor& x) {
    const auto& g = context_.group;
    const auto in = options_.input_is_parallel() ? x : scatter_to_region(x, g, -1);
    auto partial = at::linear(in, weight);
    auto y = context_.sequence_parallel ? reduce_scatter_sequence(partial, g, sequence_dim)
                                        : reduce_from_region(partial, g);
    if (!bias.defined()) return y;
    // Under sequence parallelism each rank adds the bias to its own tokens: its gradient
    // is partial, summed over the group by the region (Note [Regions]).
    return y + (context_.sequence_parallel ? copy_to_region(bias, g) : bias);
  }

  [[nodiscard]] std::vector<ShardedParameter> slices() const override {
    return {{"weight", 1, context_.group.rank() * part_, options_.in_features()}};
  }
  [[nodiscard]] const Group& slice_group() const override { return context_.group; }
  [[nodiscard]] const Context& context() const noexcept { return context_; }

  at::Tensor weight, bias;

 private:
  RowParallelLinearOptions options_;
  Context context_;
  std::int64_t part_ = 0;
};
TORCH_MODULE(RowParallelLinear);

}  // namespace paratrain::tensor_parallel
