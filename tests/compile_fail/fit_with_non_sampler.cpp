// expect: paratrain::fit<Sampler>: Sampler is not a paratrain::sampler
// A type picked as fit's sampler policy must be a sampler; the error says which members.
#include <torch/torch.h>

#include "paratrain/fit/fit.hpp"
#include "paratrain/strategy/data_parallel.hpp"

struct NotASampler {
  NotASampler(std::int64_t, paratrain::data::SamplerOptions) {}
};

void train(paratrain::DataParallel<torch::nn::Linear, paratrain::comm::SingleDevice, torch::optim::SGD>& s, const paratrain::data::TensorDataset& data) {
  paratrain::fit<NotASampler>(s, data, {});
}
