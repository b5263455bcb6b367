#pragma once
/// \file
/// paratrain::tp::Mlp — a Transformer's feed-forward block cut over the tensor group
/// (Megatron-LM's parallel MLP).

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>

#include "paratrain/tensor_parallel/column_parallel_linear.hpp"
#include "paratrain/tensor_parallel/context.hpp"
#include "paratrain/tensor_parallel/row_parallel_linear.hpp"

namespace paratrain::tensor_parallel {

/// fc2(gelu(fc1(x))): fc1 a ColumnParallelLinear(hidden, ffn), fc2 a RowParallelLinear(ffn,
/// hidden); each rank computes ffn/t of the inner features, one all-reduce forward and one
/// backward (Note [Regions]). GELU is the exact (erf) one, as torch::gelu's default.
class MlpImpl : public torch::nn::Module {
 public:
  MlpImpl(std::int64_t hidden, std::int64_t ffn, std::optional<Context> context = std::nullopt)
      : context_(context_for("tp::Mlp", context)) {
    fc1 = register_module("fc1", ColumnParallelLinear(ColumnParallelLinearOptions(hidden, ffn).context(context_)));
    fc2 = register_module("fc2", RowParallelLinear(RowParallelLinearOptions(ffn, hidden).context(context_)));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(at::gelu(fc1(x))); }

  ColumnParallelLinear fc1{nullptr};
  RowParallelLinear fc2{nullptr};

 private:
  Context context_;
};
TORCH_MODULE(Mlp);

}  // namespace paratrain::tensor_parallel
