#pragma once
/// \file
/// paratrain::data::from_torch — a LibTorch dataset (torch::data::datasets::Dataset) as a
/// paratrain::dataset, so that fit deals its samples across the ranks.

#include <ATen/ATen.h>
#include <torch/data/datasets/base.h>
#include <torch/data/example.h>

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "paratrain/core/batch.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain::data {

/// What from_torch takes: a LibTorch random-access dataset of (data, target) examples,
/// torch::data::datasets::Dataset<Self> (MNIST, your own), whose size is known.
template <class D>
concept torch_dataset = requires(D& d, std::size_t i) {
  { d.get(i) } -> std::same_as<torch::data::Example<>>;
  { d.size() } -> std::convertible_to<c10::optional<std::size_t>>;
};

/// A torch::data dataset read sample by sample: `get(indices)` stacks the examples' data
/// into the batch's input and their targets into its targets (a scalar label per sample
/// gives a 1-D targets tensor, as torch::data's Stack does). LibTorch's `get` is not const
/// and promises nothing about threads, so calls are serialised: the Loader's workers still
/// prepare the next batches while the model trains. Transforms (`.map(...)`) are
/// LibTorch's batch-level machinery: apply per-sample ones inside your dataset's `get`.
template <torch_dataset D>
class TorchDataset {
 public:
  explicit TorchDataset(D dataset) : state_(std::make_shared<State>(std::move(dataset))) {
    const auto n = state_->dataset.size();
    if (!n.has_value())
      throw error("data::from_torch", -1,
                  "the dataset's size() is unknown (nullopt): fit deals samples by index and needs it, as "
                  "DistributedSampler does");
    size_ = static_cast<std::int64_t>(*n);
  }

  [[nodiscard]] std::int64_t size() const noexcept { return size_; }

  [[nodiscard]] Batch get(const at::Tensor& indices) const {
    const auto idx = indices.to(at::kLong).contiguous();
    const auto* p = idx.data_ptr<std::int64_t>();
    std::vector<at::Tensor> data, targets;
    data.reserve(static_cast<std::size_t>(idx.numel()));
    targets.reserve(static_cast<std::size_t>(idx.numel()));
    {
      const std::scoped_lock lock(state_->mutex);
      for (std::int64_t k = 0; k < idx.numel(); ++k) {
        if (p[k] < 0 || p[k] >= size_)
          throw error("data::from_torch", -1,
                      "index " + std::to_string(p[k]) + " is outside the dataset's " + std::to_string(size_) + " samples");
        auto e = state_->dataset.get(static_cast<std::size_t>(p[k]));
        data.push_back(std::move(e.data));
        targets.push_back(std::move(e.target));
      }
    }
    if (data.empty() && size_ > 0) {  // no samples: of the samples' shape, none of them
      const std::scoped_lock lock(state_->mutex);
      auto e = state_->dataset.get(0);
      return Batch(e.data.unsqueeze(0).narrow(0, 0, 0), e.target.unsqueeze(0).narrow(0, 0, 0));
    }
    return Batch(at::stack(data), at::stack(targets));
  }

 private:
  struct State {
    explicit State(D d) : dataset(std::move(d)) {}
    D dataset;
    std::mutex mutex;
  };
  std::shared_ptr<State> state_;
  std::int64_t size_ = 0;
};

/// `dataset` (a torch::data::datasets::Dataset of Example<>) as a paratrain::dataset:
/// `paratrain::fit(strategy, paratrain::data::from_torch(MyDataset(...)), options)`.
template <torch_dataset D>
[[nodiscard]] TorchDataset<std::remove_cvref_t<D>> from_torch(D&& dataset) {
  return TorchDataset<std::remove_cvref_t<D>>(std::forward<D>(dataset));
}

}  // namespace paratrain::data
