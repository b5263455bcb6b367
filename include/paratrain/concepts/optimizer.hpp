#pragma once
/// \file
/// paratrain::optimizer — the optimizers a strategy can drive.

#include <torch/optim/optimizer.h>

#include <concepts>
#include <vector>

namespace paratrain {

/// A LibTorch optimizer type (torch::optim::SGD, Adam, AdamW, RMSprop, Adagrad, or your
/// own subclass of torch::optim::Optimizer).
template <class O>
concept optimizer = std::derived_from<O, torch::optim::Optimizer>;

/// An optimizer that can be made over a list of parameters from options of type `Opts`,
/// as `torch::optim::Adam(params, torch::optim::AdamOptions(1e-3))` is.
template <class O, class Opts>
concept optimizer_from = optimizer<O> && std::constructible_from<O, std::vector<at::Tensor>, Opts>;

template <class O>
consteval bool explain_optimizer() {
  static_assert(optimizer<O>,
                "paratrain: the optimizer must be a class derived from torch::optim::Optimizer, such as "
                "torch::optim::SGD or torch::optim::Adam (the type, not an instance)");
  return true;
}

}  // namespace paratrain
