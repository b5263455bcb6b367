// fit(): the loop trains exactly like a hand-written single-device loop over the same
// global batches, evaluates every sample exactly once, and reduces metrics safely.
#include <torch/torch.h>

#include <set>
#include <string>

#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/comm/single_device.hpp"
#include "paratrain/data/distributed_sampler.hpp"
#include "paratrain/fit/fit.hpp"
#include "paratrain/fit/metrics.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "support/doctest.hpp"
#include "support/fit_reference.hpp"

// A namespace of its own: this file shares a translation unit with others (Note [Unity groups]).
namespace fit_test {

namespace {

namespace comm = paratrain::comm;

// fit's reference (tests/support/fit_reference.hpp): the classifier, its data, the loop.
using paratrain_test::fit_reference::make_data;
using paratrain_test::fit_reference::make_net;
using paratrain_test::fit_reference::Net;

}  // namespace

TEST_CASE_TEMPLATE("fit trains like a single-device loop over the union of the ranks' batches", C,
                   comm::SingleDevice, comm::Mpi) {
  C c;
  const int world = c.size();
  const auto train = make_data(203, 1);  // uneven: not a multiple of the batch or of the ranks
  const paratrain::FitOptions options{.epochs = 2, .batch_size = 5, .seed = 3, .progress = false};
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);

  paratrain::DataParallel<Net, C, torch::optim::SGD> s(make_net(), std::move(c), sgd);
  paratrain::fit(s, train, options);

  // The reference: every rank's DistributedSampler batches, concatenated per step.
  auto net = make_net();
  paratrain_test::fit_reference::train(net, train, world, options.epochs, 5, 3, sgd, torch::kCPU);
  const auto got = s.model()->parameters(), want = net->parameters();
  for (std::size_t i = 0; i < got.size(); ++i)
    CHECK(((got[i] - want[i]).abs().max() / want[i].abs().max()).template item<double>() <= 1e-5);
}

TEST_CASE("fit evaluates every sample exactly once and reports the single-device accuracy") {
  comm::Mpi c;
  const auto train = make_data(64, 1), test = make_data(101, 2);  // 101: not divisible by 2 or 4 ranks
  paratrain::DataParallel<Net, comm::Mpi, torch::optim::Adam> s(make_net(), std::move(c),
                                                                torch::optim::AdamOptions(1e-2));
  const auto result =
      paratrain::fit(s, train, {.epochs = 1, .batch_size = 8, .eval = &test, .eval_batch_size = 7, .progress = false});
  const auto& e = result.epochs.back();
  CHECK(e.eval_samples == 101);
  torch::NoGradGuard no_grad;
  const auto out = s.model()->forward(test.inputs());
  const double accuracy = out.argmax(1).eq(test.targets()).to(torch::kDouble).mean().item<double>();
  const double loss = torch::nn::functional::cross_entropy(out, test.targets()).item<double>();
  CHECK(e.eval_accuracy == doctest::Approx(accuracy).epsilon(1e-12));
  CHECK(e.eval_loss == doctest::Approx(loss).epsilon(1e-5));
}

TEST_CASE_TEMPLATE("evaluate, called alone, reports the single-device loss and accuracy of every sample once", C,
                   comm::SingleDevice, comm::Mpi) {
  C c;
  const auto test = make_data(97, 2);  // 97: prime, so no world of 2-4 ranks divides it
  paratrain::DataParallel<Net, C, torch::optim::SGD> s(make_net(), std::move(c), torch::optim::SGDOptions(0.1));
  const auto e = paratrain::evaluate(s, test, {.batch_size = 6});
  torch::NoGradGuard no_grad;
  auto net = make_net();  // the same weights, on one device
  const auto out = net->forward(test.inputs());
  CHECK(e.samples == 97);
  CHECK(e.accuracy == doctest::Approx(out.argmax(1).eq(test.targets()).to(torch::kDouble).mean().item<double>()));
  CHECK(e.loss == doctest::Approx(torch::nn::functional::cross_entropy(out, test.targets()).item<double>()).epsilon(1e-6));
  CHECK_THROWS_WITH_AS(paratrain::evaluate(s, test, {.batch_size = 0}), doctest::Contains("batch_size must be >= 1"),
                       paratrain::error);
}

TEST_CASE("LrSchedule: the linear scaling rule's warm-up times the user's schedule (Goyal et al., 2.2)") {
  // Global batch 128 against a reference of 32: the target factor is 4, reached over 2
  // epochs of 10 steps; the user halves the rate from epoch 1 on.
  const paratrain::LrSchedule lr({.reference_batch = 32, .warmup_epochs = 2}, [](double epoch) { return epoch < 1 ? 1.0 : 0.5; },
                                 128);
  const auto at = [](std::int64_t step, double epoch) { return paratrain::lr::Clock{.step = step, .total_steps = 40, .epoch = epoch}; };
  CHECK(lr.active());
  CHECK(lr.factor(at(0, 0.0), 10) == doctest::Approx(1.0));
  CHECK(lr.factor(at(5, 0.5), 10) == doctest::Approx(1.0 + 3.0 * 5 / 20));
  CHECK(lr.factor(at(15, 1.5), 10) == doctest::Approx((1.0 + 3.0 * 15 / 20) * 0.5));
  CHECK(lr.factor(at(40, 4.0), 10) == doctest::Approx(4.0 * 0.5));
  const paratrain::LrSchedule off({}, {}, 128);
  CHECK_FALSE(off.active());
  CHECK(off.factor(at(7, 0.7), 10) == doctest::Approx(1.0));
  const paratrain::LrSchedule empty({}, std::function<double(double)>(), 128);  // an empty function: no schedule
  CHECK_FALSE(empty.active());
}

TEST_CASE("fit's epoch loss is the mean over every step of the epoch, whatever log_every") {
  comm::Mpi c;
  const auto train = make_data(120, 1);
  paratrain::DataParallel<Net, comm::Mpi, torch::optim::SGD> s(make_net(), std::move(c), torch::optim::SGDOptions(0.05));
  double weighted = 0, samples = 0;
  const auto result = paratrain::fit(s, train,
                                     {.epochs = 1,
                                      .batch_size = 4,
                                      .log_every = 3,
                                      .progress = false,
                                      .on_step = [&](const paratrain::StepInfo& i) {
                                        weighted += i.loss * i.global_samples;  // same batch size on every rank
                                        samples += i.global_samples;
                                      }});
  // This rank's losses only: rank-local means of equal-size batches; reduce them here.
  auto sums = torch::tensor({weighted, samples}, torch::kDouble);
  s.all_reduce(sums, paratrain::reduce_op::sum);
  CHECK(result.epochs.back().train_loss ==
        doctest::Approx(sums[0].item<double>() / sums[1].item<double>()).epsilon(1e-9));
}

TEST_CASE("fit scales the learning rate linearly with warm-up (Goyal et al.)") {
  comm::Mpi c;
  const int world = c.size();
  const auto train = make_data(256, 1);
  paratrain::DataParallel<Net, comm::Mpi, torch::optim::SGD> s(make_net(), std::move(c), torch::optim::SGDOptions(0.1));
  std::vector<double> lrs;
  paratrain::fit(s, train,
                 {.epochs = 2,
                  .batch_size = 8,
                  .lr_scaling = {.reference_batch = 4, .warmup_epochs = 1},
                  .progress = false,
                  .on_step = [&](const paratrain::StepInfo& i) { lrs.push_back(i.lr); }});
  const double target = 0.1 * (8.0 * world) / 4.0;
  const auto steps_per_epoch = static_cast<std::size_t>((256 / world + 7) / 8);
  REQUIRE(lrs.size() == 2 * steps_per_epoch);
  CHECK(lrs.front() == doctest::Approx(0.1));
  CHECK(lrs[steps_per_epoch / 2] == doctest::Approx(0.1 + (target - 0.1) * double(steps_per_epoch / 2) / double(steps_per_epoch)));
  CHECK(lrs.back() == doctest::Approx(target));
}

TEST_CASE("Metrics: ranks that log different names still reduce together, weighted") {
  comm::Mpi c;
  paratrain::Metrics m;
  m.log("common", c.rank(), 1.0 + c.rank());                // weight 1 + r
  m.log("only_rank_" + std::to_string(c.rank()), 10.0 * c.rank());
  if (c.rank() == 0) m.log("a_name_much_longer_than_the_others", 1.0);
  const auto global = m.sync(c);
  double num = 0, den = 0;
  for (int r = 0; r < c.size(); ++r) num += r * (1.0 + r), den += 1.0 + r;
  CHECK(global.at("common") == doctest::Approx(num / den));
  for (int r = 0; r < c.size(); ++r) CHECK(global.at("only_rank_" + std::to_string(r)) == doctest::Approx(10.0 * r));
  CHECK(global.at("a_name_much_longer_than_the_others") == 1.0);
  CHECK(global.size() == static_cast<std::size_t>(c.size()) + 2);
  CHECK(m.sync(c).empty());  // started afresh; and nobody logged: still no hang
}

}  // namespace fit_test
