#pragma once
/// \file
/// paratrain::tp::Dropout — dropout whose mask is a function of each element's place in the
/// whole tensor, so that a tensor cut over ranks drops what the uncut one drops (Note [Keyed dropout]).

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <algorithm>
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
// a 32-bit integer mix (Wellons' lowbias32 shape); 24 bits of it are the uniform draw. On the
// CPU one loop writes the mask, already scaled by 1/(1-p), straight into the tensor autograd
// keeps: nothing else of the mask's size is ever allocated, so a dropout's memory is its mask's
// (Note [Tensor-parallel memory]). On other devices the same hash runs as tensor operations
// over int64 tensors (products kept under 2^63), whose transients are several times the mask
// for a moment; both ways give the same bits (ctest compares them).
// Known limit: a layer recomputed (Recompute<Layer>) advances the count again: the recomputed
// mask differs; keyed dropout and recomputation do not combine yet.

/// Where a tensor sits in the whole one: along `dim`, from `offset`, of `whole` elements.
struct Placement {
  std::int64_t dim = 0;
  std::int64_t offset = 0;
  std::int64_t whole = 0;  ///< 0: the tensor is whole
};

namespace detail {
// Wellons' lowbias32 mix; its second constant is a parameter (see mask_mix32).
inline std::uint32_t mix32(std::uint32_t x, std::uint32_t second = 0x846ca68bU) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= second;
  x ^= x >> 16;
  return x;
}
// The mix of the masks: the second constant cut to 31 bits (0x046ca68b), so that the tensor
// form below, over int64 values < 2^32, keeps its products under 2^63.
inline std::uint32_t mask_mix32(std::uint32_t x) { return mix32(x, 0x046ca68bU); }
inline at::Tensor mask_mix32(at::Tensor x) {
  constexpr std::int64_t m = 0xffffffff;
  x = x.bitwise_xor(x.bitwise_right_shift(16));
  x = (x * std::int64_t{0x7feb352d}).bitwise_and(m);
  x = x.bitwise_xor(x.bitwise_right_shift(15));
  x = (x * std::int64_t{0x46ca68b}).bitwise_and(m);
  return x.bitwise_xor(x.bitwise_right_shift(16));
}
inline std::uint32_t mask_seed(std::uint64_t key, std::uint64_t call) {
  return mix32(static_cast<std::uint32_t>(key) ^
               mix32(static_cast<std::uint32_t>(key >> 32) ^ mix32(static_cast<std::uint32_t>(call))));
}
inline std::int64_t mask_threshold(double p) { return static_cast<std::int64_t>(p * double(1 << 24)); }
// Whether the element of flat index `index` in the whole tensor is kept.
inline bool kept(std::uint64_t index, std::uint32_t seed, std::int64_t threshold) {
  auto x = mask_mix32(static_cast<std::uint32_t>(index) ^ seed);
  x = mask_mix32(x ^ static_cast<std::uint32_t>(index >> 32));
  return static_cast<std::int64_t>(x >> 8) >= threshold;
}
// The sizes of the whole tensor a part of `sizes` placed as `where` belongs to.
inline std::vector<std::int64_t> whole_sizes(at::IntArrayRef sizes, const Placement& where) {
  std::vector<std::int64_t> whole(sizes.begin(), sizes.end());
  if (where.whole > 0) whole[static_cast<std::size_t>(where.dim)] = where.whole;
  return whole;
}
// The mask as tensor operations (any device): int64 indices of the whole tensor, hashed.
inline at::Tensor keep_mask_by_tensors(at::IntArrayRef sizes, const Placement& where, std::uint32_t seed,
                                       std::int64_t threshold, const at::Device& device) {
  const auto whole = whole_sizes(sizes, where);
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
  auto x = mask_mix32(index.bitwise_and(std::int64_t{0xffffffff}).bitwise_xor(std::int64_t{seed}));
  x = mask_mix32(x.bitwise_xor(index.bitwise_right_shift(32)));
  return x.bitwise_right_shift(8).ge(threshold);
}
// The mask on the CPU, one loop: `keep` (contiguous, of `sizes`) gets `scale` where an
// element is kept and 0 where it drops.
template <class T>
void fill_keep_mask(at::Tensor& keep, const Placement& where, std::uint32_t seed, std::int64_t threshold, T scale) {
  const auto sizes = keep.sizes();
  const auto whole = whole_sizes(sizes, where);
  const auto n = static_cast<std::int64_t>(sizes.size());
  if (keep.numel() == 0) return;
  T* out = keep.data_ptr<T>();
  const std::int64_t inner = n == 0 ? 1 : sizes[n - 1];
  const std::int64_t rows = keep.numel() / inner;
  // Row r's first element: its multi-index over the outer dimensions, placed in the whole.
  std::vector<std::int64_t> at_index(static_cast<std::size_t>(std::max<std::int64_t>(n - 1, 0)), 0);
  const auto offset_of = [&](std::int64_t d) { return (where.whole > 0 && d == where.dim) ? where.offset : 0; };
  for (std::int64_t r = 0; r < rows; ++r) {
    std::uint64_t base = 0;
    for (std::int64_t d = 0; d + 1 < n; ++d)
      base = base * static_cast<std::uint64_t>(whole[static_cast<std::size_t>(d)]) +
             static_cast<std::uint64_t>(at_index[static_cast<std::size_t>(d)] + offset_of(d));
    if (n > 0) base = base * static_cast<std::uint64_t>(whole[static_cast<std::size_t>(n - 1)]) +
                      static_cast<std::uint64_t>(offset_of(n - 1));
    for (std::int64_t i = 0; i < inner; ++i)
      out[r * inner + i] = kept(base + static_cast<std::uint64_t>(i), seed, threshold) ? scale : T(0);
    for (std::int64_t d = n - 2; d >= 0; --d) {  // the next row's outer multi-index
      if (++at_index[static_cast<std::size_t>(d)] < sizes[d]) break;
      at_index[static_cast<std::size_t>(d)] = 0;
    }
  }
}
}  // namespace detail

/// The keep-mask (1 kept, 0 dropped) of drop probability `p` for a tensor of `sizes` placed
/// in the whole as `where` says (Note [Keyed dropout]): a function of (key, call, index).
[[nodiscard]] inline at::Tensor keyed_keep_mask(at::IntArrayRef sizes, const Placement& where, std::uint64_t key,
                                                std::uint64_t call, double p, const at::Device& device) {
  const auto seed = detail::mask_seed(key, call);
  const auto threshold = detail::mask_threshold(p);
  if (!device.is_cpu()) return detail::keep_mask_by_tensors(sizes, where, seed, threshold, device);
  auto keep = at::empty(sizes, at::TensorOptions().dtype(at::kBool));
  detail::fill_keep_mask<bool>(keep, where, seed, threshold, true);
  return keep;
}

/// The same mask made by tensor operations on `device` (what other devices than the CPU use).
[[nodiscard]] inline at::Tensor keyed_keep_mask_by_tensors(at::IntArrayRef sizes, const Placement& where,
                                                           std::uint64_t key, std::uint64_t call, double p,
                                                           const at::Device& device) {
  return detail::keep_mask_by_tensors(sizes, where, detail::mask_seed(key, call), detail::mask_threshold(p), device);
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
    const auto call = calls_++;
    const double scale = 1.0 / (1.0 - p_);
    // Float and double on the CPU: the mask holds 1/(1-p) where kept, written by one loop,
    // and is all autograd keeps (x * mask rounds as x * 1 * scale did). Elsewhere, and for
    // 16-bit types (whose product with a float scale rounds otherwise), 0/1 then the scale.
    if (x.device().is_cpu() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble)) {
      auto keep = at::empty(x.sizes(), x.options().requires_grad(false));
      const auto seed = detail::mask_seed(key_, call);
      const auto threshold = detail::mask_threshold(p_);
      if (x.scalar_type() == at::kFloat)
        detail::fill_keep_mask<float>(keep, where, seed, threshold, static_cast<float>(scale));
      else
        detail::fill_keep_mask<double>(keep, where, seed, threshold, scale);
      return x * keep;
    }
    const auto keep = keyed_keep_mask(x.sizes(), where, key_, call, p_, x.device());
    return x * keep.to(x.scalar_type()) * scale;
  }
  [[nodiscard]] double p() const noexcept { return p_; }
  /// The key its masks are drawn with (Note [Keyed dropout]).
  [[nodiscard]] std::uint64_t key() const noexcept { return key_; }
  /// Training forwards so far: the count that keys the next mask.
  [[nodiscard]] std::uint64_t calls() const noexcept { return calls_; }

 private:
  double p_;
  std::uint64_t key_;
  std::uint64_t calls_ = 0;
};
TORCH_MODULE(Dropout);

}  // namespace paratrain::tensor_parallel
