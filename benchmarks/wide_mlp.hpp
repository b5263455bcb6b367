#pragma once
// The model of the ZeRO and checkpoint benchmarks (and of zero_vs_torch.py /
// checkpoint_vs_torch.py): `layers` x Linear(2048, 2048) with ReLU and a Linear(2048, 10)
// head, each layer a paratrain::Unit. 4 layers are 16.8M parameters, 12 are 50.4M.
#include <torch/torch.h>

#include <string>
#include <vector>

#include "paratrain/strategy/unit.hpp"

namespace paratrain::bench {

constexpr std::int64_t wide_mlp_width = 2048;

struct WideMlpImpl : torch::nn::Module {
  explicit WideMlpImpl(int layers) {
    for (int i = 0; i < layers; ++i)
      hidden.push_back(register_module("fc" + std::to_string(i),
                                       paratrain::Unit<torch::nn::Linear>(wide_mlp_width, wide_mlp_width)));
    head = register_module("head", paratrain::Unit<torch::nn::Linear>(wide_mlp_width, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : hidden) x = torch::relu(l(x));
    return head(x);
  }
  std::vector<paratrain::Unit<torch::nn::Linear>> hidden;
  paratrain::Unit<torch::nn::Linear> head{nullptr};
};
TORCH_MODULE(WideMlp);

}  // namespace paratrain::bench
