#pragma once
/// \file
/// paratrain::tp::LayerNorm — torch::nn::LayerNorm over the last dimension, replicated over
/// the tensor group; on sequence shards its gradients are summed over the group.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <optional>

#include "paratrain/tensor_parallel/context.hpp"
#include "paratrain/tensor_parallel/regions.hpp"

namespace paratrain::tensor_parallel {

/// As torch::nn::LayerNorm(LayerNormOptions({dim}).eps(eps)): weight ones, bias zeros, whole
/// on every rank. Under sequence parallelism each rank normalises its own tokens, so each
/// holds part of the parameters' gradients: they pass through copy_to_region, which sums
/// them over the group in backward (Korthikanti et al. 2022, §4.2.2).
class LayerNormImpl : public torch::nn::Module {
 public:
  explicit LayerNormImpl(std::int64_t dim, double eps = 1e-5, std::optional<Context> context = std::nullopt)
      : dim_(dim), eps_(eps), context_(context_for("tp::LayerNorm", context)) {
    weight = register_parameter("weight", at::ones({dim}));
    bias = register_parameter("bias", at::zeros({dim}));
  }
  at::Tensor forward(const at::Tensor& x) {
    if (context_.sequence_parallel)
      return at::layer_norm(x, {dim_}, copy_to_region(weight, context_.group), copy_to_region(bias, context_.group),
                            eps_);
    return at::layer_norm(x, {dim_}, weight, bias, eps_);
  }
  [[nodiscard]] const Context& context() const noexcept { return context_; }

  at::Tensor weight, bias;

 private:
  std::int64_t dim_;
  double eps_;
  Context context_;
};
TORCH_MODULE(LayerNorm);

}  // namespace paratrain::tensor_parallel
