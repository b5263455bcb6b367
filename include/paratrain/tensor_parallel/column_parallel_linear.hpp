#pragma once
/// \file
/// paratrain::tp::ColumnParallelLinear — a linear layer whose output features are cut over
/// the tensor group (Megatron-LM's column-parallel linear).

#include <ATen/ATen.h>
#include <torch/arg.h>
#include <torch/autograd.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <initializer_list>
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

// Note [Sequence-parallel inputs kept as shards]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under sequence parallelism a column-parallel region's input arrives as this rank's sequence
// shard and is all-gathered before the matrix product. Had the gather and the product been two
// autograd operations, the product would keep the gathered input, t times the shard, for its
// weight's gradient, and sequence parallelism would save none of the memory Korthikanti et al.
// count (their 2sbh/t for each such input). As Megatron-LM does, the gather and the products
// of every linear reading that input (attention's q, k and v) are one autograd function that
// keeps the shard and gathers it again in backward: per region one more all-gather of the
// input's bytes backward, so a block moves 6 all-gathers and 4 reduce-scatters of b·s·h under
// sequence parallelism instead of 4 and 4 (docs/tensor-parallelism.md, "Bytes moved").
//
// Note [Overlapping the regions' exchanges]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Backward needs the gathered input only for the weights' gradients, and the input's gradient
// only for the reduce-scatter: so the re-gather starts first (Group::all_gather_async), the
// input's gradient (Σ grad_i · W_i) is computed meanwhile, and its reduce-scatter then runs
// (reduce_scatter_async) while the weights' gradients are computed, as Megatron-LM's
// LinearWithGradAccumulationAndAsyncCommunication orders them. Where the communicator
// progresses on its own (NCCL's stream, Gloo's threads) the exchanges hide behind the
// products; Open MPI 4.1 without an asynchronous progress thread moves them mostly at wait().
namespace detail {

struct GatheredLinears : torch::autograd::Function<GatheredLinears> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const at::Tensor& shard,
                                                at::TensorList weights, at::TensorList biases, const Group& g,
                                                std::int64_t with_bias, std::int64_t dim) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(c10::make_intrusive<GroupHolder>(g));
    ctx->saved_data["with_bias"] = with_bias;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["biases"] = static_cast<std::int64_t>(biases.size());
    const auto whole = g.all_gather(shard, dim);
    torch::autograd::variable_list out;
    std::size_t b = 0;
    for (std::size_t i = 0; i < weights.size(); ++i)
      out.push_back(at::linear(whole, weights[i], (with_bias >> i) & 1 ? biases[b++] : at::Tensor()));
    torch::autograd::variable_list saved{shard};
    saved.insert(saved.end(), weights.begin(), weights.end());
    saved.insert(saved.end(), biases.begin(), biases.end());
    ctx->save_for_backward(saved);
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto holder = c10::static_intrusive_pointer_cast<GroupHolder>(ctx->saved_data["group"].toCapsule());
    const auto with_bias = ctx->saved_data["with_bias"].toInt();
    const auto dim = ctx->saved_data["dim"].toInt();
    const auto saved = ctx->get_saved_variables();
    const auto& shard = saved[0];
    const auto n_biases = static_cast<std::size_t>(ctx->saved_data["biases"].toInt());
    const auto n = saved.size() - 1 - n_biases;
    // Note [Overlapping the regions' exchanges]: the input's gather runs while the input's
    // gradient is computed, the gradient's reduce-scatter while the weights' are.
    auto regather = holder->group.all_gather_async(shard, dim);  // Note [Sequence-parallel inputs kept as shards]
    // Each output's gradient as a matrix; computed in its type (autocast's, when the forward
    // ran under it), each result back in its tensor's type, as autograd's casts would give.
    std::vector<at::Tensor> g2(n);
    at::Tensor whole_grad;
    for (std::size_t i = 0; i < n; ++i) {
      if (!grads[i].defined()) continue;
      g2[i] = grads[i].reshape({-1, grads[i].size(-1)});
      const auto w = saved[1 + i].to(g2[i].scalar_type());
      whole_grad = whole_grad.defined() ? whole_grad.addmm_(g2[i], w) : g2[i].mm(w);
    }
    const auto whole = regather.wait();
    Pending scatter;
    if (whole_grad.defined())
      scatter = holder->group.reduce_scatter_async(whole_grad.view(whole.sizes()).to(shard.scalar_type()), dim);
    at::Tensor x2;  // the gathered input as a matrix, in the gradients' type: once for every output
    torch::autograd::variable_list weight_grads(n), bias_grads;
    for (std::size_t i = 0; i < n; ++i) {
      const bool has_bias = (with_bias >> i) & 1;
      if (!g2[i].defined()) {
        if (has_bias) bias_grads.emplace_back();
        continue;
      }
      if (!x2.defined()) x2 = whole.reshape({-1, whole.size(-1)}).to(g2[i].scalar_type());
      weight_grads[i] = g2[i].t().mm(x2).to(saved[1 + i].scalar_type());
      if (has_bias) bias_grads.push_back(g2[i].sum(0).to(saved[1 + n + bias_grads.size()].scalar_type()));
    }
    at::Tensor shard_grad;
    if (whole_grad.defined()) shard_grad = scatter.wait();
    torch::autograd::variable_list out{shard_grad};
    out.insert(out.end(), weight_grads.begin(), weight_grads.end());
    out.insert(out.end(), bias_grads.begin(), bias_grads.end());
    out.resize(out.size() + 3);  // the group, the bias mask, the dimension
    return out;
  }
};

}  // namespace detail

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

  at::Tensor forward(const at::Tensor& x);

  [[nodiscard]] std::vector<ShardedParameter> slices() const override {
    const auto off = context_.group.rank() * part_;
    std::vector<ShardedParameter> out{{"weight", 0, off, options_.out_features()}};
    if (bias.defined()) out.push_back({"bias", 0, off, options_.out_features()});
    return out;
  }
  [[nodiscard]] const Group& slice_group() const override { return context_.group; }
  [[nodiscard]] const Context& context() const noexcept { return context_; }
  [[nodiscard]] const ColumnParallelLinearOptions& options() const noexcept { return options_; }

  at::Tensor weight, bias;

 private:
  ColumnParallelLinearOptions options_;
  Context context_;
  std::int64_t part_ = 0;
};
TORCH_MODULE(ColumnParallelLinear);

/// The outputs of column-parallel linears of one group that read the same input (attention's
/// q, k and v), each this rank's output features: the input enters their region once (Note
/// [Regions]). Whole on every rank, it is kept whole and its gradient all-reduced; under
/// sequence parallelism it is this rank's sequence shard, gathered, and kept as the shard
/// (Note [Sequence-parallel inputs kept as shards]).
[[nodiscard]] inline std::vector<at::Tensor> column_parallel(
    std::initializer_list<const ColumnParallelLinearImpl*> layers, const at::Tensor& x) {
  const auto& context = (*layers.begin())->context();
  const auto& g = context.group;
  std::vector<at::Tensor> out;
  if (!context.sequence_parallel || g.size() == 1) {
    const auto entered = copy_to_region(x, g);
    for (const auto* l : layers) out.push_back(at::linear(entered, l->weight, l->bias));
    return out;
  }
  std::vector<at::Tensor> weights, biases;
  std::int64_t with_bias = 0;
  for (const auto* l : layers) {
    if (l->bias.defined()) {
      with_bias |= std::int64_t{1} << weights.size();
      biases.push_back(l->bias);
    }
    weights.push_back(l->weight);
  }
  // As TensorLists: autograd counts their elements as inputs (a std::vector would be one opaque argument).
  return detail::GatheredLinears::apply(x, at::TensorList(weights), at::TensorList(biases), g, with_bias, sequence_dim);
}

inline at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  auto y = column_parallel({this}, x).front();
  return options_.gather_output() ? gather_from_region(y, context_.group, -1) : y;
}

}  // namespace paratrain::tensor_parallel
