#pragma once
/// \file
/// paratrain::sampler — what a training or evaluation loop needs from a sampler.

#include <concepts>
#include <cstdint>
#include <ranges>

namespace paratrain {

/// A sampler says which dataset indices this rank visits in the current epoch.
///
/// `S` models sampler when, for `const S cs` and `S s`:
/// - `cs.indices()` is a range of values convertible to std::int64_t (the indices of
///   this rank for the current epoch),
/// - `cs.size()` is convertible to std::int64_t (how many of them there are),
/// - `s.set_epoch(std::int64_t)` chooses the epoch (a no-op for samplers that do not
///   depend on it).
///
/// The concept is structural: any type with these members is a sampler, the way
/// LibTorch users already write them, so there is no tag to opt in with.
/// data::DistributedSampler and data::ExactSampler model it.
template <class S>
concept sampler = requires(S& s, const S& cs, std::int64_t epoch) {
  { cs.indices() } -> std::ranges::input_range;
  requires std::convertible_to<std::ranges::range_value_t<decltype(cs.indices())>, std::int64_t>;
  { cs.size() } -> std::convertible_to<std::int64_t>;
  s.set_epoch(epoch);
};

}  // namespace paratrain
