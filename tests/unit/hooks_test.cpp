// Gradient hooks (Note [Gradient hooks]), the bucket layer's public seam, each against an
// expectation of its own:
// - PowerSGD (Note [PowerSGD]) against a plain-LibTorch reference of the algorithm written
//   from the paper in one process, which computes every rank's gradient of its own samples
//   (3 + rank of them: batches of different sizes) and sums the factors over the ranks as the
//   all-reduces would; SGD with momentum; DDP and ZeRO-1 at 1-4 ranks; with and without
//   warm start and error feedback; its bytes on the wire against the factors' sizes;
// - fp16 and bf16 compression against single-device training within the narrow type's
//   rounding, and against the exact sum: it must differ (it rounds), and send half the bytes;
// - a hook written in the test (a user's), which sums exactly and counts its launches: DDP's
//   result bit for bit, one launch per bucket and step;
// - the refusals: a hook in deterministic mode or beside Precision::reduce, on every rank.
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/strategy/buckets/hooks.hpp"
#include "paratrain/strategy/buckets/powersgd.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "support/doctest.hpp"  // after LibTorch: see there
#include "support/equivalence.hpp"

namespace hooks_test {

namespace comm = paratrain::comm;
namespace zero = paratrain::zero;
using paratrain::PowerSgd;
using paratrain::PowerSgdOptions;
using paratrain_test::error_of;
using paratrain_test::max_relative_difference;

// Three layers: fc1's (24 x 12) and fc2's (16 x 24) weights compress at rank 2 and a
// compression rate of 2, fc3's (5 x 16) does not ((5 + 16) x 2 x 2 = 84 > 80): summed
// exactly, as are the biases.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(12, 24));
    fc2 = register_module("fc2", torch::nn::Linear(24, 16));
    fc3 = register_module("fc3", torch::nn::Linear(16, 5));
  }
  torch::Tensor forward(torch::Tensor x) { return fc3(torch::tanh(fc2(torch::tanh(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Net);

Net make_net() {
  torch::manual_seed(7);
  return Net();
}

// Rank r's samples in step t: 3 + r of them, from one fixed data set.
paratrain::Batch batch_of(int rank, int step) {
  static const auto data = [] {
    torch::manual_seed(21);
    return std::pair{torch::randn({2048, 12}), torch::randint(0, 5, {2048}, torch::kLong)};
  }();
  const auto start = (static_cast<std::int64_t>(step) * 4 + rank) * 8;
  return {data.first.narrow(0, start, 3 + rank), data.second.narrow(0, start, 3 + rank)};
}

const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);

// Gram-Schmidt on the columns, as the paper's Algorithm 1 and PyTorch's hook.
void orthogonalize(torch::Tensor& m) {
  for (std::int64_t i = 0; i < m.size(1); ++i) {
    auto col = m.select(1, i);
    const auto norm = col.norm().item<double>();
    if (norm > 0) col.div_(norm);
    for (std::int64_t j = i + 1; j < m.size(1); ++j) {
      auto other = m.select(1, j);
      other.sub_(col * (col * other).sum());
    }
  }
}

// PowerSGD written from the paper, every rank in this one process: each step, rank r's
// gradient M_r (of n_r x its mean loss, the sum over its samples); a matrix that compresses
// is summed as P = sum_r (M_r + e_r) Q, orthogonalised, Q = sum_r (M_r + e_r)^T P, sum ~ P Q^T,
// each rank keeping e_r = M_r + e_r - P Q^T / W; the rest summed exactly; the step's
// gradient the sum over all samples of the step; then LibTorch's SGD.
std::vector<torch::Tensor> reference(int world, int steps, const PowerSgdOptions& o) {
  auto model = make_net();
  torch::optim::SGD optim(model->parameters(), sgd);
  std::map<std::string, std::vector<torch::Tensor>> errors;  // per parameter, per rank
  std::map<std::string, torch::Tensor> qs;
  for (int t = 0; t < steps; ++t) {
    std::vector<std::map<std::string, torch::Tensor>> grads(static_cast<std::size_t>(world));
    std::int64_t samples = 0;
    for (int r = 0; r < world; ++r) {
      optim.zero_grad();
      const auto b = batch_of(r, t);
      (torch::nn::functional::cross_entropy(model->forward(b.input()), b.target) * static_cast<double>(b.size()))
          .backward();
      for (const auto& p : model->named_parameters()) grads[static_cast<std::size_t>(r)][p.key()] = p.value().grad().clone();
      samples += b.size();
    }
    for (auto& p : model->named_parameters()) {
      const auto& name = p.key();
      const auto shape = p.value().sizes();
      const std::int64_t n = shape.size() >= 2 ? shape[0] : 0, m = n > 0 ? p.value().numel() / n : 0;
      const std::int64_t rank = std::min<std::int64_t>({o.rank, n, m});
      const bool compress = t >= o.start_step && n > 0 &&
                            static_cast<double>((n + m) * rank) * o.min_compression_rate < static_cast<double>(n * m);
      torch::Tensor sum = torch::zeros_like(p.value());
      if (!compress) {
        for (int r = 0; r < world; ++r) sum += grads[static_cast<std::size_t>(r)][name];
      } else {
        auto& e = errors[name];
        if (e.empty()) e.assign(static_cast<std::size_t>(world), torch::zeros({n, m}));
        std::vector<torch::Tensor> ms;
        for (int r = 0; r < world; ++r) {
          auto mr = grads[static_cast<std::size_t>(r)][name].reshape({n, m});
          if (o.error_feedback) mr = mr + e[static_cast<std::size_t>(r)];
          ms.push_back(mr);
        }
        auto& q = qs[name];
        if (!q.defined() || !o.warm_start) {
          auto g = at::make_generator<at::CPUGeneratorImpl>(PowerSgd::initial_seed(o.seed, name, t));
          q = at::randn({m, rank}, g, at::TensorOptions(at::kFloat));
        }
        orthogonalize(q);
        auto pm = torch::zeros({n, rank});
        for (const auto& mr : ms) pm += torch::mm(mr, q);
        orthogonalize(pm);
        auto qm = torch::zeros({m, rank});
        for (const auto& mr : ms) qm += torch::mm(mr.t(), pm);
        const auto approx = torch::mm(pm, qm.t());
        if (o.error_feedback)
          for (int r = 0; r < world; ++r) e[static_cast<std::size_t>(r)] = ms[static_cast<std::size_t>(r)] - approx / world;
        q = qm;
        sum = approx.reshape(shape);
      }
      p.value().mutable_grad() = sum / static_cast<double>(samples);
    }
    optim.step();
  }
  return model->parameters();
}

template <class Update>
std::vector<torch::Tensor> distributed(comm::Mpi c, int steps, const PowerSgdOptions& o,
                                       std::vector<std::int64_t>* sent = nullptr) {
  paratrain::DataParallel<Net, comm::Mpi, Update> s(make_net(), c, sgd);
  s.register_gradient_hook(PowerSgd(o));
  for (int t = 0; t < steps; ++t) {
    s.step(batch_of(c.rank(), t), paratrain::CrossEntropy{});
    if (sent != nullptr) sent->push_back(s.gradient_bytes_sent());
  }
  return s.full_parameters();
}

TEST_CASE("PowerSGD equals the algorithm's single-process reference at every rank count (DDP, ZeRO-1)") {
  comm::Mpi c;
  const int world = c.size(), steps = 8;
  for (const PowerSgdOptions o : {PowerSgdOptions{.rank = 2, .start_step = 2},
                                  PowerSgdOptions{.rank = 2, .start_step = 2, .error_feedback = false},
                                  PowerSgdOptions{.rank = 1, .start_step = 0, .warm_start = false, .seed = 5}}) {
    CAPTURE(o.rank);
    CAPTURE(o.error_feedback);
    CAPTURE(o.warm_start);
    const auto want = reference(world, steps, o);
    std::vector<std::int64_t> sent;
    CHECK(max_relative_difference(distributed<torch::optim::SGD>(c, steps, o, &sent), want) <= 1e-5);
    CHECK(max_relative_difference(distributed<paratrain::Sharded<torch::optim::SGD, zero::stage1>>(c, steps, o), want) <=
          1e-5);
    // Bytes per step: exact sums of fp32 before start_step (288 + 384 + 80 weights, 45 bias
    // elements), then each weight's P and Q ((n + m) r) where that is less than half of n m,
    // else the weight's own n m, and the biases.
    std::int64_t compressed = 45;
    for (const auto& [n, m] : {std::pair{24, 12}, std::pair{16, 24}, std::pair{5, 16}})
      compressed += (n + m) * o.rank * 2 < n * m ? (n + m) * o.rank : n * m;
    const std::int64_t exact = (288 + 384 + 80 + 45) * 4;
    compressed *= 4;
    for (int t = 0; t < steps; ++t) CHECK(sent[static_cast<std::size_t>(t)] == (t < o.start_step ? exact : compressed));
  }
  // The test can fail: compression changes the result (the reference without it is elsewhere).
  const auto exact = reference(world, steps, {.rank = 2, .start_step = steps});
  CHECK(max_relative_difference(reference(world, steps, {.rank = 2, .start_step = 2}), exact) > 1e-3);
}

// A hook of the user's: the exact sum, counting its launches.
struct CountingSum {
  int* launches;
  template <class Comm>
  paratrain::AnyRequest launch(paratrain::GradientBucket<Comm>& b) {
    ++*launches;
    return paratrain::SumGradients{}.launch(b);
  }
};

TEST_CASE("a hook of one's own replaces the exact sum: DDP's result bit for bit, a launch per bucket and step") {
  comm::Mpi c;
  using DDP = paratrain::DataParallel<Net, comm::Mpi, torch::optim::SGD>;
  const paratrain::DataParallelOptions small_buckets{.bucket_cap_bytes = 1024, .first_bucket_cap_bytes = 256};
  DDP plain(make_net(), c, sgd, small_buckets), hooked(make_net(), c, sgd, small_buckets);
  int launches = 0;
  hooked.register_gradient_hook(CountingSum{&launches});
  for (int t = 0; t < 3; ++t) {
    plain.step(batch_of(c.rank(), t), paratrain::CrossEntropy{});
    hooked.step(batch_of(c.rank(), t), paratrain::CrossEntropy{});
  }
  CHECK(hooked.bucket_count() > 1);
  CHECK(launches == 3 * static_cast<int>(hooked.bucket_count()));
  CHECK(max_relative_difference(hooked.full_parameters(), plain.full_parameters()) == 0);
}

// Tolerance: as precision_test.cpp's. Each rank's gradient is rounded to the narrow type
// once and each pairwise sum of the reduction once more (log2(4) = 2 levels at 4 ranks):
// at most 3 roundings of eps/2 of the largest gradient, eps = 2^-8 for bf16, 2^-11 for
// fp16; 3 SGD steps; allowed: 4 eps of the largest change.
TEST_CASE("fp16 and bf16 compression: single-device training within the narrow type's rounding, half the bytes") {
  comm::Mpi c;
  const int world = c.size(), steps = 3;
  // Single-device training on the union of every rank's samples.
  auto reference = make_net();
  torch::optim::SGD optim(reference->parameters(), sgd);
  const auto initial = make_net()->parameters();
  for (int t = 0; t < steps; ++t) {
    std::vector<torch::Tensor> xs, ys;
    for (int r = 0; r < world; ++r) {
      const auto b = batch_of(r, t);
      xs.push_back(b.input());
      ys.push_back(b.target);
    }
    optim.zero_grad();
    torch::nn::functional::cross_entropy(reference->forward(torch::cat(xs)), torch::cat(ys)).backward();
    optim.step();
  }
  const auto want = reference->parameters();
  using DDP = paratrain::DataParallel<Net, comm::Mpi, torch::optim::SGD>;
  DDP exact(make_net(), c, sgd);
  for (int t = 0; t < steps; ++t) exact.step(batch_of(c.rank(), t), paratrain::CrossEntropy{});
  for (const auto type : {at::kHalf, at::kBFloat16}) {
    CAPTURE(type);
    DDP s(make_net(), c, sgd);
    s.register_gradient_hook(paratrain::NarrowGradients(type));
    for (int t = 0; t < steps; ++t) s.step(batch_of(c.rank(), t), paratrain::CrossEntropy{});
    const auto got = s.full_parameters();
    const double eps = type == at::kHalf ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
    for (std::size_t i = 0; i < got.size(); ++i) {
      const auto change = (want[i] - initial[i]).abs().max().item<double>();
      CHECK((got[i] - want[i]).abs().max().item<double>() <= 4 * eps * change);
    }
    CHECK(max_relative_difference(got, exact.full_parameters()) > 0);  // it rounds
    CHECK(s.gradient_bytes_sent() * 2 == exact.gradient_bytes_sent());
  }
}

TEST_CASE("a gradient hook is refused in deterministic mode and beside Precision::reduce, on every rank") {
  comm::Mpi c;
  using DDP = paratrain::DataParallel<Net, comm::Mpi, torch::optim::SGD>;
  at::set_num_threads(1);
  DDP deterministic(make_net(), c, sgd, {.deterministic = {.shards = 12}});
  CHECK(error_of([&] { deterministic.register_gradient_hook(PowerSgd()); }).find("takes no other") !=
        std::string::npos);
  DDP narrow(make_net(), c, sgd, {.precision = {.reduce = at::kBFloat16}});
  CHECK(error_of([&] { narrow.register_gradient_hook(PowerSgd()); })
            .find("register NarrowGradients(type, your hook)") != std::string::npos);
  CHECK(error_of([] { paratrain::NarrowGradients bad(at::kInt); }).find("floating-point type") != std::string::npos);
  CHECK(error_of([] { PowerSgd bad({.rank = 0}); }).find("at least 1") != std::string::npos);
}

}  // namespace hooks_test
