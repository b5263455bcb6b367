// expect: paratrain: the model's forward must take one or more torch::Tensor and return a torch::Tensor
// A model whose forward takes something other than tensors is told which signature is needed
// where the strategy calls it.
#include <torch/torch.h>

#include "paratrain/strategy/data_parallel.hpp"

struct ScaledImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor a, double scale) { return a * scale; }
};
TORCH_MODULE(Scaled);

void train(paratrain::DataParallel<Scaled, paratrain::comm::SingleDevice, torch::optim::SGD>& strategy, const paratrain::Batch& batch) {
  strategy.step(batch, [](const torch::Tensor& out, const torch::Tensor& y) { return (out - y).square().mean(); });
}
