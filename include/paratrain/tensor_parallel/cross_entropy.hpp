#pragma once
/// \file
/// paratrain::tp::CrossEntropy — the cross-entropy of logits whose vocabulary is cut over
/// the tensor group, without gathering them (Megatron-LM's vocabulary-parallel cross-entropy).

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <cstdint>

#include "paratrain/core/error.hpp"
#include "paratrain/tensor_parallel/group.hpp"
#include "paratrain/tensor_parallel/regions.hpp"

namespace paratrain::tensor_parallel {

// Note [Vocabulary-parallel cross-entropy]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The logits of a vocabulary of V are [tokens, V]: gathering them for the loss would move
// and hold t times this rank's part. Shoeybi et al. (2019, §3) reduce three numbers per
// token instead: the largest logit (max over the group, for a stable exponent), the target's
// logit (the rank whose part holds it gives it, the others 0: a sum) and the sum of the
// exponentials (a sum). The loss is log Σ exp(z − m) − (z_target − m); its gradient,
// softmax − one-hot, is local to each rank's part, so backward communicates nothing.

namespace detail {
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& logits,
                            const at::Tensor& target, const Group& g) {
    const auto part = logits.size(-1), first = g.rank() * part;
    auto z = logits.detach().to(at::kFloat);
    auto max = std::get<0>(z.max(-1));
    g.all_reduce(max, reduce_op::max);
    z = z - max.unsqueeze(-1);
    const auto outside = target.lt(first).logical_or(target.ge(first + part));
    const auto local = (target - first).masked_fill(outside, 0);
    auto picked = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0);
    g.all_reduce(picked);
    auto e = z.exp();
    auto sum = e.sum(-1);
    g.all_reduce(sum);
    e.div_(sum.unsqueeze(-1));  // the softmax, this rank's part
    ctx->save_for_backward({e, local, outside});
    return (sum.log() - picked).to(logits.scalar_type());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto grad = saved[0].clone();
    grad.scatter_add_(-1, saved[1].unsqueeze(-1), saved[2].logical_not().to(grad.scalar_type()).unsqueeze(-1).neg());
    grad.mul_(grads[0].unsqueeze(-1));
    return {grad, at::Tensor(), at::Tensor()};
  }
};
}  // namespace detail

/// The mean cross-entropy over every token of `logits` ([..., V/t]: this rank's part of the
/// vocabulary, as a ColumnParallelLinear without gather_output returns it) against `target`
/// ([...], integers in [0, V)): equal to torch::nn::functional::cross_entropy on the whole
/// logits (Note [Vocabulary-parallel cross-entropy]).
[[nodiscard]] inline at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& target, const Group& g) {
  if (logits.dim() != target.dim() + 1)
    throw error("tp::cross_entropy", g.world_rank(),
                "the logits have " + std::to_string(logits.dim()) + " dimensions and the targets " +
                    std::to_string(target.dim()) + "; give logits [..., vocabulary part] for targets [...]");
  const auto flat = logits.reshape({-1, logits.size(-1)});
  return detail::VocabParallelCrossEntropy::apply(flat, target.reshape({-1}).to(at::kLong), g).mean();
}

/// A loss for DataParallel::step and fit: the vocabulary-parallel cross-entropy over the
/// strategy's tensor group (`tp::CrossEntropy loss{strategy.tensor_group()}`).
struct CrossEntropy {
  Group group;
  at::Tensor operator()(const at::Tensor& logits, const at::Tensor& target) const {
    return cross_entropy(logits, target, group);
  }
};

}  // namespace paratrain::tensor_parallel
