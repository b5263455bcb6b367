#pragma once
/// \file
/// paratrain::checkpoint::load — loads a training checkpoint into any checkpointable
/// strategy at any world size: each rank reads the ranges it holds (resharding).

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "paratrain/checkpoint/detail/model_names.hpp"
#include "paratrain/checkpoint/detail/slices.hpp"
#include "paratrain/checkpoint/checkpointer.hpp"
#include "paratrain/checkpoint/format.hpp"
#include "paratrain/concepts/optimizer_state.hpp"
#include "paratrain/core/reduce_op.hpp"
#include "paratrain/concepts/strategy.hpp"
#include "paratrain/concepts/checkpointable.hpp"

namespace paratrain::checkpoint {

struct LoadOptions {
  /// Load the optimizer's state and options too; off, only the model (another optimizer,
  /// fine-tuning).
  bool optimizer = true;
  /// Restore the random generators' states: rank r takes saving rank r's (r modulo the
  /// saved world size where there are more ranks now).
  bool rng = true;
};

/// What a loaded checkpoint says besides the state it put into the strategy.
struct Loaded {
  fs::path path;
  std::int64_t step = 0;
  int world_size = 0;            ///< ranks that saved it
  Dict extra = make_dict();      ///< the saver's `extra`
  Dict rank_extra = make_dict(); ///< this rank's `rank_extra` when the world size is the same; else empty
};

namespace detail {

// Note [Loading in two phases]
// Everything a load puts into the strategy is first read into memory of its own and
// checked (names, shapes, checksums) on every rank; only when every rank has succeeded
// is it copied into the model and the optimizer. A load that fails anywhere leaves every
// rank's strategy as it was.
struct Staged {
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (destination, what goes there)
  std::vector<std::pair<OptimizerStateKey, std::unique_ptr<torch::optim::OptimizerParamState>>> states;
  std::vector<OptimizerStateKey> cleared;  // optimizer state keys of this rank's optimized slices
  std::vector<Dict> group_options;
  at::Tensor rng;
  std::optional<at::Generator> device;  // the GPU's generator, and its state to set
  at::Tensor device_rng;
};

/// `names`: the model's tensors over all ranks (model_names).
inline void check_model(const Contents& c, const CheckpointLayout& layout,
                        const std::map<std::string, ModelTensor>& names) {
  for (const auto& sl : layout.model) {
    const auto* record = c.find(model_key(sl.name));
    if (record == nullptr)
      throw file_error(c.path, "has no '" + sl.name + "', which this model has: it was saved from a different model", 0);
    if (record->shape != sl.shape)
      throw file_error(c.path, "'" + sl.name + "' is " + shape_string(record->shape) + " there and " +
                                   shape_string(sl.shape) + " in this model: it was saved from a different model",
                       0);
  }
  for (const auto& [key, record] : c.tensors)
    if (key.starts_with(model_prefix) && !names.count(key.substr(model_prefix.size())))
      throw file_error(c.path, "has '" + key.substr(model_prefix.size()) +
                                   "', which this model lacks: it was saved from a different model",
                       0);
}

template <class Optim>
void stage_optimizer(Optim& optimizer, const CheckpointLayout& layout, const Contents& c, ChunkReader& reader,
                     Staged& staged) {
  using Schema = schema_of<Optim>;
  if (c.optimizer != Schema::name)
    throw file_error(c.path, std::string("holds the state of optimizer ") + c.optimizer + ", and this strategy's is " +
                                 Schema::name + " (load with {.optimizer = false} to take the model alone)",
                     0);
  auto& groups = optimizer.param_groups();
  if (groups.size() != c.param_groups.size())
    throw file_error(c.path, "has " + std::to_string(c.param_groups.size()) + " parameter groups, this optimizer " +
                                 std::to_string(groups.size()),
                     0);
  const auto group = group_index(optimizer);
  for (const auto& sl : layout.optimized) {
    const auto saved = c.group_of.find(sl.name);
    const int now = group.at(sl.tensor.unsafeGetTensorImpl());
    if (saved == c.group_of.end()) throw file_error(c.path, "has no optimizer entry for parameter '" + sl.name + "'", 0);
    if (saved->second != now)
      throw file_error(c.path, "puts '" + sl.name + "' in parameter group " + std::to_string(saved->second) +
                                   ", this optimizer in group " + std::to_string(now),
                       0);
  }
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const auto options = c.param_groups.get(g);
    if (!options.isGenericDict()) throw file_error(c.path / index_name, "has malformed group options (corrupt)", 0);
    // Read now, on a copy, so that commit() cannot fail half-way.
    try {
      Schema::set_options(*groups[g].options().clone(), options.toGenericDict());
    } catch (const std::exception& e) {
      throw file_error(c.path / index_name,
                       "has malformed options for parameter group " + std::to_string(g) + ": " + e.what() + " (corrupt)", 0);
    }
    staged.group_options.push_back(options.toGenericDict());
  }
  for (const auto& sl : layout.optimized) {
    if (sl.tensor.numel() == 0) continue;
    staged.cleared.push_back(optimizer_state_key(sl.tensor));
    ParamStateTensors t;
    for (const char* field : Schema::fields) {
      const auto key = optim_key(sl.name, field);
      const auto* record = c.find(key);
      if (record == nullptr) continue;
      if (record->shape != sl.shape)
        throw file_error(c.path, "'" + key + "' is " + shape_string(record->shape) + ", its parameter " +
                                     shape_string(sl.shape),
                         0);
      const auto saved = read_slice(sl, sl.tensor.numel(), [&](std::int64_t b, std::int64_t n) {
        return reader.read(key, *record, b, n);
      });
      t.tensors.emplace(field, saved.to(sl.tensor.options().requires_grad(false)).view(sl.tensor.sizes()));
    }
    const auto step_key = optim_key(sl.name, "step");
    if (const auto* record = c.find(step_key)) t.step = reader.read(step_key, *record, 0, 1).item<std::int64_t>();
    if (!t.tensors.empty() || t.step) staged.states.emplace_back(optimizer_state_key(sl.tensor), Schema::make(t));
  }
}

template <class Optim>
void commit(Staged& staged, Optim& optimizer) {
  c10::NoGradGuard no_grad;
  for (auto& [to, from] : staged.copies) to.detach().copy_(from.view(to.sizes()));
  auto& groups = optimizer.param_groups();
  for (std::size_t g = 0; g < staged.group_options.size(); ++g)
    schema_of<Optim>::set_options(groups[g].options(), staged.group_options[g]);
  auto& state = optimizer.state();
  for (const auto& key : staged.cleared) state.erase(key);
  for (auto& [key, s] : staged.states) state[key] = std::move(s);
  if (staged.rng.defined()) {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(staged.rng);
  }
  if (staged.device_rng.defined()) {
    std::lock_guard<std::mutex> lock(staged.device->mutex());
    staged.device->set_state(staged.device_rng);
  }
}

}  // namespace detail

/// Loads the checkpoint directory `path` into `s`: the model's parameters and buffers,
/// the optimizer's state and options, the RNG states, whatever strategy and world size
/// saved it. Collective. A problem (a missing or corrupt file, a different model, an
/// incomplete checkpoint) throws paratrain::error on every rank, naming the file, and
/// leaves `s` as it was (Note [Loading in two phases]).
template <checkpointable S>
Loaded load(S& s, const fs::path& path, LoadOptions options = {}) {
  static_assert(known_optimizer<detail::optimizer_t<S>>,
                "paratrain: checkpoints know the state of torch::optim::SGD, Adam, AdamW, Adagrad and RMSprop (and "
                "optimizers derived from them); specialise paratrain::optimizer_schema for another");
  Loaded out;
  detail::Staged staged;
  std::string err;
  const auto layout = s.checkpoint_layout();
  const auto names = detail::model_names(s, layout);
  try {
    const auto c = read_contents(path);
    detail::check_model(c, layout, names);
    ChunkReader reader(c);
    for (const auto& sl : layout.model) {
      if (sl.tensor.numel() == 0) continue;
      const auto key = detail::model_key(sl.name);
      const auto* record = c.find(key);
      staged.copies.emplace_back(sl.tensor, detail::read_slice(sl, sl.tensor.numel(), [&](std::int64_t b, std::int64_t n) {
                                   return reader.read(key, *record, b, n);
                                 }));
    }
    if (options.optimizer) detail::stage_optimizer(s.optimizer(), layout, c, reader, staged);
    const auto rng = detail::rng_key(s.rank() % c.world_size);
    if (const auto* record = c.find(rng); options.rng && record != nullptr) {
      staged.rng = reader.read(rng, *record, 0, detail::numel_of(record->shape));
      try {  // now, on a generator of its own, so that commit() cannot fail half-way
        at::detail::createCPUGenerator().set_state(staged.rng);
      } catch (const std::exception& e) {
        throw detail::file_error(path, "holds a malformed '" + rng + "' (" + detail::message_of(e) + ")", 0);
      }
    }
    const auto cuda_rng = detail::cuda_rng_key(s.rank() % c.world_size);
    staged.device = detail::device_generator(s.device());
    if (const auto* record = c.find(cuda_rng); options.rng && record != nullptr && staged.device) {
      staged.device_rng = reader.read(cuda_rng, *record, 0, detail::numel_of(record->shape));
      // CUDA's generator takes only bytes, as many as its own state: checked now, so that
      // commit() cannot fail half-way.
      std::lock_guard<std::mutex> lock(staged.device->mutex());
      if (staged.device_rng.scalar_type() != at::kByte || staged.device_rng.numel() != staged.device->get_state().numel())
        throw detail::file_error(path, "holds a malformed '" + cuda_rng + "' (" +
                                           std::to_string(staged.device_rng.numel()) + " elements of " +
                                           c10::toString(staged.device_rng.scalar_type()) +
                                           "; this GPU's generator has " +
                                           std::to_string(staged.device->get_state().numel()) + " bytes)",
                                 0);
    }
    out = {path, c.step, c.world_size, c.extra,
           c.world_size == s.world_size() ? c.rank_extra[static_cast<std::size_t>(s.rank())] : make_dict()};
  } catch (const std::exception& e) {
    err = detail::message_of(e);
  }
  detail::agree(s, "checkpoint::load", err);
  detail::commit(staged, s.optimizer());
  s.loaded();
  // Deterministic mode keys random draws on the steps taken: Note [Deterministic training].
  if constexpr (step_counted_strategy<S>) s.set_step_count(out.step);
  return out;
}

/// The newest complete checkpoint in `directory` as rank 0 sees it, the same on every rank
/// even if one is published while they look; none when there is none. Collective.
template <strategy S>
std::optional<fs::path> agreed_latest(S& s, const fs::path& directory) {
  auto step = at::full({1}, -1, at::kLong);
  if (s.rank() == 0)
    if (const auto newest = latest(directory)) step[0] = *step_of(*newest);
  s.all_reduce(step, reduce_op::max);
  const auto chosen = step.item<std::int64_t>();
  if (chosen < 0) return std::nullopt;
  return path_of(directory, chosen);
}

/// Loads into `s` the newest complete checkpoint in `directory` (agreed_latest's), whatever
/// strategy and world size saved it: the one call an own loop makes to continue where the
/// job stopped after a restart, at any world size (docs/elastic.md). Returns what load()
/// returns (`step`: the optimizer steps the checkpoint was saved after), or none where there
/// is no checkpoint yet: a fresh start. Collective; a problem throws on every rank.
///
/// \code
///   const auto from = paratrain::checkpoint::resume(strategy, "ckpt");
///   for (std::int64_t step = from ? from->step : 0; step < steps; ++step) { ... }
/// \endcode
template <checkpointable S>
std::optional<Loaded> resume(S& s, const fs::path& directory, LoadOptions options = {}) {
  const auto path = agreed_latest(s, directory);
  if (!path) return std::nullopt;
  return load(s, *path, options);
}

}  // namespace paratrain::checkpoint
