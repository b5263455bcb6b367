// expect: paratrain: Pipeline stage I.1 .To. cannot take the output of stage I .From.
// A stage whose forward takes two tensors after a stage that returns one: the compiler
// prints the instantiation stage_link<0, First, Second> with the message.
#include <torch/torch.h>

#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/pipeline/pipeline.hpp"

struct FirstImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x) { return x; }
};
TORCH_MODULE(First);

struct SecondImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor h, torch::Tensor z) { return h + z; }
};
TORCH_MODULE(Second);

paratrain::Pipeline<First, Second> stages;
