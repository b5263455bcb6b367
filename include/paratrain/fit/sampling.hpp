#pragma once
/// \file
/// How fit deals out its samples: the sampler options it builds a sampler with, the check
/// of a sampler built by the caller, and which samplers resume part-way through an epoch.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "paratrain/concepts/sampler.hpp"
#include "paratrain/concepts/strategy.hpp"
#include "paratrain/data/sampler_options.hpp"
#include "paratrain/fit/options.hpp"

namespace paratrain::detail {

/// The options fit builds a sampler type with: the strategy's replicas, FitOptions' order.
template <strategy S>
data::SamplerOptions sampler_options(S& s, const FitOptions& o) {
  const auto shard = s.data_shard();
  return {.num_replicas = shard.count, .rank = shard.index, .shuffle = o.shuffle, .seed = o.seed.value_or(0),
          .drop_last = o.drop_last};
}

/// Why a sampler built by the caller does not fit this rank's replica or the training set,
/// as far as it says (options() with num_replicas and rank, dataset_size()); "" when it does.
template <strategy S, class D, class Sampler>
std::string sampler_mismatch(S& s, const D& train, const Sampler& order) {
  const auto shard = s.data_shard();
  if constexpr (requires { order.options().num_replicas; order.options().rank; }) {
    if (order.options().num_replicas != shard.count || order.options().rank != shard.index)
      return "the sampler was built for replica " + std::to_string(order.options().rank) + " of " +
             std::to_string(order.options().num_replicas) + ", but this rank trains replica " +
             std::to_string(shard.index) + " of " + std::to_string(shard.count) +
             "; build it with {.num_replicas = s.data_shard().count, .rank = s.data_shard().index}";
  }
  if constexpr (requires { order.dataset_size(); }) {
    if (static_cast<std::int64_t>(order.dataset_size()) != static_cast<std::int64_t>(train.size()))
      return "the sampler deals out indices of " + std::to_string(order.dataset_size()) +
             " samples, but the training set holds " + std::to_string(train.size());
  }
  return {};
}

/// A sampler whose epoch can begin part-way through its order (DistributedSampler,
/// WeightedSampler): a resumed run then starts where the whole job stopped, at any world
/// size. Other samplers resume by skipping what this replica visited, at the same number
/// of replicas (Note [Resuming mid-epoch]).
template <class T>
concept resumable_sampler = requires(T& t, std::int64_t n) { t.set_epoch(n, n); };

/// fit's view of any sampler: an epoch's indices, their count, and whether an epoch can
/// begin part-way (resumable_sampler). The loop is compiled once per strategy, data set and
/// loss, whatever sampler feeds it (the default, deterministic mode's, one of one's own).
class AnySampler {
 public:
  template <sampler T>
  explicit AnySampler(T t) : self_(std::make_unique<Model<T>>(std::move(t))) {}

  /// Epoch `epoch` from place `start` of its order; `start` must be 0 unless resumable().
  void set_epoch(std::int64_t epoch, std::int64_t start) { self_->set_epoch(epoch, start); }
  /// This replica's indices of the epoch, without the first `skip`.
  [[nodiscard]] std::vector<std::int64_t> indices(std::int64_t skip) const { return self_->indices(skip); }
  [[nodiscard]] std::int64_t size() const { return self_->size(); }
  [[nodiscard]] bool resumable() const { return self_->resumable(); }

 private:
  struct Concept {
    virtual ~Concept() = default;
    virtual void set_epoch(std::int64_t epoch, std::int64_t start) = 0;
    [[nodiscard]] virtual std::vector<std::int64_t> indices(std::int64_t skip) const = 0;
    [[nodiscard]] virtual std::int64_t size() const = 0;
    [[nodiscard]] virtual bool resumable() const = 0;
  };
  template <class T>
  struct Model final : Concept {
    explicit Model(T t) : t(std::move(t)) {}
    void set_epoch(std::int64_t epoch, std::int64_t start) override {
      if constexpr (resumable_sampler<T>) t.set_epoch(epoch, start);
      else t.set_epoch(epoch);
    }
    [[nodiscard]] std::vector<std::int64_t> indices(std::int64_t skip) const override {
      std::vector<std::int64_t> out;
      std::int64_t seen = 0;
      for (auto&& i : t.indices())  // whatever range type the sampler returns them in
        if (seen++ >= skip) out.push_back(static_cast<std::int64_t>(i));
      return out;
    }
    [[nodiscard]] std::int64_t size() const override { return static_cast<std::int64_t>(t.size()); }
    [[nodiscard]] bool resumable() const override { return resumable_sampler<T>; }
    T t;
  };
  std::unique_ptr<Concept> self_;
};

}  // namespace paratrain::detail
