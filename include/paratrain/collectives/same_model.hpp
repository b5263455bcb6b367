#pragma once
/// \file
/// Whether every rank built the same model: the names, dtypes and shapes of its
/// parameters and buffers, compared at a strategy's construction (Note [Same model]).

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "paratrain/core/reduce_op.hpp"
#include "paratrain/util/fnv1a.hpp"
#include "paratrain/collectives/gather_strings.hpp"
#include "paratrain/core/error.hpp"

namespace paratrain::detail {

// Note [Same model]
// Replicas start from rank 0's values (broadcast_coalesced), which silently assumes that
// every rank holds the same tensors in the same order: with a layer of another width on one
// rank, the flat broadcast would fail with a size mismatch deep in MPI, or, where the total
// happens to agree, copy rank 0's numbers into tensors of other shapes. So each rank first
// describes its model, one line per parameter and buffer ("parameter fc.weight Float [10, 784]"),
// hashes the lines, and the ranks compare hashes with one 2-element MAX all-reduce (max of h
// and of -h: equal everywhere exactly when max h == min h). Only when they differ are the
// lines gathered, so that every rank throws the same error naming the first difference.

/// Where `model` lives: its first parameter's device, else its first buffer's, else the CPU.
inline at::Device device_of(const torch::nn::Module& model) {
  if (const auto p = model.parameters(); !p.empty()) return p.front().device();
  if (const auto b = model.buffers(); !b.empty()) return b.front().device();
  return at::kCPU;
}

/// One line per parameter and buffer: kind, name, dtype and shape.
inline std::vector<std::string> describe_model(const torch::nn::Module& model) {
  std::vector<std::string> lines;
  const auto add = [&](const char* kind, const std::string& name, const at::Tensor& t) {
    std::string line(kind);
    line.append(" ").append(name).append(" ").append(c10::toString(t.scalar_type())).append(" [");
    for (std::int64_t d = 0; d < t.dim(); ++d) line.append(d ? ", " : "").append(std::to_string(t.size(d)));
    lines.push_back(line.append("]"));
  };
  for (const auto& p : model.named_parameters()) add("parameter", p.key(), p.value());
  for (const auto& b : model.named_buffers()) add("buffer", b.key(), b.value());
  return lines;
}

/// FNV-1a over the lines, each ended by '\n'; 62 bits, so that its negation fits.
inline std::int64_t hash_lines(const std::vector<std::string>& lines) {
  Fnv1a h;
  for (const auto& line : lines) h.mix(line).mix('\n');
  return h.value62();
}

/// The first difference between two ranks' descriptions, as a sentence.
inline std::string first_different_entry(const std::vector<std::string>& a, int rank_a, const std::vector<std::string>& b,
                                    int rank_b) {
  const auto on = [](int r) { return "rank " + std::to_string(r) + "'s"; };
  const auto n = std::min(a.size(), b.size());
  for (std::size_t i = 0; i < n; ++i)
    if (a[i] != b[i])
      return "entry " + std::to_string(i) + " of " + on(rank_a) + " model is '" + a[i] + "' but of " + on(rank_b) +
             " '" + b[i] + "'";
  const bool a_longer = a.size() > b.size();
  return on(a_longer ? rank_a : rank_b) + " model has " + std::to_string(std::max(a.size(), b.size())) + " entries, " +
         on(a_longer ? rank_b : rank_a) + " " + std::to_string(n) + ": the first extra one is '" +
         (a_longer ? a : b)[n] + "'";
}

/// Collective over `group`: throws paratrain::error, the same on every rank, when the
/// ranks' models differ in a parameter's or buffer's name, dtype or shape, or in their
/// number. Note [Same model].
template <class Group>
void check_same_model(Group& group, const torch::nn::Module& model, const char* operation) {
  const auto lines = describe_model(model);
  const auto h = hash_lines(lines);
  auto both = at::tensor({h, -h}, at::kLong);
  group.all_reduce(both, reduce_op::max);
  if (both[0].item<std::int64_t>() == -both[1].item<std::int64_t>()) return;
  const auto all = all_gather_strings(group, lines);
  for (std::size_t r = 1; r < all.size(); ++r)
    if (all[r] != all[0])
      throw error(operation, group.rank(),
                  "the ranks built different models, and replicas must be the same model: " +
                      first_different_entry(all[0], 0, all[r], static_cast<int>(r)) +
                      " (build the model the same way on every rank; only its initial values may differ)");
  throw error(operation, group.rank(), "the ranks built different models (their descriptions hash differently)");
}

}  // namespace paratrain::detail
