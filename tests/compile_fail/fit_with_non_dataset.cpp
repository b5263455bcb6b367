// expect: paratrain::fit: the training set is not a paratrain::dataset
// fit takes any dataset; a type without get(indices) is named with the members it lacks.
#include <torch/torch.h>

#include "paratrain/fit/fit.hpp"
#include "paratrain/strategy/data_parallel.hpp"

struct Rows {
  std::int64_t size() const { return 3; }
};

void train(paratrain::DataParallel<torch::nn::Linear, paratrain::comm::SingleDevice, torch::optim::SGD>& s) { paratrain::fit(s, Rows{}, {}); }
