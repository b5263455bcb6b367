#pragma once
/// \file
/// paratrain::tp::Dropout — dropout whose mask is a function of each element's place in the
/// whole tensor, so that a tensor cut over ranks drops what the uncut one drops (Note [Keyed dropout]).

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "paratrain/core/error.hpp"

namespace paratrain::tensor_parallel {

// Note [Keyed dropout]
// ~~~~~~~~~~~~~~~~~~~~
// Megatron keeps two generator states per rank (its RNG tracker): one the same on every rank
// of the tensor group, for dropouts on replicated activations, one different per rank, for
// dropouts on split ones (attention heads, sequence shards). The masks then match each other
// as they must, but not a single-device run's: rank 1's heads draw other numbers than the same
// heads on one device. Here the mask of an element is a hash of (the layer's key, its call
// count, the element's index in the whole tensor): a replicated activation draws the same mask
// on every rank (the same indices), a split one draws on each rank the part of the whole mask
// its slice holds (its indices), and the single-device model, whose tensors are whole, draws
// the whole mask. So the one promise holds with dropout on, at any degree and with or without
// sequence parallelism. The key is one number drawn from LibTorch's generator when the layer is
// built (every rank seeds alike), the count advances with each training forward. The hash is
// a 32-bit integer mix (Wellons' lowbias32 shape) over int64 tensors, products kept under 2^63;
// 24 bits of it are the uniform draw. Its cost is a few integer operations per element.
// Known limit: a layer recomputed (Recompute<Layer>) advances the count again: the recomputed
// mask differs; keyed dropout and recomputation do not combine yet.

/// Where a tensor sits in the whole one: along `dim`, from `offset`, of `whole` elements.
struct Placement {
  std::int64_t dim = 0;
  std::int64_t offset = 0;
  std::int64_t whole = 0;  ///< 0: the tensor is whole
};

namespace detail {
inline std::uint32_t mix32(std::uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}
// The same mix on an int64 tensor of values < 2^32 (products under 2^63: the constants are
// cut to 31 bits, which keeps the mix's avalanche good enough for masks).
inline at::Tensor mix32(at::Tensor x) {
  constexpr std::int64_t m = 0xffffffff;
  x = x.bitwise_xor(x.bitwise_right_shift(16));
  x = (x * std::int64_t{0x7feb352d}).bitwise_and(m);
  x = x.bitwise_xor(x.bitwise_right_shift(15));
  x = (x * std::int64_t{0x46ca68b}).bitwise_and(m);
  return x.bitwise_xor(x.bitwise_right_shift(16));
}
}  // namespace detail

/// The keep-mask (1 kept, 0 dropped) of drop probability `p` for a tensor of `sizes` placed
/// in the whole as `where` says (Note [Keyed dropout]): a function of (key, call, index).
[[nodiscard]] inline at::Tensor keyed_keep_mask(at::IntArrayRef sizes, const Placement& where, std::uint64_t key,
                                                std::uint64_t call, double p, const at::Device& device) {
  std::vector<std::int64_t> whole(sizes.begin(), sizes.end());
  if (where.whole > 0) whole[static_cast<std::size_t>(where.dim)] = where.whole;
  const auto opts = at::TensorOptions().dtype(at::kLong).device(device);
  auto index = at::zeros({}, opts);
  std::int64_t stride = 1;
  for (auto d = static_cast<std::int64_t>(sizes.size()); d-- > 0;) {
    const auto off = (where.whole > 0 && d == where.dim) ? where.offset : 0;
    std::vector<std::int64_t> shape(sizes.size(), 1);
    shape[static_cast<std::size_t>(d)] = sizes[static_cast<std::size_t>(d)];
    index = index + (at::arange(off, off + sizes[static_cast<std::size_t>(d)], opts) * stride).view(shape);
    stride *= whole[static_cast<std::size_t>(d)];
  }
  const auto seed = static_cast<std::int64_t>(
      detail::mix32(static_cast<std::uint32_t>(key) ^ detail::mix32(static_cast<std::uint32_t>(key >> 32) ^
                                                                     detail::mix32(static_cast<std::uint32_t>(call)))));
  auto x = detail::mix32(index.bitwise_and(std::int64_t{0xffffffff}).bitwise_xor(seed));
  x = detail::mix32(x.bitwise_xor(index.bitwise_right_shift(32)));
  const auto threshold = static_cast<std::int64_t>(p * double(1 << 24));
  return x.bitwise_right_shift(8).ge(threshold);
}

/// Dropout with a keyed mask (Note [Keyed dropout]): as torch::nn::Dropout(p) in what it
/// does (zeroes elements with probability p, scales the rest by 1/(1-p), only in training),
/// but the mask depends on the elements' places in the whole tensor, not on the generator.
class DropoutImpl : public torch::nn::Module {
 public:
  explicit DropoutImpl(double p = 0.5) : p_(p), key_(static_cast<std::uint64_t>(at::randint(
                                                        std::int64_t{1} << 62, {1}, at::kLong).item<std::int64_t>())) {
    if (p < 0 || p >= 1)
      throw error("tp::Dropout", -1, "its probability is " + std::to_string(p) + "; give one in [0, 1)");
  }
  /// `x` with dropout applied; `where` places it in the whole tensor (default: whole).
  at::Tensor forward(const at::Tensor& x, const Placement& where = {}) {
    if (!is_training() || p_ == 0) return x;
    const auto keep = keyed_keep_mask(x.sizes(), where, key_, calls_++, p_, x.device());
    return x * keep.to(x.scalar_type()) * (1.0 / (1.0 - p_));
  }
  [[nodiscard]] double p() const noexcept { return p_; }
  /// Training forwards so far: the count that keys the next mask.
  [[nodiscard]] std::uint64_t calls() const noexcept { return calls_; }

 private:
  double p_;
  std::uint64_t key_;
  std::uint64_t calls_ = 0;
};
TORCH_MODULE(Dropout);

}  // namespace paratrain::tensor_parallel
