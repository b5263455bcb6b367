// expect: PipelineDriver::PipelineDriver\(\)[^ ]* is private within this context
// expect-from: compiler
// The driver hooks (Note [Steps driven from outside]) are the pipeline's: user code has no
// PipelineDriver to call them with.
#include <torch/torch.h>

#include "paratrain/comm/single_device.hpp"
#include "paratrain/strategy/data_parallel.hpp"

struct NetImpl : torch::nn::Module {
  NetImpl() { w = register_parameter("w", torch::ones({1})); }
  torch::Tensor forward(torch::Tensor x) { return x * w; }
  torch::Tensor w;
};
TORCH_MODULE(Net);

void drive(paratrain::DataParallel<Net>& ddp) { ddp.begin_external_step({}); }
