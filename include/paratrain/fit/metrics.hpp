#pragma once
/// \file
/// paratrain::Metrics — running means that are reduced across ranks safely.

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "paratrain/core/reduce_op.hpp"
#include "paratrain/collectives/gather_strings.hpp"

namespace paratrain {

// Note [Safe metric reduction]
// Lightning's `self.log(..., sync_dist=True)` reduces inside the log call, so a rank
// that logs a name the others do not (a branch on its data, say) hangs the job. Here
// `log` never communicates: it only accumulates locally. The reduction is `sync`,
// which fit() calls at points every rank reaches together, and which first agrees on
// the union of names across ranks, so ranks may log different names, or none.

/// Weighted running means of named values, local until `sync`.
///
/// \code
///   metrics.log("loss", batch_loss, batch_size);   // local, free
///   auto global = metrics.sync(strategy);          // collective: every rank calls it
///   double mean_loss = global.at("loss");
/// \endcode
class Metrics {
 public:
  /// Adds `value` with weight `weight` (e.g. a batch's mean loss and its sample count).
  void log(const std::string& name, double value, double weight = 1.0) { add_sums(name, value * weight, weight); }

  /// This rank's running sums, name -> (sum of value * weight, sum of weight): what a
  /// checkpoint keeps to resume mid-epoch.
  [[nodiscard]] const std::map<std::string, std::pair<double, double>>& sums() const noexcept { return values_; }
  /// Adds sums as sums() gave them.
  void add_sums(const std::string& name, double sum, double weight) {
    auto& [s, w] = values_[name];
    s += sum;
    w += weight;
  }

  /// This rank's means so far.
  [[nodiscard]] std::map<std::string, double> local() const {
    std::map<std::string, double> out;
    for (const auto& [name, v] : values_) out[name] = v.second > 0 ? v.first / v.second : 0.0;
    return out;
  }

  /// The weighted means over all ranks of every name any rank logged, then starts
  /// afresh. Collective over the strategy's (or communicator's) ranks.
  template <class Group>
  std::map<std::string, double> sync(Group& group) {
    const auto names = union_of_names(group);
    auto sums = at::zeros({2 * static_cast<std::int64_t>(names.size())}, at::kDouble);
    auto* s = sums.data_ptr<double>();
    for (std::size_t i = 0; i < names.size(); ++i)
      if (auto it = values_.find(names[i]); it != values_.end()) s[2 * i] = it->second.first, s[2 * i + 1] = it->second.second;
    if (!names.empty()) group.all_reduce(sums, reduce_op::sum);
    std::map<std::string, double> out;
    for (std::size_t i = 0; i < names.size(); ++i) out[names[i]] = s[2 * i + 1] > 0 ? s[2 * i] / s[2 * i + 1] : 0.0;
    values_.clear();
    return out;
  }

 private:
  // The names every rank logged, sorted.
  template <class Group>
  std::vector<std::string> union_of_names(Group& group) {
    std::vector<std::string> mine;
    for (const auto& [name, v] : values_) mine.push_back(name);
    std::vector<std::string> names;
    for (auto& of_rank : detail::all_gather_strings(group, mine)) names.insert(names.end(), of_rank.begin(), of_rank.end());
    std::sort(names.begin(), names.end());
    names.erase(std::unique(names.begin(), names.end()), names.end());
    return names;
  }

  std::map<std::string, std::pair<double, double>> values_;
};

}  // namespace paratrain
