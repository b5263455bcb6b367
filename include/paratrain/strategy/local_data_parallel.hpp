#pragma once
/// \file
/// paratrain::LocalDataParallel — one process, several replicas (PyTorch's nn.DataParallel).

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/cuda.h>
#include <torch/nn/module.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <string>
#include <exception>
#include <memory>
#include <span>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "paratrain/concepts/checkpointable.hpp"
#include "paratrain/concepts/module.hpp"
#include "paratrain/concepts/optimizer.hpp"
#include "paratrain/memory/allocator.hpp"
#include "paratrain/concepts/strategy.hpp"
#include "paratrain/core/backward_scale.hpp"
#include "paratrain/core/batch.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "paratrain/strategy/detail/state_slices.hpp"

namespace paratrain {

struct LocalDataParallelOptions {
  /// Replicas on CPU threads when there is no CUDA device; 0: default_cpu_replicas, or one
  /// per hardware thread where there are fewer (a replica per thread of a 128-thread node
  /// would clone the model 128 times, and the gradients' sum grows with them).
  /// Where LibTorch sees CUDA devices, replicas go one per device, at most this many
  /// (0: all of them).
  int replicas = 0;
  static constexpr int default_cpu_replicas = 4;
  /// Replicas on CPU threads even where LibTorch sees CUDA devices (a `--device cpu`).
  bool cpu = false;
};

/// Data parallelism inside one process: each step splits the batch across replicas of
/// the model, one per local device (a CUDA device, or a CPU thread where there is none),
/// runs forward and backward on all of them at once, sums their gradients into the
/// model and takes one optimizer step, then copies the parameters back to the replicas.
///
/// Gradients are weighted by each replica's share of the batch, so a step equals a
/// single-device step on the whole batch whatever the split (Note [Exact averaging]).
/// The model must be cloneable (derive NetImpl from torch::nn::Cloneable<NetImpl>).
///
/// Choose it for: one machine, one process, no launcher. Choose DataParallel for
/// several processes or machines: it overlaps communication and scales further.
template <class Model, class Optim = update_not_named>
class LocalDataParallel {
  static_assert(explain_model<Model>());
  static_assert(cloneable_module<Model>,
                "paratrain: LocalDataParallel copies the model into replicas with clone(); derive the module from "
                "torch::nn::Cloneable<NetImpl> (and build its submodules in reset()) instead of torch::nn::Module");
  static_assert(detail::zero_stage_of<Optim> == 0,
                "paratrain: LocalDataParallel keeps its replicas in one process and cannot shard them; for ZeRO use "
                "DataParallel<Net, comm::Mpi, Sharded<Optimizer, zero::stageN>> with one process per replica");
  static_assert(explain_optimizer<Optim>());

 public:
  using model_type = Model;
  /// What the model's forward returns: a tensor, or a tuple of them (a batch_loss reads it).
  using output_type = detail::model_output_t<Model>;
  using optimizer_type = Optim;
  using Options = LocalDataParallelOptions;

 private:
  static void check_batch(const Batch& b) {
    if (auto problem = detail::batch_problem(b); !problem.empty())
      throw error("LocalDataParallel", 0, problem + ": it cannot be split over the replicas");
  }

  using Impl = std::remove_cvref_t<decltype(*std::declval<Model&>())>;

 public:
  /// The model default-constructed: `Strategy s(torch::optim::AdamOptions(1e-3));`, the same
  /// line as under every other strategy alias.
  template <class OptimOptions>
    requires optimizer_from<Optim, OptimOptions> && std::default_initializable<Model>
  explicit LocalDataParallel(OptimOptions optimizer_options, Options options = {})
      : LocalDataParallel(Model(), std::move(optimizer_options), options) {}

  template <class OptimOptions>
    requires optimizer_from<Optim, OptimOptions>
  LocalDataParallel(Model model, OptimOptions optimizer_options, Options options = {}) : model_(std::move(model)) {
    memory::install();  // Note [Allocator]
    if (options.replicas < 0)
      throw error("LocalDataParallel", 0, "replicas must be >= 0 (0: one per GPU, or on CPUs the default of " +
                                              std::to_string(Options::default_cpu_replicas) + ")");
    const auto cuda = options.cpu ? 0 : static_cast<int>(torch::cuda::device_count());
    const int threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    const int n = replicas_for(options.replicas, cuda, threads);
    for (int i = 0; i < n; ++i) {
      const auto device = cuda > 0 ? torch::Device(torch::kCUDA, i) : torch::Device(torch::kCPU);
      if (i == 0) {
        model_->to(device);
        replicas_.push_back(std::dynamic_pointer_cast<Impl>(model_->shared_from_this()));
      } else {
        // Module is a virtual base of Cloneable<Impl>: a dynamic cast, once.
        replicas_.push_back(std::dynamic_pointer_cast<Impl>(model_->clone(device)));
      }
      devices_.push_back(device);
    }
    optimizer_ = std::make_unique<Optim>(model_->parameters(), std::move(optimizer_options));
  }

  /// One optimizer step over the micro-batches, each split over the replicas.
  template <loss_for<output_type> Loss>
  StepResult step(std::span<const Batch> micro_batches, Loss&& loss, bool has_next = true) {
    for (const auto& b : micro_batches) check_batch(b);  // all before any: no half-accumulated step
    double loss_sum = 0, samples = 0;
    for (const auto& b : micro_batches) {
      loss_sum += accumulate(b, loss) * static_cast<double>(b.size());
      samples += static_cast<double>(b.size());
    }
    auto r = update(has_next);
    r.loss = samples > 0 ? loss_sum / samples : 0.0;
    r.has_loss = samples > 0;
    return r;
  }

  template <loss_for<output_type> Loss>
  StepResult step(const Batch& batch, Loss&& loss, bool has_next = true) {
    return step(std::span<const Batch>(&batch, 1), loss, has_next);
  }

 private:
  StepResult update(bool has_next) {
    const double samples = std::exchange(pending_samples_, 0.0);
    accumulating_ = false;
    if (samples > 0) {
      c10::NoGradGuard no_grad;
      for (auto& p : model_->parameters())
        if (p.grad().defined()) p.mutable_grad().div_(samples);
      optimizer_->step();
      copy_to_replicas();
    }
    return {0, static_cast<std::int64_t>(samples), samples, has_next ? 1 : 0};
  }

 public:
  /// Forward and backward on every replica, gradients summed into the model; no update.
  template <loss_for<output_type> Loss>
  double accumulate(const Batch& batch, Loss&& loss) {
    check_batch(batch);
    if (!accumulating_) zero_model_grads();
    accumulating_ = true;
    const auto n = batch.size();
    if (n == 0) return 0.0;
    const auto used = static_cast<int>(std::min<std::int64_t>(n, static_cast<std::int64_t>(replicas_.size())));
    // Replica i's samples, on the CPU: each thread moves its own. tensor_split's cut.
    std::vector<Batch> parts(used);
    for (int i = 0; i < used; ++i) {
      const auto begin = i * (n / used) + std::min<std::int64_t>(i, n % used);
      parts[i] = batch.narrow(begin, n / used + (i < n % used ? 1 : 0));
    }
    std::vector<double> losses(used);
    std::vector<std::exception_ptr> errors(used);
    auto run = [&](int i) {
      try {
        auto& r = replicas_[i];
        r->train();
        if (i > 0)
          for (auto& p : r->parameters()) p.mutable_grad() = at::Tensor();
        const auto part = parts[i].to(devices_[i]);  // Note [One move per batch]
        const auto n_i = static_cast<double>(part.size());
        const BackwardScale backward_scale(n_i);  // a layer's loss added in backward, scaled alike
        at::Tensor l = detail::compute_loss<output_type>(loss, detail::forward(r, part.inputs), part);
        (l * n_i).backward();  // the sum over the replica's samples
        losses[i] = l.template item<double>() * n_i;
      } catch (...) {
        errors[i] = std::current_exception();
      }
    };
    copy_buffers_to_replicas();
    std::vector<std::thread> threads;
    for (int i = 1; i < used; ++i) threads.emplace_back(run, i);
    run(0);
    for (auto& t : threads) t.join();
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
    sum_replica_grads(used);
    pending_samples_ += static_cast<double>(n);
    double total = 0;
    for (double l : losses) total += l;
    return total / static_cast<double>(n);
  }

  /// One process has nobody to wait for: nothing to do.
  StepResult join(bool has_next = false) { return {0, 0, 0, has_next ? 1 : 0, 0, /*has_loss=*/false}; }

  output_type predict(const Batch& batch) { return detail::predict(model_, detail::to_device(batch.inputs, devices_[0])); }
  output_type predict(const at::Tensor& input) { return predict(Batch{input, at::Tensor()}); }

  /// A world of one process: nothing to reduce.
  void all_reduce(at::Tensor&, reduce_op) const noexcept {}
  /// The model evaluates alone (replica 0 is the model): nothing to synchronize.
  void synchronize() const noexcept {}

  /// The replicas LocalDataParallel makes when asked for `asked` (0: the default) with
  /// `cuda_devices` GPUs and `hardware_threads` threads: one per GPU, at most `asked`; on CPUs
  /// `asked`, or default_cpu_replicas where the machine has that many threads.
  [[nodiscard]] static int replicas_for(int asked, int cuda_devices, int hardware_threads) noexcept {
    if (cuda_devices > 0) return asked > 0 ? std::min(asked, cuda_devices) : cuda_devices;
    return asked > 0 ? asked : std::min(std::max(hardware_threads, 1), Options::default_cpu_replicas);
  }
  /// How many replicas each step runs (one per device: GPU, or CPU thread).
  [[nodiscard]] int replica_count() const noexcept { return static_cast<int>(replicas_.size()); }
  /// The model (replica 0) holds the state (paratrain::checkpointable).
  [[nodiscard]] CheckpointLayout checkpoint_layout() { return detail::whole_model_layout(*model_); }
  /// After a checkpoint was loaded into the model: the other replicas copy it.
  void loaded() {
    copy_to_replicas();
    copy_buffers_to_replicas();
  }

  [[nodiscard]] int rank() const noexcept { return 0; }
  [[nodiscard]] int world_size() const noexcept { return 1; }
  [[nodiscard]] DataShard data_shard() const noexcept { return {}; }
  /// Where the model (replica 0) is; each replica's slice of a batch moves to its own device.
  [[nodiscard]] at::Device device() const noexcept { return devices_.front(); }
  [[nodiscard]] int replicas() const noexcept { return static_cast<int>(replicas_.size()); }
  [[nodiscard]] Model& model() noexcept { return model_; }
  [[nodiscard]] Optim& optimizer() noexcept { return *optimizer_; }

 private:
  void zero_model_grads() {
    for (auto& p : model_->parameters()) p.mutable_grad() = at::Tensor();
  }

  void sum_replica_grads(int used) {
    c10::NoGradGuard no_grad;
    auto master = model_->parameters();
    for (int i = 1; i < used; ++i) {
      auto params = replicas_[i]->parameters();
      for (std::size_t k = 0; k < master.size(); ++k) {
        const auto& g = params[k].grad();
        if (!g.defined()) continue;
        auto& m = master[k].mutable_grad();
        if (m.defined()) m.add_(g.to(m.device()));
        else m = g.to(master[k].device(), /*non_blocking=*/false, /*copy=*/true);
      }
    }
  }

  void copy_to_replicas() {
    c10::NoGradGuard no_grad;
    const auto master = model_->parameters();
    for (std::size_t i = 1; i < replicas_.size(); ++i) {
      auto params = replicas_[i]->parameters();
      for (std::size_t k = 0; k < master.size(); ++k) params[k].copy_(master[k]);
    }
  }

  // Like nn.DataParallel, which re-replicates buffers from device 0 on every forward.
  void copy_buffers_to_replicas() {
    c10::NoGradGuard no_grad;
    const auto master = model_->buffers();
    for (std::size_t i = 1; i < replicas_.size(); ++i) {
      auto buffers = replicas_[i]->buffers();
      for (std::size_t k = 0; k < master.size(); ++k) buffers[k].copy_(master[k]);
    }
  }

  Model model_;
  std::vector<std::shared_ptr<Impl>> replicas_;  // [0] is model_ itself
  std::vector<torch::Device> devices_;
  std::unique_ptr<Optim> optimizer_;
  bool accumulating_ = false;
  double pending_samples_ = 0;
};

/// LocalDataParallel without its optimizer: a compile-time error that names the choice.
template <class Model>
class LocalDataParallel<Model, update_not_named> {
  static_assert(sizeof(Model) == 0,
                "paratrain: name the optimizer as LocalDataParallel's second argument (LocalDataParallel<Net, "
                "torch::optim::Adam>, torch::optim::SGD, ...); LocalDataParallel<Net> no longer means SGD");
};

}  // namespace paratrain
