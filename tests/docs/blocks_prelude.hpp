// The names the docs' C++ blocks use without declaring them: the user's model, data and
// strategy (docs/testing.md, "Code in the docs"). A block that declares a name of its own
// (its own Net, Strategy, train) hides these: each block is in a namespace of its own.
//
// The blocks are compiled, never linked or run: the objects below are only declared.
#pragma once

#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <memory>
#include <numbers>
#include <span>
#include <vector>

#include <paratrain/paratrain.hpp>
#include <torch/torch.h>

// The model: one linear layer, cloneable (LocalDataParallel replicates it).
struct NetImpl : torch::nn::Cloneable<NetImpl> {
  NetImpl() { reset(); }
  void reset() override { fc = register_module("fc", torch::nn::Linear(784, 10)); }
  torch::Tensor forward(torch::Tensor x) { return fc(x.flatten(1)); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Net);

// Pipeline stages (docs/pipeline.md): each built from a width, each one tensor to one tensor.
template <int N>
struct DocsStageImpl : torch::nn::Module {
  explicit DocsStageImpl(int width = 16) { fc = register_module("fc", torch::nn::Linear(width, width)); }
  torch::Tensor forward(torch::Tensor x) { return fc(x); }
  torch::nn::Linear fc{nullptr};
};
struct EncoderImpl : DocsStageImpl<0> { using DocsStageImpl::DocsStageImpl; };
TORCH_MODULE(Encoder);
struct DecoderImpl : DocsStageImpl<1> { using DocsStageImpl::DocsStageImpl; };
TORCH_MODULE(Decoder);
struct EmbedImpl : DocsStageImpl<2> { using DocsStageImpl::DocsStageImpl; };
TORCH_MODULE(Embed);
struct BlocksImpl : DocsStageImpl<3> { using DocsStageImpl::DocsStageImpl; };
TORCH_MODULE(Blocks);
struct HeadImpl : DocsStageImpl<4> { using DocsStageImpl::DocsStageImpl; };
TORCH_MODULE(Head);

// main's arguments, for blocks that are statements.
extern int argc;
extern char** argv;

// The data: tensors, and datasets made of them.
extern torch::Tensor images, labels, train_images, train_labels, test_images, test_labels;
extern const paratrain::data::TensorDataset train, test, data;
extern std::vector<paratrain::Batch> micro_batches;
extern paratrain::Batch first_half, second_half, last;
std::vector<paratrain::Batch> my_batches(int rank, int world_size);
void train_step(const torch::Tensor& inputs, const torch::Tensor& targets);  // a hand-written step
extern int rank, world_size, epochs;
extern std::int64_t step;

// Strategies: DDP (strategy, ddp) and a pipeline (s, as docs/pipeline.md names it; what
// docs/checkpoints.md says of any strategy is then checked on the less common kind).
using DocsStrategy = paratrain::DataParallel<Net, paratrain::comm::Mpi, torch::optim::Adam>;
extern DocsStrategy strategy, ddp;
using DocsPipeline = paratrain::DataParallel<paratrain::Pipeline<Encoder, Decoder>, paratrain::comm::Mpi, torch::optim::Adam>;
extern DocsPipeline s;
// The aliases the pages define once and use in later blocks.
using Strategy = DocsStrategy;
using ZeRO2 = paratrain::DataParallel<Net, paratrain::comm::Mpi,
                                      paratrain::Sharded<torch::optim::AdamW, paratrain::zero::stage2>>;
#if PARATRAIN_HAS_NCCL
extern paratrain::comm::Nccl gpus;  // docs/communicators.md
#endif
extern paratrain::Pipeline<Encoder, Decoder> stages;
extern Net net;
extern paratrain::CrossEntropy loss;
extern double batch_loss;
extern std::int64_t batch_size;

// Optimizer options and parameter groups (docs/sharding.md, docs/precision.md).
extern torch::optim::AdamOptions adam;
extern torch::optim::AdamWOptions adamw, opts, no_decay;
extern std::vector<torch::Tensor> weights, biases;
