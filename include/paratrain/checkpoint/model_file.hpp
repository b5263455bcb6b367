#pragma once
/// \file
/// paratrain::checkpoint::save_model / load_model — the whole model in one file that
/// Python's `torch.load` and LibTorch's `torch::pickle_load` read: a state dict.

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <ATen/core/Dict.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/serialize.h>

#include <filesystem>
#include <map>
#include <string>

#include "paratrain/checkpoint/detail/model_names.hpp"
#include "paratrain/checkpoint/detail/slices.hpp"
#include "paratrain/checkpoint/files.hpp"
#include "paratrain/checkpoint/format.hpp"
#include "paratrain/core/reduce_op.hpp"
#include "paratrain/concepts/checkpointable.hpp"
#include "paratrain/collectives/gather_strings.hpp"

namespace paratrain::checkpoint {

namespace detail {

// torch::pickle_save's format (what Python's torch.save writes), streamed to the file:
// pickle_save assembles the whole archive in memory first, ten times slower here.
inline void write_state_dict(const fs::path& path, const c10::Dict<std::string, at::Tensor>& dict) {
  const auto tmp = fs::path(path.string() + ".tmp");
  std::vector<char> pickle;
  torch::jit::Pickler pickler([&](const char* b, std::size_t n) { pickle.insert(pickle.end(), b, b + n); });
  pickler.protocol();
  pickler.pushIValue(dict);
  pickler.stop();
  try {
    caffe2::serialize::PyTorchStreamWriter writer(tmp.string());
    torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(), pickler.tensorData(), writer);
    writer.writeEndOfFile();
  } catch (const c10::Error& e) {
    throw file_error(tmp, std::string("write failed: ") + e.what_without_backtrace(), 0);
  }
  {
    File f(tmp, O_RDWR);
    f.finish(f.size());  // fsync
  }
  rename_file(tmp, path);
}

}  // namespace detail

/// Writes the whole model of `s` to `file` (rank 0 writes; atomically): a dict from
/// each parameter's and buffer's name (named_parameters() / named_buffers()) to the
/// tensor, on the CPU. In Python, `model.load_state_dict(torch.load(file))` on the same
/// architecture. Collective: sharded tensors (ZeRO-3) are assembled one at a time, so no
/// rank but rank 0 ever holds more than one whole tensor of them.
template <checkpointable S>
void save_model(S& s, const fs::path& file) {
  const auto layout = s.checkpoint_layout();
  c10::Dict<std::string, at::Tensor> dict;
  std::string err;
  // Each element is in one rank's slice (or a replicated tensor's writer's) and zero
  // elsewhere, so a sum assembles the whole exactly.
  const auto assemble = [&](const std::string& name, const std::vector<std::int64_t>& shape, at::TensorOptions options,
                            const TensorSlice* sl) {
    auto whole = at::zeros({detail::numel_of(shape)}, options.requires_grad(false));
    if (sl != nullptr && sl->tensor.numel() > 0 && sl->saved && (!sl->replicated || sl->writer == s.rank()))
      detail::place_in_whole(whole, *sl, sl->tensor);
    s.all_reduce(whole, reduce_op::sum);
    if (s.rank() == 0) dict.insert(name, whole.view(shape).to(at::kCPU));  // a buffer of its own: no copy on the CPU
  };
  if (layout.whole) {
    for (const auto& sl : layout.model) {
      if (!sl.replicated) assemble(sl.name, sl.shape, sl.tensor.options(), &sl);
      else if (s.rank() == 0)
        dict.insert(sl.name, sl.tensor.detach().to(at::kCPU, /*non_blocking=*/false, /*copy=*/true).contiguous());
    }
  } else {
    // Ranks hold different parts (a pipeline's stages): assemble each tensor of the union
    // from whoever holds it, with a zero buffer on this rank's device elsewhere.
    std::map<std::string, const TensorSlice*> held;
    for (const auto& sl : layout.model) held.emplace(sl.name, &sl);
    const auto device = layout.model.empty() ? at::Device(at::kCPU) : layout.model.front().tensor.device();
    for (const auto& [name, t] : detail::model_names(s, layout)) {
      const auto it = held.find(name);
      assemble(name, t.shape, at::TensorOptions().dtype(t.dtype).device(device), it != held.end() ? it->second : nullptr);
    }
  }
  if (s.rank() == 0) try {
      if (file.has_parent_path()) fs::create_directories(file.parent_path());
      detail::write_state_dict(file, dict);
      detail::sync_directory(file.has_parent_path() ? file.parent_path() : fs::path("."));
    } catch (const std::exception& e) {
      err = detail::message_of(e);
    }
  detail::agree(s, "checkpoint::save_model", err);
}

/// Loads a file of save_model (or Python's `torch.save(model.state_dict(), file)`) into
/// the model of `s`; each rank takes the slices it holds. Every name must match, with its
/// shape (load_state_dict's strict mode); the optimizer is untouched. Collective.
template <checkpointable S>
void load_model(S& s, const fs::path& file) {
  const auto layout = s.checkpoint_layout();
  const auto names = detail::model_names(s, layout);
  std::vector<std::pair<at::Tensor, at::Tensor>> copies;
  std::string err;
  try {
    const auto value = detail::read_dict(file, detail::read_file(file));
    for (const auto& sl : layout.model) {
      const auto it = value.find(sl.name);
      if (it == value.end() || !it->value().isTensor())
        throw detail::file_error(file, "has no tensor '" + sl.name + "', which this model has: a different model", 0);
      const auto t = it->value().toTensor();
      if (t.sizes().vec() != sl.shape)
        throw detail::file_error(file, "'" + sl.name + "' is " + detail::shape_string(t.sizes().vec()) + " there and " +
                                           detail::shape_string(sl.shape) + " in this model: a different model",
                                 0);
      if (sl.tensor.numel() > 0) copies.emplace_back(sl.tensor, detail::take_from_whole(t.reshape({-1}), sl, sl.tensor.numel()));
    }
    for (const auto& item : value)
      if (!names.count(item.key().toStringRef()))
        throw detail::file_error(file, "has '" + item.key().toStringRef() + "', which this model lacks: a different model", 0);
  } catch (const std::exception& e) {
    err = detail::message_of(e);
  }
  detail::agree(s, "checkpoint::load_model", err);
  c10::NoGradGuard no_grad;
  for (auto& [to, from] : copies) to.detach().copy_(from.view(to.sizes()));
  s.loaded();
}

}  // namespace paratrain::checkpoint
