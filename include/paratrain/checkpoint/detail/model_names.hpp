#pragma once
/// \file
/// The collective pieces of checkpointing: errors every rank reports (collectives/agree.hpp),
/// and the model's names over the ranks.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "paratrain/concepts/checkpointable.hpp"
#include "paratrain/collectives/agree.hpp"
#include "paratrain/core/message.hpp"
#include "paratrain/collectives/gather_strings.hpp"

namespace paratrain::checkpoint::detail {

using paratrain::detail::agree;
using paratrain::detail::message_of;
using paratrain::detail::raise_everywhere;

/// A tensor of the model as every rank can know it: dtype and whole shape.
struct ModelTensor {
  at::ScalarType dtype = at::kFloat;
  std::vector<std::int64_t> shape;
};

/// The model's tensors over all ranks, by name: this rank's when the layout is whole, else
/// the union of every rank's (collective then, over `group`).
template <class Group>
std::map<std::string, ModelTensor> model_names(Group& group, const CheckpointLayout& layout) {
  std::map<std::string, ModelTensor> all;
  for (const auto& sl : layout.model) all[sl.name] = {sl.tensor.scalar_type(), sl.shape};
  if (layout.whole) return all;
  // Each as "dtype rank dims... name": the name last, whatever characters it holds.
  std::vector<std::string> mine;
  for (const auto& [name, t] : all) {
    std::string d = std::to_string(static_cast<int>(t.dtype)) + ' ' + std::to_string(t.shape.size());
    for (const auto n : t.shape) d.append(" ").append(std::to_string(n));
    mine.push_back(d.append(" ").append(name));
  }
  for (const auto& of_rank : paratrain::detail::all_gather_strings(group, mine))
    for (const auto& d : of_rank) {
      std::istringstream in(d);
      int dtype = 0;
      std::size_t dims = 0;
      in >> dtype >> dims;
      ModelTensor t{static_cast<at::ScalarType>(dtype), std::vector<std::int64_t>(dims)};
      for (auto& n : t.shape) in >> n;
      in.get();  // the space before the name
      std::string name;
      std::getline(in, name);
      all.emplace(std::move(name), std::move(t));
    }
  return all;
}

}  // namespace paratrain::checkpoint::detail
