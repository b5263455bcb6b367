// expect: checkpoints know the state of torch::optim::SGD, Adam, AdamW, Adagrad and RMSprop
// LBFGS keeps state a checkpoint does not know how to name or reshard.
#include <torch/torch.h>

#include "paratrain/checkpoint/checkpoint.hpp"
#include "paratrain/strategy/data_parallel.hpp"

void save(paratrain::DataParallel<torch::nn::Linear, paratrain::comm::SingleDevice, torch::optim::LBFGS>& s) {
  paratrain::checkpoint::save(s, "ckpt", 1);
}
