#pragma once
// Which recorded PyTorch output the sampler tests compare with: the one PyTorch of the same
// major version as the LibTorch under test wrote (tests/data/make_sampler_reference.py, run
// with Debian 12's python3-torch 1.13 and Debian 13's 2.6). The two differ where PyTorch
// changed its draws: torch.multinomial of one sample with replacement (WeightedRandomSampler
// with num_samples = 1) draws another index in 2.x from the same generator state.
#include <torch/version.h>

namespace paratrain_test {

inline const char* sampler_reference_file() {
#if TORCH_VERSION_MAJOR >= 2
  return "sampler_reference_torch2.json";
#else
  return "sampler_reference.json";
#endif
}

}  // namespace paratrain_test
