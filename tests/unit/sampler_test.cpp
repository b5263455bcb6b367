// Samplers and batching. DistributedSampler is checked against indices recorded from
// PyTorch 1.13 by tests/data/make_sampler_reference.py; ExactSampler and batches()
// against properties and counts written out by hand.

#include "paratrain/concepts/sampler.hpp"
#include "paratrain/data/batches.hpp"
#include "paratrain/data/distributed_sampler.hpp"
#include "paratrain/data/exact_sampler.hpp"
#include "paratrain/core/error.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "support/doctest.hpp"  // after LibTorch: see there
#include "support/sampler_reference.hpp"
#include "support/test_data.hpp"

namespace {

using paratrain::data::batches;
using paratrain::data::DistributedSampler;
using paratrain::data::ExactSampler;
using paratrain::data::to_tensor;
using Indices = std::vector<std::int64_t>;

struct NoEpoch {
  [[nodiscard]] Indices indices() const { return {}; }
  [[nodiscard]] std::int64_t size() const { return 0; }
};
struct StringIndices {
  [[nodiscard]] std::vector<std::string> indices() const { return {}; }
  [[nodiscard]] std::int64_t size() const { return 0; }
  void set_epoch(std::int64_t) {}
};

static_assert(paratrain::sampler<DistributedSampler>);
static_assert(paratrain::sampler<ExactSampler>);
static_assert(!paratrain::sampler<NoEpoch>, "a sampler must take set_epoch");
static_assert(!paratrain::sampler<StringIndices>, "a sampler's indices must be integers");
static_assert(!paratrain::sampler<int>);

template <class V>
concept batchable = requires(V&& v) { batches(std::forward<V>(v), 1); };
static_assert(batchable<const Indices&>);
static_assert(!batchable<Indices>, "batches() of a temporary vector would dangle");

// Where two index lists first differ, for a failure message short enough to read.
std::string first_difference(const Indices& got, const Indices& want) {
  std::ostringstream out;
  out << "got " << got.size() << " indices, want " << want.size();
  for (std::size_t i = 0; i < got.size() && i < want.size(); ++i) {
    if (got[i] != want[i]) {
      out << "; first difference at " << i << ": got " << got[i] << ", want " << want[i];
      break;
    }
  }
  return out.str();
}

nlohmann::json load_reference() {
  const std::string path = (paratrain_test::test_data_dir() / paratrain_test::sampler_reference_file()).string();
  std::ifstream file(path);
  REQUIRE_MESSAGE(file.good(), "cannot open " << path
                                              << "; regenerate it with tests/data/make_sampler_reference.py");
  return nlohmann::json::parse(file);
}

template <class Sampler>
std::vector<Indices> all_ranks(std::int64_t n, std::int64_t replicas) {
  std::vector<Indices> shards;
  for (std::int64_t r = 0; r < replicas; ++r) {
    shards.push_back(Sampler(n, {.num_replicas = replicas, .rank = r}).indices());
  }
  return shards;
}

std::vector<std::int64_t> batch_sizes(const Indices& indices, std::int64_t batch_size, bool drop_last) {
  std::vector<std::int64_t> sizes;
  for (auto batch : batches(indices, batch_size, drop_last)) {
    sizes.push_back(to_tensor(batch).numel());
  }
  return sizes;
}

}  // namespace

TEST_CASE("DistributedSampler yields what PyTorch's DistributedSampler yields") {
  const auto reference = load_reference();
  const auto& cases = reference.at("cases");
  REQUIRE(cases.size() >= 60);

  for (const auto& c : cases) {
    const auto& p = c.at("params");
    const std::string params = p.dump();
    INFO("PyTorch case ", params);
    auto sampler = DistributedSampler(p.at("dataset_size").get<std::int64_t>(),
                                      {.num_replicas = p.at("num_replicas").get<std::int64_t>(),
                                       .rank = p.at("rank").get<std::int64_t>(),
                                       .shuffle = p.at("shuffle").get<bool>(),
                                       .seed = p.at("seed").get<std::uint64_t>(),
                                       .drop_last = p.at("drop_last").get<bool>()});
    sampler.set_epoch(p.at("epoch").get<std::int64_t>());

    CHECK(sampler.size() == c.at("num_samples").get<std::int64_t>());
    CHECK(sampler.total_size() == c.at("total_size").get<std::int64_t>());
    const auto want = c.at("indices").get<Indices>();
    const auto got = sampler.indices();
    CHECK_MESSAGE(got == want, first_difference(got, want));
    // A second call must not advance any generator state.
    const auto again = sampler.indices();
    CHECK_MESSAGE(again == want, first_difference(again, want));
  }
}

TEST_CASE("DistributedSampler draws a new order only when the epoch changes") {
  // Seed 42, epochs 0 and 1 of PyTorch's randperm(10), recorded by hand:
  // torch.randperm(10, generator=torch.Generator().manual_seed(42 + e)).tolist()
  auto sampler = DistributedSampler(10, {.num_replicas = 1, .rank = 0, .seed = 42});
  const auto epoch0 = sampler.indices();
  sampler.set_epoch(1);
  const auto epoch1 = sampler.indices();
  CHECK(epoch0 == Indices{2, 6, 1, 8, 4, 5, 0, 9, 3, 7});
  CHECK(epoch1 == Indices{8, 4, 9, 0, 5, 1, 6, 7, 2, 3});
  sampler.set_epoch(0);
  CHECK(sampler.indices() == epoch0);
}

TEST_CASE("ExactSampler gives every index to exactly one rank") {
  for (std::int64_t n : {0, 1, 2, 3, 7, 10, 11, 17, 64, 100, 1001}) {
    for (std::int64_t replicas = 1; replicas <= 9; ++replicas) {
      INFO("dataset_size ", n, ", num_replicas ", replicas);
      std::map<std::int64_t, int> seen;
      std::int64_t smallest = n;
      std::int64_t largest = 0;
      const auto shards = all_ranks<ExactSampler>(n, replicas);
      for (std::int64_t r = 0; r < replicas; ++r) {
        const auto& shard = shards[static_cast<std::size_t>(r)];
        const auto size = ExactSampler(n, {.num_replicas = replicas, .rank = r}).size();
        CHECK(size == static_cast<std::int64_t>(shard.size()));
        smallest = std::min(smallest, size);
        largest = std::max(largest, size);
        for (std::size_t k = 0; k < shard.size(); ++k) {
          // Strided: the k-th index of rank r is r + k * N.
          CHECK(shard[k] == r + static_cast<std::int64_t>(k) * replicas);
          ++seen[shard[k]];
        }
      }
      CHECK(static_cast<std::int64_t>(seen.size()) == n);
      for (const auto& [index, count] : seen) {
        CHECK(index >= 0);
        CHECK(index < n);
        CHECK(count == 1);
      }
      CHECK(largest - smallest <= 1);
    }
  }
}

TEST_CASE("ExactSampler shards ten samples over four ranks as r, r+4, r+8") {
  const auto shards = all_ranks<ExactSampler>(10, 4);
  CHECK(shards[0] == Indices{0, 4, 8});
  CHECK(shards[1] == Indices{1, 5, 9});
  CHECK(shards[2] == Indices{2, 6});
  CHECK(shards[3] == Indices{3, 7});
  CHECK(all_ranks<ExactSampler>(2, 4)[3].empty());
}

TEST_CASE("batches cuts indices into batch_size pieces, dropping a short last one on request") {
  const Indices ten{10, 11, 12, 13, 14, 15, 16, 17, 18, 19};
  using Sizes = std::vector<std::int64_t>;
  CHECK(batch_sizes(ten, 3, false) == Sizes{3, 3, 3, 1});
  CHECK(batch_sizes(ten, 3, true) == Sizes{3, 3, 3});
  CHECK(batch_sizes(ten, 5, false) == Sizes{5, 5});
  CHECK(batch_sizes(ten, 5, true) == Sizes{5, 5});
  CHECK(batch_sizes(ten, 1, true) == Sizes(10, 1));
  CHECK(batch_sizes(ten, 32, false) == Sizes{10});
  CHECK(batch_sizes(ten, 32, true).empty());
  CHECK(batch_sizes({}, 4, false).empty());

  // The batches hold the indices themselves, in order, as int64 tensors.
  Indices joined;
  for (auto batch : batches(ten, 4)) {
    const auto tensor = to_tensor(batch);
    // Compared outside CHECK: doctest would print a ScalarType through c10::toString,
    // which it finds by ADL but which returns a const char*, not a doctest::String.
    const bool is_int64 = tensor.scalar_type() == at::kLong;
    CHECK(is_int64);
    CHECK(tensor.dim() == 1);
    const auto* data = tensor.data_ptr<std::int64_t>();
    joined.insert(joined.end(), data, data + tensor.numel());
  }
  CHECK(joined == ten);
}

TEST_CASE("bad arguments throw paratrain::error naming the fix") {
  using DOptions = DistributedSampler::Options;
  using EOptions = ExactSampler::Options;
  const auto world = doctest::Contains("set Options::num_replicas to the number of processes");
  const auto rank = doctest::Contains("set Options::rank to this process's rank, in [0, 3]");
  const auto size = doctest::Contains("pass the number of samples in the dataset, 0 or more");

  CHECK_THROWS_AS(DistributedSampler(10, DOptions{.num_replicas = 0, .rank = 0}), paratrain::error);
  CHECK_THROWS_WITH_AS(DistributedSampler(10, DOptions{.num_replicas = 0, .rank = 0}), world, paratrain::error);
  CHECK_THROWS_WITH_AS(DistributedSampler(10, DOptions{.num_replicas = -2, .rank = 0}), world, paratrain::error);
  CHECK_THROWS_WITH_AS(DistributedSampler(10, DOptions{.rank = 0}), world, paratrain::error);
  CHECK_THROWS_WITH_AS(DistributedSampler(10, DOptions{.num_replicas = 4, .rank = 4}), rank, paratrain::error);
  CHECK_THROWS_WITH_AS(DistributedSampler(10, DOptions{.num_replicas = 4, .rank = -1}), rank, paratrain::error);
  CHECK_THROWS_WITH_AS(DistributedSampler(10, DOptions{.num_replicas = 4}), rank, paratrain::error);
  CHECK_THROWS_WITH_AS(DistributedSampler(-1, DOptions{.num_replicas = 4, .rank = 1}), size, paratrain::error);

  CHECK_THROWS_WITH_AS(ExactSampler(10, EOptions{.num_replicas = 0, .rank = 0}), world, paratrain::error);
  CHECK_THROWS_WITH_AS(ExactSampler(10, EOptions{.num_replicas = 4, .rank = 4}), rank, paratrain::error);
  CHECK_THROWS_WITH_AS(ExactSampler(10, EOptions{.num_replicas = 4}), rank, paratrain::error);
  CHECK_THROWS_WITH_AS(ExactSampler(-5, EOptions{.num_replicas = 4, .rank = 3}), size, paratrain::error);

  const Indices ten(10, 0);
  const auto batch = doctest::Contains("pass a batch_size of at least 1");
  CHECK_THROWS_WITH_AS(batches(ten, 0), batch, paratrain::error);
  CHECK_THROWS_WITH_AS(batches(ten, -3, true), batch, paratrain::error);

  // The error says which sampler failed, and on which rank when the rank is valid.
  try {
    DistributedSampler(-1, {.num_replicas = 4, .rank = 2});
    FAIL("a negative dataset_size was accepted");
  } catch (const paratrain::error& e) {
    CHECK(e.operation() == "DistributedSampler");
    CHECK(e.rank() == 2);
  }
}
