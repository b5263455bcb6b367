// Static tests: the concepts accept what they should and reject what they should.
// This file has no run-time content; it passes by compiling.
#include <ATen/core/Tensor.h>

#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/comm/single_device.hpp"
#include "paratrain/concepts/communicator.hpp"

namespace {

using paratrain::reduce_op;
namespace comm = paratrain::comm;

// The shipped communicators model every refinement.
static_assert(paratrain::communicator<comm::SingleDevice>);
static_assert(paratrain::sharding_communicator<comm::SingleDevice>);
static_assert(paratrain::point_to_point_communicator<comm::SingleDevice>);
static_assert(paratrain::async_communicator<comm::SingleDevice>);
static_assert(paratrain::async_sharding_communicator<comm::SingleDevice>);
static_assert(paratrain::explain_async_sharding_communicator<comm::SingleDevice>());
static_assert(paratrain::communicator<comm::Mpi>);
static_assert(paratrain::sharding_communicator<comm::Mpi>);
static_assert(paratrain::point_to_point_communicator<comm::Mpi>);
static_assert(paratrain::async_communicator<comm::Mpi>);
static_assert(paratrain::async_sharding_communicator<comm::Mpi>);
static_assert(paratrain::explain_async_sharding_communicator<comm::Mpi>());
static_assert(paratrain::request<comm::Mpi::Request>);
static_assert(paratrain::explain_sharding_communicator<comm::Mpi>());

// Things that are not communicators.
static_assert(!paratrain::communicator<int>);
static_assert(!paratrain::communicator<at::Tensor>);

struct OnlyReduces {
  int rank() const { return 0; }
  int size() const { return 1; }
  void all_reduce(at::Tensor&, reduce_op) {}
  void broadcast(at::Tensor&, int) {}
  void barrier() {}
};
static_assert(paratrain::communicator<OnlyReduces>);
static_assert(!paratrain::sharding_communicator<OnlyReduces>);
static_assert(!paratrain::point_to_point_communicator<OnlyReduces>);
static_assert(!paratrain::async_communicator<OnlyReduces>);
static_assert(!paratrain::async_sharding_communicator<OnlyReduces>);

// Blocking sharding alone is not enough for the overlapped form.
struct BlockingSharding : OnlyReduces {
  void reduce_scatter(const at::Tensor&, at::Tensor&, reduce_op) {}
  void all_gather(const at::Tensor&, at::Tensor&) {}
};
static_assert(paratrain::sharding_communicator<BlockingSharding>);
static_assert(!paratrain::async_sharding_communicator<BlockingSharding>);

// Non-blocking members that return nothing to wait on are not requests.
struct VoidAsyncSharding : BlockingSharding {
  void ireduce_scatter(const at::Tensor&, at::Tensor&, reduce_op) {}
  void iall_gather(const at::Tensor&, at::Tensor&) {}
};
static_assert(!paratrain::async_sharding_communicator<VoidAsyncSharding>);

struct RankIsLong : OnlyReduces {
  long rank() const { return 0; }
};
static_assert(!paratrain::communicator<RankIsLong>);

struct NotMovable : OnlyReduces {
  NotMovable() = default;
  NotMovable(NotMovable&&) = delete;
};
static_assert(!paratrain::communicator<NotMovable>);

}  // namespace

// ---- models and optimizers ------------------------------------------------------
#include <torch/torch.h>

#include "paratrain/concepts/module.hpp"
#include "paratrain/concepts/optimizer.hpp"
#include "paratrain/concepts/strategy.hpp"
#include "paratrain/fit/fit.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/strategy/local_data_parallel.hpp"
#include "paratrain/pipeline/pipeline.hpp"
#include "paratrain/concepts/checkpointable.hpp"

namespace {

struct PlainImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x) { return x; }
};
TORCH_MODULE(Plain);

struct CopyableImpl : torch::nn::Cloneable<CopyableImpl> {
  void reset() override {}
  torch::Tensor forward(torch::Tensor x) { return x; }
};
TORCH_MODULE(Copyable);

struct TwoInputsImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor a, torch::Tensor b) { return a + b; }
};
TORCH_MODULE(TwoInputs);

static_assert(paratrain::module<Plain>);
static_assert(paratrain::module<std::shared_ptr<PlainImpl>>);
static_assert(paratrain::module<torch::nn::Linear>);
static_assert(!paratrain::module<int>);
static_assert(!paratrain::module<PlainImpl>);  // the Impl itself, not a handle
static_assert(paratrain::stage_of<Plain, at::Tensor, at::Tensor>);
static_assert(paratrain::stage_of<torch::nn::Linear, at::Tensor, at::Tensor>);
static_assert(!paratrain::stage_of<TwoInputs, at::Tensor, at::Tensor>);
static_assert(!paratrain::stage_of<Plain, std::tuple<at::Tensor, at::Tensor>, at::Tensor>);
static_assert(paratrain::cloneable_module<Copyable>);
static_assert(paratrain::cloneable_module<torch::nn::Linear>);
static_assert(!paratrain::cloneable_module<Plain>);  // Module::clone() exists but throws

static_assert(paratrain::optimizer<torch::optim::Adam>);
static_assert(paratrain::optimizer<torch::optim::SGD>);
static_assert(!paratrain::optimizer<torch::optim::AdamOptions>);
static_assert(paratrain::optimizer_from<torch::optim::Adam, torch::optim::AdamOptions>);
static_assert(!paratrain::optimizer_from<torch::optim::Adam, torch::optim::SGDOptions>);

static_assert(paratrain::loss_function<paratrain::CrossEntropy>);
static_assert(!paratrain::loss_function<int>);
// A loss of the output and the targets, or of the model's whole output and the batch.
using Pair = std::tuple<at::Tensor, at::Tensor>;
using BatchLoss = at::Tensor (*)(const Pair&, const paratrain::Batch&);
using TensorBatchLoss = at::Tensor (*)(const at::Tensor&, const paratrain::Batch&);
static_assert(paratrain::loss_for<paratrain::CrossEntropy, at::Tensor>);
static_assert(!paratrain::loss_for<paratrain::CrossEntropy, Pair>);  // a tuple has no `target` form
static_assert(paratrain::loss_for<BatchLoss, Pair>);
static_assert(!paratrain::loss_for<BatchLoss, at::Tensor>);
static_assert(paratrain::loss_for<TensorBatchLoss, at::Tensor>);
static_assert(paratrain::detail::reads_batch<TensorBatchLoss, at::Tensor>);
static_assert(!paratrain::detail::reads_batch<paratrain::CrossEntropy, at::Tensor>);
static_assert(paratrain::model_output<at::Tensor> && paratrain::model_output<Pair>);
static_assert(!paratrain::model_output<int> && !paratrain::model_output<std::tuple<at::Tensor, int>>);

static_assert(paratrain::strategy<paratrain::DataParallel<Plain, comm::SingleDevice, torch::optim::SGD>>);
static_assert(paratrain::strategy<paratrain::DataParallel<Plain, comm::Mpi, torch::optim::Adam>>);
static_assert(paratrain::strategy<paratrain::LocalDataParallel<Copyable, torch::optim::Adam>>);
static_assert(!paratrain::strategy<Plain>);
static_assert(!paratrain::strategy<comm::Mpi>);

// Models of several inputs; pipelines of stages, alone, 2-D and sharded, are strategies
// and checkpointable like the rest.
struct SplitImpl : torch::nn::Module {
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor a, torch::Tensor b) { return {a, b}; }
};
TORCH_MODULE(Split);
static_assert(paratrain::model<TwoInputs>);
static_assert(paratrain::detail::forward_arity<TwoInputs>() == 2);
static_assert(paratrain::model<Split>);  // two outputs, for a batch_loss
static_assert(std::same_as<paratrain::DataParallel<Split, comm::SingleDevice, torch::optim::SGD>::output_type, Pair>);
static_assert(paratrain::strategy<paratrain::DataParallel<Split, comm::SingleDevice, torch::optim::SGD>>);
static_assert(paratrain::strategy<paratrain::DataParallel<TwoInputs, comm::Mpi, torch::optim::SGD>>);
using TwoStages = paratrain::Pipeline<Split, TwoInputs>;
static_assert(paratrain::strategy<paratrain::DataParallel<TwoStages, comm::Mpi, torch::optim::Adam>>);
static_assert(paratrain::checkpointable<paratrain::DataParallel<TwoStages, comm::Mpi, torch::optim::Adam>>);
static_assert(std::same_as<paratrain::DataParallel<TwoStages, comm::Mpi, torch::optim::SGD>::output_type, at::Tensor>);
static_assert(std::same_as<paratrain::DataParallel<paratrain::Pipeline<TwoInputs, Split>, comm::Mpi, torch::optim::SGD>::output_type, Pair>);
static_assert(paratrain::strategy<
              paratrain::DataParallel<TwoStages, comm::Mpi, paratrain::Sharded<torch::optim::Adam, paratrain::zero::stage3>>>);

}  // namespace
