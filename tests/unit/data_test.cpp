// Datasets, samplers as fit's policy, and the prefetching Loader (issue #11, item 1-2).
// Readers are checked against contents known independently of them: Fashion-MNIST's
// published facts and bytes read by Python's gzip, IDX bytes written here by hand from the
// format's description, .npy files written by NumPy (tests/data/make_npy.py) holding a
// formula of the position. WeightedSampler is checked against PyTorch's
// WeightedRandomSampler (tests/data/make_sampler_reference.py); fit with other samplers
// and datasets against a hand-written single-device loop.
#include <torch/torch.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "paratrain/comm/mpi/mpi.hpp"
#include "paratrain/comm/single_device.hpp"
#include "paratrain/concepts/dataset.hpp"
#include "paratrain/data/idx_dataset.hpp"
#include "paratrain/data/loader.hpp"
#include "paratrain/data/npy_dataset.hpp"
#include "paratrain/data/sequential_sampler.hpp"
#include "paratrain/data/weighted_sampler.hpp"
#include "paratrain/fit/fit.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/strategy/sharded.hpp"
#include "support/doctest.hpp"  // after LibTorch: see there
#include "support/sampler_reference.hpp"
#include "support/equivalence.hpp"
#include "support/test_data.hpp"

namespace {

namespace fs = std::filesystem;
namespace comm = paratrain::comm;
namespace data = paratrain::data;
using Indices = std::vector<std::int64_t>;
using paratrain_test::error_of;
using paratrain_test::Mlp;

const fs::path test_data = paratrain_test::test_data_dir();
const fs::path fashion = "/usr/share/datasets/fashion-mnist";

static_assert(paratrain::dataset<data::TensorDataset>);
static_assert(paratrain::dataset<data::IdxDataset>);
static_assert(paratrain::dataset<data::NpyDataset>);
static_assert(paratrain::dataset<data::DatasetRef>);
static_assert(!paratrain::dataset<int>);
static_assert(paratrain::sampler<data::SequentialSampler>);
static_assert(paratrain::sampler<data::WeightedSampler>);

/// A scratch file name of this process, removed at scope exit.
struct Scratch {
  fs::path path;
  explicit Scratch(const std::string& name)
      : path(fs::temp_directory_path() / ("paratrain-data-" + std::to_string(::getpid()) + "-" + name)) {}
  ~Scratch() { fs::remove(path); }
};

void write_bytes(const fs::path& p, const std::vector<unsigned char>& bytes, bool gzip) {
  if (gzip) {
    gzFile f = gzopen(p.c_str(), "wb");
    gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
    gzclose(f);
  } else {
    std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()),
                                             static_cast<std::streamsize>(bytes.size()));
  }
}

}  // namespace

// ---- readers ------------------------------------------------------------------------

TEST_CASE("IdxDataset reads Fashion-MNIST as published: 60,000 + 10,000 samples, 6,000 of each class") {
  const data::IdxDataset train(fashion / "train-images-idx3-ubyte.gz", fashion / "train-labels-idx1-ubyte.gz");
  const data::IdxDataset test(fashion / "t10k-images-idx3-ubyte.gz", fashion / "t10k-labels-idx1-ubyte.gz",
                              {.mean = 0.2860, .std = 0.3530});
  CHECK(train.size() == 60000);
  CHECK(test.size() == 10000);
  CHECK(train.images().sizes() == torch::IntArrayRef({60000, 28, 28}));
  CHECK(torch::bincount(train.labels()).equal(torch::full({10}, 6000, torch::kLong)));
  // Read by Python's gzip and struct, independently of this reader.
  CHECK(train.labels().narrow(0, 0, 10).equal(torch::tensor({9, 0, 0, 3, 0, 2, 7, 2, 5, 5}, torch::kLong)));
  CHECK(test.images()[0].sum().item<std::int64_t>() == 33456);
  CHECK(test.images()[9999].sum().item<std::int64_t>() == 24390);
  CHECK(test.images()[0][14].narrow(0, 10, 6).equal(torch::tensor({0, 0, 0x62, 0x88, 0x6e, 0x6d}, torch::kUInt8)));
  // A batch: float [n, 1, 28, 28], normalised; undoing that gives the stored bytes.
  const auto b = test.get(torch::tensor({9999, 0, 9999}, torch::kLong));
  CHECK(b.input().sizes() == torch::IntArrayRef({3, 1, 28, 28}));
  CHECK((b.input().scalar_type() == torch::kFloat));
  const auto bytes = (b.input().squeeze(1) * 0.3530 + 0.2860) * 255;
  CHECK((bytes - bytes.round()).abs().max().item<double>() < 1e-3);
  CHECK(bytes.round().to(torch::kUInt8)[1].equal(test.images()[0]));
  CHECK(b.target.equal(test.labels().index_select(0, torch::tensor({9999, 0, 9999}, torch::kLong))));
}

TEST_CASE("read_idx follows the IDX format for every element type, plain and gzipped") {
  // Written by hand from the format's description: magic 0 0 <type> <dims>, big-endian
  // sizes, big-endian values.
  const std::vector<unsigned char> int16{0, 0, 0x0B, 2, 0, 0, 0, 2, 0, 0, 0, 3,
                                         0x00, 0x01, 0xFF, 0xFF, 0x01, 0x00, 0x80, 0x00, 0x7F, 0xFF, 0x00, 0x00};
  const std::vector<unsigned char> float64{0, 0, 0x0E, 1, 0, 0, 0, 2,
                                           0x3F, 0xF0, 0, 0, 0, 0, 0, 0,      // 1.0
                                           0xC0, 0x09, 0x21, 0xFB, 0x54, 0x44, 0x2D, 0x18};  // -pi
  for (const bool gzip : {false, true}) {
    CAPTURE(gzip);
    Scratch a("int16.idx"), b("float64.idx");
    write_bytes(a.path, int16, gzip);
    write_bytes(b.path, float64, gzip);
    const auto s = data::read_idx(a.path);
    CHECK((s.scalar_type() == torch::kShort));
    CHECK(s.equal(torch::tensor({1, -1, 256, -32768, 32767, 0}, torch::kShort).view({2, 3})));
    const auto d = data::read_idx(b.path);
    CHECK((d.scalar_type() == torch::kDouble));
    CHECK(d[0].item<double>() == 1.0);
    CHECK(d[1].item<double>() == doctest::Approx(-3.141592653589793).epsilon(1e-15));
  }
  Scratch bad("bad.idx");
  auto truncated = int16;
  truncated.pop_back();
  write_bytes(bad.path, truncated, true);
  CHECK(error_of([&] { data::read_idx(bad.path); }).find("truncated: its header declares 6 values") != std::string::npos);
  auto longer = int16;
  longer.push_back(0);
  write_bytes(bad.path, longer, false);
  CHECK(error_of([&] { data::read_idx(bad.path); }).find("holds more than the 6 values") != std::string::npos);
  write_bytes(bad.path, {0, 0, 0x0A, 1, 0, 0, 0, 0}, false);
  CHECK(error_of([&] { data::read_idx(bad.path); }).find(bad.path.string() + ": not an IDX file") != std::string::npos);
  CHECK(error_of([&] { data::read_idx("/nonexistent/x.idx"); }) ==
        "paratrain: read_idx: /nonexistent/x.idx: cannot open it");
}

TEST_CASE("NpyDataset maps NumPy's .npy files and reads any indices in order") {
  const data::NpyDataset set({test_data / "npy_x.npy", test_data / "npy_u8_v2.npy"}, test_data / "npy_y.npy");
  REQUIRE(set.size() == 11);
  for (const Indices& ids : {Indices{}, Indices{0}, Indices{10, 3, 3, 0, 7}, Indices{4, 5, 6, 7}}) {
    CAPTURE(ids.size());
    const auto b = set.get(torch::tensor(ids, torch::kLong));
    REQUIRE(b.inputs.size() == 2);
    CHECK((b.inputs[0].scalar_type() == torch::kFloat));
    CHECK(b.inputs[0].sizes() == torch::IntArrayRef({static_cast<std::int64_t>(ids.size()), 3, 2}));
    CHECK((b.inputs[1].scalar_type() == torch::kUInt8));
    CHECK((b.target.scalar_type() == torch::kLong));
    for (std::size_t n = 0; n < ids.size(); ++n) {
      const auto i = ids[n];
      for (int j = 0; j < 3; ++j)
        for (int k = 0; k < 2; ++k) CHECK(b.inputs[0][n][j][k].item<float>() == float(i * 100 + j * 10 + k));
      for (int j = 0; j < 4; ++j) CHECK(b.inputs[1][n][j].item<int>() == (i * 4 + j) % 256);
      CHECK(b.target[n].item<std::int64_t>() == (i * 7) % 5);
    }
  }
  // The same bytes as a raw file: the data begins after the 128-byte header.
  const auto raw = data::MappedArray::raw(test_data / "npy_x.npy", torch::kFloat, {3, 2}, 128);
  CHECK(raw.size() == 11);
  CHECK(raw.tensor()[10][2][1].item<float>() == 1021.0f);
  // The tensor keeps the mapping alive after the array is gone.
  torch::Tensor kept;
  { kept = data::MappedArray::npy(test_data / "npy_y.npy").tensor(); }
  CHECK(kept[6].item<std::int64_t>() == 2);
}

TEST_CASE("NpyDataset and MappedArray reject what they cannot read, naming the file and the fix") {
  const auto message = [](const fs::path& f) { return error_of([&] { data::MappedArray::npy(f); }); };
  CHECK(message(test_data / "npy_be.npy").find("npy_be.npy: holds big-endian values ('>f4')") != std::string::npos);
  CHECK(message(test_data / "npy_fortran.npy").find("npy_fortran.npy: is Fortran-ordered") != std::string::npos);
  CHECK(message(test_data / "npy_short.npy").find("npy_short.npy: is shorter than its header declares") !=
        std::string::npos);
  CHECK(message(test_data / "missing.npy").find("missing.npy: cannot open it") != std::string::npos);
  CHECK(message(test_data / "sampler_reference.json").find("is not a .npy file") != std::string::npos);
  CHECK(error_of([] { data::NpyDataset({test_data / "npy_x.npy"}, test_data / "npy_y10.npy"); })
            .find("npy_x.npy holds 11 samples but") != std::string::npos);
  CHECK(error_of([] { data::MappedArray::raw(test_data / "npy_y.npy", torch::kLong, {5}); })
            .find("not a whole number of samples of 40 bytes") != std::string::npos);
  const data::NpyDataset set({test_data / "npy_x.npy"}, test_data / "npy_y.npy");
  CHECK(error_of([&] { static_cast<void>(set.get(torch::tensor({3, 11}, torch::kLong))); }) ==
        "paratrain: NpyDataset: sample 11 asked for (position 1 of the batch), but the dataset holds 11 samples, 0 to 10");
  CHECK(error_of([&] { static_cast<void>(set.get(torch::tensor({3}, torch::kLong).view({1, 1}))); })
            .find("1-D int64 CPU tensor") != std::string::npos);
  CHECK(set.get(torch::tensor({3}, torch::kInt)).target[0].item<std::int64_t>() == (3 * 7) % 5);  // as index_select takes
}

// ---- samplers -----------------------------------------------------------------------

TEST_CASE("SequentialSampler gives each replica one block, as numpy.array_split does") {
  const auto blocks = [](std::int64_t n, std::int64_t replicas, bool drop_last) {
    std::vector<Indices> out;
    for (std::int64_t r = 0; r < replicas; ++r)
      out.push_back(data::SequentialSampler(n, {.num_replicas = replicas, .rank = r, .drop_last = drop_last}).indices());
    return out;
  };
  // numpy.array_split(range(10), 3) == [0..3], [4..6], [7..9]
  CHECK(blocks(10, 3, false) == std::vector<Indices>{{0, 1, 2, 3}, {4, 5, 6}, {7, 8, 9}});
  CHECK(blocks(10, 3, true) == std::vector<Indices>{{0, 1, 2}, {3, 4, 5}, {6, 7, 8}});
  CHECK(blocks(2, 4, false) == std::vector<Indices>{{0}, {1}, {}, {}});
  CHECK(blocks(2, 4, true) == std::vector<Indices>{{}, {}, {}, {}});
  CHECK(blocks(0, 1, false) == std::vector<Indices>{{}});
  data::SequentialSampler s(7, {.num_replicas = 1, .rank = 0, .shuffle = true, .seed = 5});
  s.set_epoch(3);
  CHECK(s.indices() == Indices{0, 1, 2, 3, 4, 5, 6});  // no shuffling, whatever the options
  CHECK(error_of([] { data::SequentialSampler(7, {.num_replicas = 2, .rank = 2}); }).find("rank is 2") !=
        std::string::npos);
}

TEST_CASE("WeightedSampler draws what PyTorch's WeightedRandomSampler draws, and deals it out like DistributedSampler") {
  std::ifstream file(test_data / paratrain_test::sampler_reference_file());
  const auto reference = nlohmann::json::parse(file).at("weighted");
  REQUIRE(reference.size() > 20);
  for (const auto& c : reference) {
    const auto& p = c.at("params");
    const auto weights = torch::tensor(p.at("weights").get<std::vector<double>>(), torch::kDouble);
    const auto want = c.at("indices").get<Indices>();
    const auto n = p.at("num_samples").get<std::int64_t>();
    data::WeightedSampler one(weights, {.num_replicas = 1, .rank = 0, .num_samples = n,
                                        .replacement = p.at("replacement").get<bool>(),
                                        .seed = p.at("seed").get<std::uint64_t>()});
    one.set_epoch(p.at("epoch").get<std::int64_t>());
    CHECK(one.indices() == want);
    // Three replicas: replica r takes draws r, r + 3, ..., padded from the start.
    for (std::int64_t r = 0; r < 3; ++r) {
      data::WeightedSampler part(weights, {.num_replicas = 3, .rank = r, .num_samples = n,
                                           .replacement = p.at("replacement").get<bool>(),
                                           .seed = p.at("seed").get<std::uint64_t>()});
      part.set_epoch(p.at("epoch").get<std::int64_t>());
      Indices expected;
      for (std::int64_t i = r; i < (n + 2) / 3 * 3; i += 3) expected.push_back(want[static_cast<std::size_t>(i % n)]);
      CHECK(part.indices() == expected);
      CHECK(part.size() == (n + 2) / 3);
    }
  }
  const auto w = torch::tensor({1.0, 0.0, 2.0}, torch::kDouble);
  CHECK(error_of([&] { data::WeightedSampler(w, {.num_replicas = 1, .rank = 0, .num_samples = 3, .replacement = false}); })
            .find("without replacement at most 2 samples") != std::string::npos);
  CHECK(error_of([] {
          data::WeightedSampler(torch::tensor({1.0, -1.0}, torch::kDouble), {.num_replicas = 1, .rank = 0});
        }).find("non-negative") != std::string::npos);
}

// ---- Loader -------------------------------------------------------------------------

namespace {

/// Sample i is the row [i]; each get() sleeps a pseudo-random 0-3 ms, so that workers
/// finish out of order; sample `broken` cannot be read.
struct Jittery {
  std::int64_t n = 40;
  std::int64_t broken = -1;
  mutable std::atomic<int> calls{0};
  [[nodiscard]] std::int64_t size() const { return n; }
  [[nodiscard]] paratrain::Batch get(const torch::Tensor& indices) const {
    const auto k = calls++;
    std::this_thread::sleep_for(std::chrono::microseconds((k * 7919) % 3000));
    for (std::int64_t i = 0; i < indices.numel(); ++i)
      if (indices[i].item<std::int64_t>() == broken)
        throw std::runtime_error("sample " + std::to_string(broken) + " is unreadable");
    return {indices.to(torch::kFloat).unsqueeze(1), indices.clone()};
  }
};
static_assert(paratrain::dataset<Jittery>);

std::vector<torch::Tensor> batches_of(const Indices& order, std::int64_t batch_size) {
  std::vector<torch::Tensor> out;
  for (auto&& b : data::batches(order, batch_size)) out.push_back(data::to_tensor(b));
  return out;
}

}  // namespace

TEST_CASE("Loader yields the sampler's batches in its order for 0 to 4 workers") {
  Jittery set;
  data::DistributedSampler sampler(set.size(), {.num_replicas = 1, .rank = 0, .seed = 9});
  const auto order = sampler.indices();
  for (int workers = 0; workers <= 4; ++workers) {
    for (int depth : {std::max(workers, 1), workers + 3}) {
      CAPTURE(workers);
      CAPTURE(depth);
      data::Loader loader(set, batches_of(order, 3), {.workers = workers, .depth = depth});
      CHECK(loader.size() == 14);
      Indices got;
      while (auto b = loader.next()) {
        CHECK(b->input().squeeze(1).to(torch::kLong).equal(b->target));
        for (std::int64_t i = 0; i < b->target.numel(); ++i) got.push_back(b->target[i].item<std::int64_t>());
      }
      CHECK(got == order);
      CHECK_FALSE(loader.next().has_value());
    }
  }
}

TEST_CASE("Loader surfaces a worker's error on the training thread, in order, naming the batch and the sample") {
  Jittery set;
  set.broken = 13;
  Indices order(40);
  std::iota(order.begin(), order.end(), 0);
  for (int workers : {0, 1, 3}) {
    CAPTURE(workers);
    data::Loader loader(set, batches_of(order, 5), {.workers = workers, .depth = 4});
    for (int k = 0; k < 2; ++k) CHECK(loader.next()->target[0].item<std::int64_t>() == 5 * k);  // before it: fine
    CHECK(error_of([&] { loader.next(); }) ==
          "paratrain: Loader: batch 2 of 8 (samples 10, 11, 12, 13 ...): sample 13: sample 13 is unreadable");
    CHECK(loader.next()->target[0].item<std::int64_t>() == 15);  // and after it, the next batch
  }
}

TEST_CASE("Loader stops its workers when dropped part-way, and rejects bad options") {
  Jittery set;
  set.n = 400;
  Indices order(400);
  std::iota(order.begin(), order.end(), 0);
  {
    data::Loader loader(set, batches_of(order, 2), {.workers = 3, .depth = 6});
    CHECK(loader.next().has_value());
  }  // must not wait for the other 199 batches
  CHECK(set.calls.load() < 20);
  CHECK(error_of([&] { data::Loader(set, {}, {.workers = 2, .depth = 1}); }).find("depth at least max(workers, 1)") !=
        std::string::npos);
  CHECK(error_of([&] { data::Loader(set, {}, {.workers = -1}); }).find("workers must be >= 0") != std::string::npos);
}

TEST_CASE("for_device has a GPU's batches pinned and copied beside the step; a GPU LibTorch cannot see is refused") {
  // Note [Copies beside the step]: set for a GPU only, and never in place of the caller's.
  const at::Device gpu0(at::kCUDA, 0), gpu1(at::kCUDA, 1);
  const auto on_cpu = data::for_device({.workers = 2, .depth = 3}, at::kCPU);
  CHECK_FALSE(on_cpu.pin_memory);
  CHECK_FALSE(on_cpu.device.has_value());
  CHECK(on_cpu.workers == 2);
  const auto on_gpu = data::for_device({.workers = 2, .depth = 3}, gpu0);
  CHECK(on_gpu.pin_memory);
  CHECK(on_gpu.device == std::optional<at::Device>(gpu0));
  CHECK(on_gpu.depth == 3);
  CHECK(data::for_device({.device = gpu1}, gpu0).device == std::optional<at::Device>(gpu1));

  // A device past the GPUs LibTorch sees: refused at construction, naming the option, the
  // device and the count (never a worker thread failing on its own); with no worker the
  // option has nothing to do.
  Jittery set;
  set.n = 8;
  const auto gpus = static_cast<int>(torch::cuda::device_count());
  const at::Device missing(at::kCUDA, static_cast<c10::DeviceIndex>(gpus));
  const auto message = error_of([&] { data::Loader(set, {torch::arange(4)}, {.workers = 1, .device = missing}); });
  CHECK(message.find("LoaderOptions::device is " + missing.str()) != std::string::npos);
  CHECK(message.find("sees " + std::to_string(gpus) + " GPU(s)") != std::string::npos);
  data::Loader on_host(set, {torch::arange(4)}, {.workers = 0, .device = missing});
  CHECK(on_host.next()->input().is_cpu());
}

// ---- fit with other datasets and samplers ---------------------------------------------

namespace {

Mlp make_net() { return paratrain_test::make_model({}, 0); }

data::TensorDataset make_data(std::int64_t n) {
  torch::manual_seed(1);
  return {torch::randn({n, 8}), torch::randint(0, 4, {n}, torch::kLong)};
}

/// A user's own dataset: the rows of a TensorDataset, each get() taking `delay`, as a read
/// from a file.
struct Slow {
  const data::TensorDataset* rows;
  std::chrono::microseconds delay{200};
  std::atomic<int>* reads = nullptr;  // where given: counts the reads that are done
  [[nodiscard]] std::int64_t size() const { return rows->size(); }
  [[nodiscard]] paratrain::Batch get(const torch::Tensor& indices) const {
    std::this_thread::sleep_for(delay);
    auto b = rows->get(indices);
    if (reads != nullptr) reads->fetch_add(1);
    return b;
  }
};

/// SGD over `steps` (each the union of the replicas' batch for that step) on one device,
/// step k at learning rate sgd.lr() * rate[k] where `rate` is given.
template <class Steps>
Mlp reference(const data::TensorDataset& train, const Steps& steps, const torch::optim::SGDOptions& sgd,
              const std::vector<double>& rate = {}) {
  auto net = make_net();
  torch::optim::SGD optim(net->parameters(), sgd);
  for (std::size_t k = 0; k < steps.size(); ++k) {
    const auto& step = steps[k];
    if (!rate.empty()) optim.param_groups()[0].options().set_lr(sgd.lr() * rate[k]);
    const auto b = train.get(torch::tensor(step, torch::kLong));
    optim.zero_grad();
    torch::nn::functional::cross_entropy(net->forward(b.input()), b.target).backward();
    optim.step();
  }
  return net;
}

void check_same(const Mlp& got, const Mlp& want) {
  const auto g = got->parameters(), w = want->parameters();
  for (std::size_t i = 0; i < g.size(); ++i)
    CHECK(((g[i] - w[i]).abs().max() / w[i].abs().max()).item<double>() <= 1e-5);
}

/// The global batches of an epoch: step k takes batch k of every replica's indices.
std::vector<Indices> global_steps(const std::vector<Indices>& shards, std::size_t batch) {
  std::vector<Indices> steps;
  std::size_t longest = 0;
  for (const auto& s : shards) longest = std::max(longest, s.size());
  for (std::size_t first = 0; first < longest; first += batch) {
    Indices step;
    for (const auto& s : shards)
      if (first < s.size()) step.insert(step.end(), s.begin() + first, s.begin() + std::min(first + batch, s.size()));
    steps.push_back(step);
  }
  return steps;
}

}  // namespace

TEST_CASE_TEMPLATE("fit<SequentialSampler> over a user's slow dataset trains like one device over the blocks", C,
                   comm::SingleDevice, comm::Mpi) {
  C c;
  const auto world = c.size();
  const auto rows = make_data(61);  // 61: the blocks differ in length for 2, 3 and 4 ranks
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  // A schedule: with blocks of different lengths the ranks must still step at one rate.
  const auto decay = [](double epoch) { return 1.0 / (1.0 + epoch); };
  paratrain::DataParallel<Mlp, C, torch::optim::SGD> s(make_net(), std::move(c), sgd);
  paratrain::fit<data::SequentialSampler>(s, Slow{&rows},
                                          {.epochs = 2, .batch_size = 4, .loader = {.workers = 2, .depth = 3},
                                           .lr_schedule = decay, .progress = false});
  // Rank r's block, from numpy.array_split's rule written out: 61 = q * world + m, the
  // first m blocks one longer.
  std::vector<Indices> shards;
  const std::int64_t q = 61 / world, m = 61 % world;
  for (std::int64_t r = 0, begin = 0; r < world; ++r) {
    const auto length = q + (r < m ? 1 : 0);
    Indices block(static_cast<std::size_t>(length));
    std::iota(block.begin(), block.end(), begin);
    shards.push_back(block);
    begin += length;
  }
  auto steps = global_steps(shards, 4);
  const auto epoch = steps;
  steps.insert(steps.end(), epoch.begin(), epoch.end());  // both epochs alike: no shuffling
  // Step k of epoch e is at e + k / (the epoch's global steps): the longest block's count.
  std::vector<double> rate;
  for (int e = 0; e < 2; ++e)
    for (std::size_t k = 0; k < epoch.size(); ++k) rate.push_back(decay(e + double(k) / double(epoch.size())));
  check_same(s.model(), reference(rows, steps, sgd, rate));
}

TEST_CASE("StepInfo::data_seconds is the step's wait for its batches: all of the read without workers, "
          "none of it where the worker had read ahead") {
  // No race with the clock: each read takes `delay` (a sleep, never shorter), and with a
  // worker each step returns only once the next batch has been read (or 10 s passed), so
  // steps 2..8 wait for a hand-over alone. The bounds are half a read either way, which a
  // loaded machine does not reach by chance (a 50 ms stall of one thread on every step).
  const auto rows = make_data(64);
  constexpr auto delay = std::chrono::milliseconds(100);
  const double read = 0.1;
  const auto wait_per_step = [&](int workers) {
    paratrain::DataParallel<Mlp, comm::SingleDevice, torch::optim::SGD> s(make_net(), comm::SingleDevice{},
                                                                        torch::optim::SGDOptions(0.01));
    std::vector<double> waits;
    std::atomic<int> reads{0};
    paratrain::fit(s, Slow{&rows, delay, &reads},
                   {.epochs = 1, .batch_size = 8, .loader = {.workers = workers},
                    .progress = false, .on_step = [&](const paratrain::StepInfo& i) {
                      CHECK(i.data_seconds <= i.seconds);
                      waits.push_back(i.data_seconds);
                      // Batches read once the next is, after fit's start read the data's
                      // first and last samples (Note [Same data on every rank]).
                      const int next = static_cast<int>(waits.size()) + 2;
                      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
                      while (workers > 0 && next <= 9 && reads.load() < next && std::chrono::steady_clock::now() < until)
                        std::this_thread::sleep_for(std::chrono::milliseconds(1));
                    }});
    REQUIRE(waits.size() == 8);
    return waits;
  };
  for (const double w : wait_per_step(0)) CHECK(w >= read);  // every read on the training thread
  const auto ahead = wait_per_step(1);
  CHECK(ahead.front() >= read / 2);  // the worker started its first read as the first step asked
  for (std::size_t k = 1; k < ahead.size(); ++k) {
    CAPTURE(k);
    CHECK(ahead[k] < read / 2);  // read during the previous step: a hand-over
  }
}

namespace {

/// Sample `broken` cannot be read (as from a damaged file); the rest are `rows`'.
struct Damaged {
  const data::TensorDataset* rows;
  std::int64_t broken;
  [[nodiscard]] std::int64_t size() const { return rows->size(); }
  [[nodiscard]] paratrain::Batch get(const torch::Tensor& indices) const {
    if ((indices == broken).any().item<bool>())
      throw std::runtime_error("sample " + std::to_string(broken) + ": bad checksum");
    return rows->get(indices);
  }
};

}  // namespace

TEST_CASE_TEMPLATE("A batch one rank cannot read is an error on every rank, in training and evaluation, not a hang",
                   Update, torch::optim::SGD, paratrain::Sharded<torch::optim::SGD, paratrain::zero::stage3>) {
  comm::Mpi c;
  const auto world = c.size(), rank = c.rank();
  const auto rows = make_data(40);
  // SequentialSampler: sample 3 is in rank 0's block only; batches of 2, so its second batch.
  paratrain::DataParallel<Mlp, comm::Mpi, Update> s(make_net(), c, torch::optim::SGDOptions(0.1));
  const auto trained = error_of([&] {
    paratrain::fit<data::SequentialSampler>(s, Damaged{&rows, 3}, {.epochs = 1, .batch_size = 2, .progress = false});
  });
  CAPTURE(trained);
  if (rank == 0)
    CHECK(trained == "paratrain: fit on rank 0: Loader: batch 1 of " + std::to_string(((40 + world - 1) / world + 1) / 2) +
                         " (samples 2, 3): sample 3: sample 3: bad checksum");
  else  // DDP's step status names how many ranks failed; ZeRO-3's agreement, which one
    CHECK((trained.find("1 other rank(s) were given a batch they cannot use") != std::string::npos ||
           trained.find("rank 0 failed: the batch's input 0 is undefined") != std::string::npos));
  // Evaluation: ExactSampler gives sample 5 to rank 5 % world.
  paratrain::DataParallel<Mlp, comm::Mpi, Update> t(make_net(), c, torch::optim::SGDOptions(0.1));
  const Damaged eval{&rows, 5};
  const auto evaluated = error_of([&] {
    paratrain::fit(t, rows, {.epochs = 1, .batch_size = 4, .eval = &eval, .eval_batch_size = 3, .progress = false});
  });
  CAPTURE(evaluated);
  const auto owner = 5 % world;
  CHECK(evaluated.find(rank == owner ? "paratrain: fit on rank " + std::to_string(rank) + ": Loader: batch "
                                     : "rank " + std::to_string(owner) + " failed: Loader: batch ") != std::string::npos);
  CHECK(evaluated.find("sample 5: bad checksum") != std::string::npos);
}

TEST_CASE("A sampler built by the caller for another replica or another dataset is an error on every rank") {
  comm::Mpi c;
  const auto world = c.size();
  const auto rows = make_data(50);
  paratrain::DataParallel<Mlp, comm::Mpi, torch::optim::SGD> s(make_net(), c, torch::optim::SGDOptions(0.1));
  // Every rank builds replica 0's sampler: wrong on every rank but rank 0.
  const auto replica = error_of([&] {
    paratrain::fit(s, rows, data::WeightedSampler(torch::ones({50}), {.num_replicas = world, .rank = 0}),
                   {.progress = false});
  });
  if (world > 1)
    CHECK(replica.find("the sampler was built for replica 0 of " + std::to_string(world) +
                       ", but this rank trains replica 1 of") != std::string::npos);
  else
    CHECK(replica.empty());
  const auto size = error_of([&] {
    paratrain::fit(s, rows,
                   data::WeightedSampler(torch::ones({49}), {.num_replicas = world, .rank = c.rank()}),
                   {.progress = false});
  });
  CHECK(size.find("the sampler deals out indices of 49 samples, but the training set holds 50") != std::string::npos);
}

TEST_CASE("fit with a WeightedSampler built by the caller trains on its draws, and evaluates a NpyDataset") {
  comm::Mpi c;
  const auto world = c.size(), rank = c.rank();
  const auto rows = make_data(50);
  const auto weights = torch::arange(50, torch::kDouble).remainder(5) + 0.5;
  const auto sgd = torch::optim::SGDOptions(0.1);
  paratrain::DataParallel<Mlp, comm::Mpi, torch::optim::SGD> s(make_net(), std::move(c), sgd);
  const auto options = [&](std::int64_t r) {
    return data::WeightedSampler::Options{.num_replicas = world, .rank = r, .num_samples = 40, .seed = 11};
  };
  const data::NpyDataset eval({test_data / "npy_x.npy"}, test_data / "npy_y.npy");
  // The .npy inputs are [11, 3, 2]: flattened and padded they fit the model's 8 inputs.
  struct Flat {
    const data::NpyDataset* set;
    [[nodiscard]] std::int64_t size() const { return set->size(); }
    [[nodiscard]] paratrain::Batch get(const torch::Tensor& i) const {
      auto b = set->get(i);
      return {torch::constant_pad_nd(b.input().flatten(1).div(1000), {0, 2}), b.target.remainder(4)};
    }
  } flat{&eval};
  const auto result = paratrain::fit(s, rows, data::WeightedSampler(weights, options(rank)),
                                     {.epochs = 2, .batch_size = 3, .eval = &flat, .progress = false});
  std::vector<Indices> steps;
  for (int epoch = 0; epoch < 2; ++epoch) {
    std::vector<Indices> shards;
    for (std::int64_t r = 0; r < world; ++r) {
      data::WeightedSampler w(weights, options(r));
      w.set_epoch(epoch);
      shards.push_back(w.indices());
    }
    const auto epoch_steps = global_steps(shards, 3);
    steps.insert(steps.end(), epoch_steps.begin(), epoch_steps.end());
  }
  auto want = reference(rows, steps, sgd);
  check_same(s.model(), want);
  // Evaluation on the user's dataset: every sample once, the single-device loss.
  torch::NoGradGuard no_grad;
  const auto all = flat.get(torch::arange(11, torch::kLong));
  const auto loss = torch::nn::functional::cross_entropy(want->forward(all.input()), all.target).item<double>();
  CHECK(result.epochs.back().eval_samples == 11);
  CHECK(result.epochs.back().eval_loss == doctest::Approx(loss).epsilon(1e-5));
}
