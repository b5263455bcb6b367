#pragma once
/// \file
/// paratrain::checkpoint::Checkpointer — saves a strategy's training state, sharded,
/// atomically, in the background if asked; keeps the newest k.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/string_utils.h>
#include <torch/serialize.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "paratrain/checkpoint/detail/model_names.hpp"
#include "paratrain/checkpoint/files.hpp"
#include "paratrain/checkpoint/detail/slices.hpp"
#include "paratrain/checkpoint/format.hpp"
#include "paratrain/concepts/optimizer_state.hpp"
#include "paratrain/concepts/checkpointable.hpp"
#include "paratrain/util/torch_compat.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain::checkpoint {

/// Where and how a Checkpointer saves.
struct Options {
  fs::path directory;  ///< checkpoints go to directory/step-<9 digits>; created if missing
  int keep = 0;        ///< keep the newest `keep` complete checkpoints, remove older ones; 0: keep all
  /// Write in the background: save() copies this rank's state to memory and returns;
  /// training goes on while a thread writes, and the checkpoint appears at the first
  /// poll() (or wait()) after every rank's files are durable. Memory: one copy of this
  /// rank's share of the checkpoint, at most one save in flight.
  bool async = false;
};

/// The checkpoint of step `step` in `directory`.
inline fs::path path_of(const fs::path& directory, std::int64_t step) {
  return directory / detail::step_name(step);
}

/// The step of a checkpoint directory named as path_of names it; none for other names.
inline std::optional<std::int64_t> step_of(const fs::path& checkpoint) {
  const auto name = checkpoint.filename().string();
  const std::string_view prefix = detail::step_prefix;
  if (name.size() != prefix.size() + detail::step_digits || !name.starts_with(prefix) ||
      !std::all_of(name.begin() + static_cast<std::ptrdiff_t>(prefix.size()), name.end(),
                   [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  return static_cast<std::int64_t>(std::stoll(name.substr(prefix.size())));
}

/// The complete checkpoints in `directory` (those with an index), oldest first.
inline std::vector<fs::path> list(const fs::path& directory) {
  std::vector<std::pair<std::int64_t, fs::path>> found;
  std::error_code ec;
  if (!fs::is_directory(directory, ec)) return {};
  for (const auto& e : detail::entries(directory, ec))  // Note [No recursive std::filesystem]
    if (const auto step = step_of(e); step && fs::exists(e / detail::index_name, ec)) found.emplace_back(*step, e);
  std::sort(found.begin(), found.end());
  std::vector<fs::path> out;
  for (auto& [step, path] : found) out.push_back(std::move(path));
  return out;
}

/// The newest complete checkpoint in `directory`, if any.
inline std::optional<fs::path> latest(const fs::path& directory) {
  auto all = list(directory);
  if (all.empty()) return std::nullopt;
  return all.back();
}

namespace detail {

// Note [LibTorch versions]: the optimizer's state map changed its key type in 2.x.
using paratrain::detail::optimizer_state_key;
using paratrain::detail::OptimizerStateKey;
static_assert(std::is_same_v<std::remove_cvref_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type,
                             OptimizerStateKey>,
              "paratrain: this LibTorch keys torch::optim::Optimizer::state() by another type than "
              "util/torch_compat.hpp expects; update OptimizerStateKey there (Note [LibTorch versions])");

/// One chunk this rank writes: elements [begin, begin + data.numel()) of `key`.
struct Entry {
  std::string key;
  std::vector<std::int64_t> shape;
  std::int64_t begin = 0;
  at::Tensor data;  // flat, contiguous, on the CPU
};

template <class S>
using optimizer_t = std::remove_cvref_t<decltype(std::declval<S&>().optimizer())>;

/// What this rank writes of `s`'s state (Note [Checkpoint format]). Replicated slices are
/// shared out greedily by bytes, in the order every rank lists them alike. `copy`: a
/// snapshot that training may go on changing underneath. `held`: every slice this rank
/// holds, replicated or not, and without communicating (elastic::fit's survivors, whose
/// copies are sorted out afterwards: Note [A snapshot of the survivors]).
template <checkpointable S>
std::vector<Entry> collect(S& s, const CheckpointLayout& layout, bool copy, bool held = false) {
  using Schema = schema_of<optimizer_t<S>>;
  const int rank = s.rank();
  std::vector<std::int64_t> load(static_cast<std::size_t>(s.world_size()), 0);
  std::vector<Entry> mine;
  const auto add = [&](std::string key, bool replicated, int writer, const at::Tensor& t,
                       std::vector<std::int64_t> shape, std::int64_t begin) {
    if (!t.defined() || t.numel() == 0) return;
    if (replicated && !held) {
      const auto owner = writer >= 0 ? writer : std::min_element(load.begin(), load.end()) - load.begin();
      load[static_cast<std::size_t>(owner)] += t.numel() * static_cast<std::int64_t>(t.element_size());
      if (owner != rank) return;
    }
    // Flat, contiguous and (when `copy`) the writer's own memory, copied at most once:
    // reshape may return a strided view of t even when t is not contiguous.
    auto flat = t.detach().reshape({-1});
    if (!flat.is_cpu()) flat = flat.to(at::kCPU).contiguous();
    else if (!flat.is_contiguous()) flat = flat.contiguous();
    else if (copy && flat.is_alias_of(t)) flat = flat.clone();
    mine.push_back({std::move(key), std::move(shape), begin, std::move(flat)});
  };
  // A slice of a box (tensor parallelism) is written as its runs of the whole tensor.
  const auto add_slice = [&](std::string key, const TensorSlice& sl, const at::Tensor& t) {
    if (sl.box_shape.empty()) return add(std::move(key), sl.replicated, sl.writer, t, sl.shape, sl.begin);
    if (!t.defined() || t.numel() == 0) return;
    const auto flat = t.detach().reshape({-1});
    std::int64_t at = 0;
    for (const auto& r : sl.runs(flat.numel())) {
      add(key, sl.replicated, sl.writer, flat.narrow(0, at, r.numel), sl.shape, r.begin);
      at += r.numel;
    }
  };
  for (const auto& sl : layout.model)
    if (sl.saved || held) add_slice(detail::model_key(sl.name), sl, sl.tensor);
  auto& state = s.optimizer().state();
  for (const auto& sl : layout.optimized) {
    if (!sl.saved && !held) continue;  // another rank writes the same elements: Note [Hybrid sharding]
    const auto it = state.find(optimizer_state_key(sl.tensor));
    if (it == state.end()) continue;
    const auto t = Schema::get(static_cast<const typename Schema::state_type&>(*it->second));
    for (const auto& [field, tensor] : t.tensors)
      add_slice(detail::optim_key(sl.name, field), sl, tensor);
    if (t.step && detail::holds_first(sl))
      add(detail::optim_key(sl.name, "step"), sl.replicated, sl.writer, at::scalar_tensor(*t.step, at::kLong), {}, 0);
  }
  auto generator = at::detail::getDefaultCPUGenerator();
  at::Tensor rng;
  {
    std::lock_guard<std::mutex> lock(generator.mutex());
    rng = generator.get_state();
  }
  add(detail::rng_key(rank), false, -1, rng, {rng.numel()}, 0);
  if (auto device = detail::device_generator(s.device())) {
    at::Tensor cuda_rng;
    {
      std::lock_guard<std::mutex> lock(device->mutex());
      cuda_rng = device->get_state();
    }
    add(detail::cuda_rng_key(rank), false, -1, cuda_rng, {cuda_rng.numel()}, 0);
  }
  return mine;
}

/// Each optimized slice's parameter group, by parameter name.
template <class Optim>
Dict groups_of(Optim& optimizer, const CheckpointLayout& layout) {
  const auto group = group_index(optimizer);
  auto out = make_dict();
  for (const auto& sl : layout.optimized)
    if (auto it = group.find(sl.tensor.unsafeGetTensorImpl()); it != group.end())
      out.insert(sl.name, static_cast<std::int64_t>(it->second));
  return out;
}

struct Written {
  std::uint32_t meta_crc32c = 0;
  std::int64_t meta_bytes = 0;
  std::int64_t data_bytes = 0;
};

/// Writes this rank's data and chunk table into `dir`, each durable before it is named.
inline Written write_rank(const fs::path& dir, int rank, int world, std::int64_t step, const std::vector<Entry>& entries,
                          const Dict& groups, const Dict& extra) {
  c10::impl::GenericList chunks(c10::AnyType::get());
  std::int64_t offset = 0;
  const auto data_path = dir / rank_data_name(rank);
  {
    File f(fs::path(data_path.string() + ".tmp"), O_WRONLY | O_CREAT | O_TRUNC);
    for (const auto& e : entries) {
      const auto bytes = static_cast<std::size_t>(e.data.numel() * static_cast<std::int64_t>(e.data.element_size()));
      f.write_at(e.data.data_ptr(), bytes, offset);
      auto chunk = make_dict();
      chunk.insert("key", e.key);
      chunk.insert("dtype", dtype_name(e.data.scalar_type()));
      chunk.insert("shape", c10::List<std::int64_t>(e.shape));
      chunk.insert("begin", e.begin);
      chunk.insert("numel", e.data.numel());
      chunk.insert("offset", offset);
      chunk.insert("crc32c", static_cast<std::int64_t>(paratrain::detail::crc32c_extend(0, e.data.data_ptr(), bytes)));
      chunks.push_back(std::move(chunk));
      offset = (offset + static_cast<std::int64_t>(bytes) + alignment - 1) / alignment * alignment;
    }
    f.finish(offset);
  }
  rename_file(fs::path(data_path.string() + ".tmp"), data_path);
  auto meta = make_dict();
  meta.insert("rank", static_cast<std::int64_t>(rank));
  meta.insert("world_size", static_cast<std::int64_t>(world));
  meta.insert("step", step);
  meta.insert("chunks", chunks);
  meta.insert("groups", groups);
  meta.insert("extra", extra);
  const auto bytes = torch::pickle_save(meta);
  write_file_atomically(dir / rank_meta_name(rank), bytes);
  return {paratrain::detail::crc32c_extend(0, bytes.data(), bytes.size()), static_cast<std::int64_t>(bytes.size()), offset};
}

/// The last of a save, on rank 0 once every rank's files are durable: the index of the
/// `table.size(0)` rank files (a row each: the table's CRC-32C and bytes, the data's bytes),
/// written into `partial`, which is then published as `final_path`.
inline void write_index(const fs::path& partial, const fs::path& final_path, std::int64_t step, const at::Tensor& table,
                        const std::string& optimizer, const c10::impl::GenericList& group_options, const Dict& extra) {
  const auto world = table.size(0);
  auto ranks = c10::impl::GenericList(c10::AnyType::get());
  for (std::int64_t r = 0; r < world; ++r) {
    auto e = make_dict();
    e.insert("meta", rank_meta_name(static_cast<int>(r)));
    e.insert("meta_bytes", table[r][1].item<std::int64_t>());
    e.insert("meta_crc32c", table[r][0].item<std::int64_t>());
    e.insert("data", rank_data_name(static_cast<int>(r)));
    e.insert("data_bytes", table[r][2].item<std::int64_t>());
    ranks.push_back(std::move(e));
  }
  auto index = make_dict();
  index.insert("format", std::string(format_name));
  index.insert("version", format_version);
  index.insert("step", step);
  index.insert("world_size", world);
  index.insert("optimizer", optimizer);
  index.insert("param_groups", group_options);
  index.insert("ranks", ranks);
  index.insert("extra", extra);
  write_file_atomically(partial / index_name, torch::pickle_save(index));
  sync_directory(partial);
  publish_directory(partial, final_path);
  sync_directory(final_path.parent_path());
}

/// Each parameter group's options, as a checkpoint's index records them.
template <class Optim>
c10::impl::GenericList group_options(Optim& optimizer) {
  c10::impl::GenericList out(c10::AnyType::get());
  for (auto& g : optimizer.param_groups()) out.push_back(schema_of<Optim>::options(g.options()));
  return out;
}

}  // namespace detail

/// Saves the training state of strategy `s` (parameters, buffers, optimizer state and
/// options, RNG states, and what the caller adds) as sharded checkpoints: each rank
/// writes what it holds (Note [Checkpoint format]).
///
/// \code
///   paratrain::checkpoint::Checkpointer saver(strategy, {.directory = "ckpt", .keep = 3});
///   saver.save(step);                         // collective
///   auto c = paratrain::checkpoint::load(strategy, *paratrain::checkpoint::latest("ckpt"));
/// \endcode
template <checkpointable S>
class Checkpointer {
  static_assert(known_optimizer<detail::optimizer_t<S>>,
                "paratrain: checkpoints know the state of torch::optim::SGD, Adam, AdamW, Adagrad and RMSprop (and "
                "optimizers derived from them); specialise paratrain::optimizer_schema for another");

 public:
  Checkpointer(S& s, Options options) : s_(&s), options_(std::move(options)) {}
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;
  /// A save still in flight is finished on disk but not published (call wait() first).
  ~Checkpointer() {
    if (writer_.joinable()) writer_.join();
  }

  /// Saves the state as the checkpoint of `step`: `extra` (rank 0's) goes into the
  /// index, `rank_extra` into this rank's table. Collective. Waits for a save in flight
  /// first. Synchronous unless Options::async. A failure on any rank throws on every rank
  /// and leaves earlier checkpoints as they were.
  void save(std::int64_t step, Dict extra = make_dict(), Dict rank_extra = make_dict()) {
    wait();
    const int rank = s_->rank();
    const auto final_path = path_of(options_.directory, step);
    const auto partial = options_.directory / detail::partial_name(step);
    std::string err;
    if (rank == 0) try {
        detail::remove_tree(partial);  // Note [No recursive std::filesystem]
        fs::create_directories(partial);
      } catch (const std::exception& e) {
        err = "cannot create the checkpoint directory: " + detail::message_of(e);
      }
    detail::agree(*s_, "checkpoint::save", err);

    Job job{.step = step, .partial = partial, .final_path = final_path, .extra = std::move(extra)};
    try {
      const auto layout = s_->checkpoint_layout();
      job.entries = detail::collect(*s_, layout, options_.async);
      job.groups = detail::groups_of(s_->optimizer(), layout);
      job.options = detail::group_options(s_->optimizer());
      std::uint64_t bytes = 1 << 20;  // the chunk table, roughly
      for (const auto& e : job.entries) bytes += static_cast<std::uint64_t>(e.data.nbytes()) + alignment;
      if (const auto free = detail::free_bytes(partial); free < bytes)
        err = partial.string() + ": not enough space: this rank's part needs " + std::to_string(bytes >> 20) +
              " MiB, the file system has " + std::to_string(free >> 20) + " MiB free";
    } catch (const std::exception& e) {
      err = detail::message_of(e);
    }
    job.rank_extra = std::move(rank_extra);
    try {
      detail::agree(*s_, "checkpoint::save", err);
    } catch (...) {
      std::error_code ignored;  // the save's error is the one to report
      if (rank == 0) detail::remove_tree(partial, ignored);
      throw;
    }
    job_ = std::move(job);
    done_ = false;
    const auto write = [this, rank, world = s_->world_size()] {
      try {
        job_->written = detail::write_rank(job_->partial, rank, world, job_->step, job_->entries, job_->groups, job_->rank_extra);
      } catch (const std::exception& e) {
        job_->error = detail::message_of(e);
      }
      job_->entries.clear();  // the snapshot's memory goes as soon as it is on disk
      done_ = true;
    };
    if (options_.async) {
      writer_ = std::thread(write);
    } else {
      write();
      publish();
    }
  }

  /// Publishes a background save once every rank's files are durable. Collective while a
  /// save is in flight (one 8-byte all-reduce); returns whether none is in flight after it.
  bool poll() {
    if (!job_) return true;
    auto all_done = at::full({1}, done_ ? 1 : 0, at::kLong);
    s_->all_reduce(all_done, reduce_op::min);
    if (all_done.item<std::int64_t>() == 0) return false;
    publish();
    return true;
  }

  /// Finishes and publishes a save in flight. Collective.
  void wait() {
    if (!job_) return;
    if (writer_.joinable()) writer_.join();
    publish();
  }

  /// Whether a save has not been published yet.
  [[nodiscard]] bool pending() const noexcept { return job_.has_value(); }
  [[nodiscard]] const Options& options() const noexcept { return options_; }

 private:
  struct Job {
    std::int64_t step = 0;
    fs::path partial, final_path;
    Dict extra = make_dict(), rank_extra = make_dict(), groups = make_dict();
    c10::impl::GenericList options{c10::AnyType::get()};
    std::vector<detail::Entry> entries;
    detail::Written written;
    std::string error;
  };

  // Every rank's files are durable (or failed): rank 0 writes the index into the partial
  // directory and renames it into place, then removes what `keep` lets go.
  void publish() {
    if (writer_.joinable()) writer_.join();
    auto job = std::move(*job_);
    job_.reset();
    const int rank = s_->rank(), world = s_->world_size();
    // One all-reduce gives every rank's table sizes and checksums, and whether any failed.
    auto table = at::zeros({world, 4}, at::kLong);
    table[rank][0] = static_cast<std::int64_t>(job.written.meta_crc32c);
    table[rank][1] = job.written.meta_bytes;
    table[rank][2] = job.written.data_bytes;
    table[rank][3] = job.error.empty() ? 0 : 1;
    std::string err;
    const auto cleanup = [&] {
      if (rank == 0) {
        std::error_code ec;
        detail::remove_tree(job.partial, ec);
      }
    };
    s_->all_reduce(table, reduce_op::sum);
    if (table.select(1, 3).sum().item<std::int64_t>() != 0) {
      cleanup();
      detail::raise_everywhere(*s_, "checkpoint::save", job.error);
    }
    if (rank == 0) try {
        detail::write_index(job.partial, job.final_path, job.step, table,
                            std::string(schema_of<detail::optimizer_t<S>>::name), job.options, job.extra);
        prune();
      } catch (const std::exception& e) {
        err = detail::message_of(e);
        cleanup();
      }
    detail::agree(*s_, "checkpoint::save", err);
  }

  void prune() {
    if (options_.keep > 0) {
      auto all = list(options_.directory);
      for (std::size_t i = 0; i + static_cast<std::size_t>(options_.keep) < all.size(); ++i) detail::remove_tree(all[i]);
    }
    // What a writer killed mid-save left behind.
    for (const auto& e : detail::entries(options_.directory))
      if (detail::is_leftover(e.filename().string())) detail::remove_tree(e);
  }

  S* s_;
  Options options_;
  std::optional<Job> job_;
  std::atomic<bool> done_{false};
  std::thread writer_;
};

/// Saves `s` synchronously as the checkpoint of `step` in `directory`. Collective.
template <checkpointable S>
void save(S& s, const fs::path& directory, std::int64_t step, Dict extra = make_dict()) {
  Checkpointer<S>(s, {.directory = directory}).save(step, std::move(extra));
}

}  // namespace paratrain::checkpoint
