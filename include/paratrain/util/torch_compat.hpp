#pragma once
/// \file
/// What differs between the LibTorch versions paratrain supports, spelled once.
///
/// Note [LibTorch versions]
/// ~~~~~~~~~~~~~~~~~~~~~~~~
/// paratrain is built and tested against LibTorch 1.13.1 (Debian 12's libtorch-dev) and
/// 2.6.0 (Debian 13's), both by scripts/test.sh (the second in a Debian 13 root made by
/// scripts/compat.sh). Everything that is spelled differently between them lives in this
/// header, so that a new version is a change here, not a hunt through the tree:
/// - the optimizer's state map is keyed by the parameter's TensorImpl, as a string in 1.x
///   (c10::guts::to_string of the pointer) and as the pointer itself (void*) in 2.x;
///   c10::guts::to_string is gone in 2.x;
/// - autocast's state is per device type from 2.4 on (is_autocast_enabled(kCPU), ...); the
///   older functions named for CPU and GPU are deprecated there;
/// - c10d's ProcessGroupGloo derives from c10d::Backend in 2.x (from ProcessGroup in 1.x):
///   comm/gloo/gloo.hpp uses only what both give (allreduce & co. returning c10d::Work);
/// - c10d's TCPStore uses libuv by default from 2.4 on, and a LibTorch built without it
///   (Debian 13's 2.6) then refuses to start a store: plain_socket_store() asks for the
///   socket backend every version has.
/// This is the one header besides core/config.hpp that reads a version macro (LibTorch's own).

#include <ATen/autocast_mode.h>
#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <torch/version.h>

#include <sstream>
#include <string>

namespace paratrain::detail {

#if TORCH_VERSION_MAJOR >= 2
/// The key of a parameter's entry in torch::optim::Optimizer::state().
using OptimizerStateKey = void*;
inline OptimizerStateKey optimizer_state_key(const at::Tensor& parameter) { return parameter.unsafeGetTensorImpl(); }
#else
using OptimizerStateKey = std::string;
inline OptimizerStateKey optimizer_state_key(const at::Tensor& parameter) {
  std::ostringstream key;  // what c10::guts::to_string(impl) wrote: the pointer through operator<<
  key << static_cast<const void*>(parameter.unsafeGetTensorImpl());
  return key.str();
}
#endif

/// Autocast's state for one device type (kCPU, or kCUDA for every GPU), read and set alike
/// on every version (the per-device-type calls from 2.4 on, the CPU/GPU ones before).
inline bool autocast_enabled(c10::DeviceType type) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  return at::autocast::is_autocast_enabled(type);
#else
  return type == c10::DeviceType::CPU ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
#endif
}

inline void set_autocast_enabled(c10::DeviceType type, bool enabled) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  at::autocast::set_autocast_enabled(type, enabled);
#else
  if (type == c10::DeviceType::CPU) at::autocast::set_cpu_enabled(enabled);
  else at::autocast::set_enabled(enabled);
#endif
}

inline c10::ScalarType autocast_dtype(c10::DeviceType type) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  return at::autocast::get_autocast_dtype(type);
#else
  return type == c10::DeviceType::CPU ? at::autocast::get_autocast_cpu_dtype() : at::autocast::get_autocast_gpu_dtype();
#endif
}

inline void set_autocast_dtype(c10::DeviceType type, c10::ScalarType dtype) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
  at::autocast::set_autocast_dtype(type, dtype);
#else
  if (type == c10::DeviceType::CPU) at::autocast::set_autocast_cpu_dtype(dtype);
  else at::autocast::set_autocast_gpu_dtype(dtype);
#endif
}

/// `o` (c10d::TCPStoreOptions) asking for TCPStore's plain socket backend where the
/// options can choose (2.4 and later; c10d's headers stay the caller's to include).
template <class StoreOptions>
StoreOptions& plain_socket_store(StoreOptions& o) {
  if constexpr (requires { o.useLibUV; }) o.useLibUV = false;
  return o;
}

}  // namespace paratrain::detail
