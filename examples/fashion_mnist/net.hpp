#pragma once
// The demo's model: a small CNN (two convolutions, batch norm, two linear layers).
// The convolutions and linear layers are paratrain::Unit: under ZeRO stage 3 each one's
// parameters are gathered just before it runs; under every other strategy a Unit is the
// plain layer.
#include <torch/torch.h>

#include "paratrain/strategy/unit.hpp"

namespace fashion_mnist {

// Cloneable, so that LocalDataParallel can replicate it; the layers are built in reset().
struct NetImpl : torch::nn::Cloneable<NetImpl> {
  NetImpl() { reset(); }
  void reset() override {
    conv1 = register_module("conv1", paratrain::Unit<torch::nn::Conv2d>(torch::nn::Conv2dOptions(1, 16, 5)));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(16));
    conv2 = register_module("conv2", paratrain::Unit<torch::nn::Conv2d>(torch::nn::Conv2dOptions(16, 32, 5)));
    bn2 = register_module("bn2", torch::nn::BatchNorm2d(32));
    fc1 = register_module("fc1", paratrain::Unit<torch::nn::Linear>(32 * 4 * 4, 128));
    fc2 = register_module("fc2", paratrain::Unit<torch::nn::Linear>(128, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(bn1(conv1(x))), 2);  // 16 x 12 x 12
    x = torch::max_pool2d(torch::relu(bn2(conv2(x))), 2);  // 32 x 4 x 4
    return fc2(torch::relu(fc1(x.flatten(1))));
  }
  paratrain::Unit<torch::nn::Conv2d> conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  paratrain::Unit<torch::nn::Linear> fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

}  // namespace fashion_mnist
