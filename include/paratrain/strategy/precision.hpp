#pragma once
/// \file
/// paratrain::Precision — mixed precision: forward under autocast, fp32 parameters and
/// optimizer state, gradients optionally summed across ranks in a narrower type.

#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <optional>
#include <string>
#include <utility>

#include "paratrain/util/torch_compat.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/strategy/loss_scale.hpp"

namespace paratrain {

// Note [Mixed precision]
// The parameters, their gradients and the optimizer's state stay in fp32 (the "master
// weights"); only the computation narrows. Forward and the loss run under LibTorch's
// autocast, as PyTorch's `torch.autocast(device, dtype)` runs them: matrix products and
// convolutions in bf16, reductions and losses in fp32, each weight cast
// once per forward and the cast kept for backward. Backward runs outside the region, as in
// PyTorch, and its gradients arrive in fp32 (each cast's backward widens them). So one
// policy serves DataParallel, every ZeRO stage and every pipeline schedule unchanged.
//
// `reduce` narrows what crosses the wire: each bucket of summed-over-samples gradients is
// cast to it, summed across ranks in it (comm::Mpi widens each pair to float, adds and
// rounds: Note [16-bit reductions]) and widened back into the fp32 bucket when the sum
// completes. Half the bytes of fp32, for one rounding of each partial sum and of the
// total (relative error at most 2^-8 each for bf16); ZeRO 2 and 3 reduce-scatter the
// same way. Together with ZeRO-3's `gather`, this is FSDP's MixedPrecision(param_dtype,
// reduce_dtype).
//
// Memory: autocast's bf16 copies of the weights, 2 bytes per parameter, live from forward
// to backward (autograd keeps them for the products' backward); recomputed units
// (Unit<Recompute<Layer>>) make theirs one unit at a time. plan::Model::autocast_bytes
// counts them. ZeRO-3 makes none for its units' parameters: it gathers them in bf16
// (`gather`, Note [Gathers in the compute type]), FSDP's MixedPrecision(param_dtype).

/// Which types a strategy computes and communicates in (DataParallelOptions::precision,
/// and through it PipelineOptions::data_parallel): Note [Mixed precision].
///
/// \code
/// paratrain::DataParallelOptions o{.precision = {.autocast = at::kBFloat16, .reduce = at::kBFloat16}};
/// \endcode
struct Precision {
  /// Forward and the loss under autocast to this type: at::kBFloat16 (CPU or CUDA), or
  /// at::kHalf on a GPU, with dynamic loss scaling (loss_scale). Empty: everything in the
  /// parameters' type.
  std::optional<at::ScalarType> autocast;
  /// The type gradients are summed in across ranks: at::kBFloat16 halves the bytes of
  /// fp32 gradients (fp16 is refused: sums over samples overflow it). Empty: the
  /// gradients' own type.
  std::optional<at::ScalarType> reduce;
  /// ZeRO-3 under autocast: the type units' parameters are gathered in for forward and
  /// backward (FSDP's param_dtype). Empty: autocast's type for every bucket whose
  /// parameters autocast only casts to it (found in the first step), which halves those
  /// gathers' bytes and makes no autocast copies of them; at::kFloat: fp32 gathers
  /// throughout. Master weights and optimizer state stay fp32 either way. Note [Gathers in
  /// the compute type].
  std::optional<at::ScalarType> gather;
  /// Dynamic loss scaling (Note [Loss scaling]): on with GradScaler's defaults whenever
  /// autocast is at::kHalf; set it to scale without fp16 too, or to change its parameters.
  std::optional<LossScaling> loss_scale;
};

namespace detail {

/// The loss scaling `p` asks for: its own, or GradScaler's defaults under fp16 autocast.
inline std::optional<LossScaling> loss_scaling(const Precision& p) {
  if (p.loss_scale) return p.loss_scale;
  if (p.autocast == at::kHalf) return LossScaling{};
  return std::nullopt;
}

/// Throws paratrain::error, the same on every rank, for a type autocast or the reduction
/// cannot use on `device`.
inline void check_precision(const Precision& p, const c10::Device& device, std::string_view owner, int rank) {
  if (p.autocast) {
    const auto t = *p.autocast;
    if (t == at::kHalf && !device.is_cuda())
      throw error(owner, rank,
                  "Precision::autocast is Half on the CPU, whose autocast LibTorch runs in bf16 only; use "
                  "at::kBFloat16 there (fp16 with loss scaling is for GPUs without bf16: V100, T4)");
    if (t != at::kBFloat16 && t != at::kHalf)
      throw error(owner, rank,
                  std::string("Precision::autocast is ") + c10::toString(t) +
                      "; autocast computes in at::kBFloat16, or at::kHalf on a GPU (with loss scaling)");
  }
  if (p.gather && *p.gather != at::kFloat && *p.gather != p.autocast)
    throw error(owner, rank,
                std::string("Precision::gather is ") + c10::toString(*p.gather) +
                    (p.autocast ? std::string(" and autocast computes in ") + c10::toString(*p.autocast)
                                : std::string(" without autocast")) +
                    "; ZeRO-3 gathers units in autocast's type (leave gather empty) or in fp32 (at::kFloat)");
  // Not fp16: the buckets hold sums over samples (Note [Exact averaging]), which overflow
  // fp16's 65504 where bf16, with fp32's range, does not.
  if (p.reduce && *p.reduce != at::kBFloat16 && *p.reduce != at::kFloat)
    throw error(owner, rank,
                std::string("Precision::reduce is ") + c10::toString(*p.reduce) +
                    "; gradients are summed in a floating type with fp32's range: at::kBFloat16 (half the bytes) or "
                    "at::kFloat");
}

/// The type ZeRO-3 gathers units in under autocast (StoreOptions::gather): autocast's
/// unless Precision::gather says fp32; empty without autocast.
inline std::optional<at::ScalarType> gather_type(const Precision& p) {
  if (!p.autocast || p.gather == at::kFloat) return std::nullopt;
  return p.autocast;
}

/// Forward under autocast to `dtype` on `device`'s kind, for its lifetime, as
/// `with torch.autocast(...)` is: the state before is restored after, and the cache of
/// cast weights is dropped when the outermost region ends. Nothing without a dtype.
class AutocastScope {
 public:
  AutocastScope(std::optional<at::ScalarType> dtype, const c10::Device& device) : active_(dtype.has_value()) {
    if (!active_) return;
    type_ = device.is_cuda() ? c10::DeviceType::CUDA : c10::DeviceType::CPU;
    was_enabled_ = detail::autocast_enabled(type_);
    was_dtype_ = detail::autocast_dtype(type_);
    detail::set_autocast_enabled(type_, true);
    detail::set_autocast_dtype(type_, *dtype);
    at::autocast::increment_nesting();
  }
  ~AutocastScope() {
    if (!active_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    detail::set_autocast_enabled(type_, was_enabled_);
    detail::set_autocast_dtype(type_, was_dtype_);
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool active_ = false;
  c10::DeviceType type_ = c10::DeviceType::CPU;
  bool was_enabled_ = false;
  at::ScalarType was_dtype_ = at::kBFloat16;
};

}  // namespace detail
}  // namespace paratrain
