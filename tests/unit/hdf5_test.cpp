// data::Hdf5Dataset against files h5py wrote (tests/data/make_hdf5.py). Every value is
// checked against the formula the generator wrote it with, computed again here, never
// against the reader itself; the direct (pread) reads and HDF5's are each checked that way.

#include "paratrain/concepts/dataset.hpp"
#include "paratrain/data/hdf5/hdf5_dataset.hpp"
#include "paratrain/core/error.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "support/doctest.hpp"  // after LibTorch: see there
#include "support/test_data.hpp"

namespace {

using paratrain::data::Hdf5Dataset;
using Indices = std::vector<std::int64_t>;

static_assert(paratrain::dataset<Hdf5Dataset>);

const std::filesystem::path data_dir = paratrain_test::test_data_dir();
constexpr std::int64_t samples = 24;  // make_hdf5.py's N

// make_hdf5.py's formulas.
double x_of(std::int64_t i, std::int64_t j, std::int64_t k) { return static_cast<double>(i * 100 + j * 10 + k); }
std::int64_t code_of(std::int64_t i, std::int64_t j) { return (i * 37 + j) % 256; }
std::int64_t y_of(std::int64_t i) { return i * 10'000'000'000 + 1; }
std::int64_t flag_of(std::int64_t i) { return i % 3 == 0 ? 1 : 0; }

at::Tensor tensor_of(const Indices& idx) { return at::tensor(at::ArrayRef<std::int64_t>(idx), at::kLong); }

// "" when `t` holds `dtype`, shape [idx.size(), rest...] and `want(i, j)` in row r, element
// j of its flattened sample, i = idx[r]; else the first difference.
std::string first_wrong(const at::Tensor& t, at::ScalarType dtype, std::vector<std::int64_t> rest, const Indices& idx,
                        const std::function<double(std::int64_t i, std::int64_t j)>& want) {
  std::vector<std::int64_t> shape{static_cast<std::int64_t>(idx.size())};
  shape.insert(shape.end(), rest.begin(), rest.end());
  std::ostringstream out;
  if (t.scalar_type() != dtype || t.sizes() != at::IntArrayRef(shape)) {
    out << "got " << t.scalar_type() << " " << t.sizes() << ", want " << dtype << " " << at::IntArrayRef(shape);
    return out.str();
  }
  std::int64_t per_row = 1;
  for (auto s : rest) per_row *= s;
  const auto flat = t.to(at::kDouble).contiguous();
  const auto* v = flat.data_ptr<double>();
  for (std::size_t r = 0; r < idx.size(); ++r) {
    for (std::int64_t j = 0; j < per_row; ++j) {
      const double got = v[static_cast<std::int64_t>(r) * per_row + j], expected = want(idx[r], j);
      if (got != expected) {
        out << "row " << r << " (sample " << idx[r] << "), element " << j << ": got " << got << ", want " << expected;
        return out.str();
      }
    }
  }
  return {};
}

std::string first_wrong_x(const at::Tensor& x, const Indices& idx) {
  return first_wrong(x, at::kFloat, {3, 4}, idx, [](auto i, auto j) { return x_of(i, j / 4, j % 4); });
}
std::string first_wrong_y(const at::Tensor& y, const Indices& idx) {
  // Beyond 2^53 the doubles would round: y stays below 24 * 10^10.
  return first_wrong(y, at::kLong, {}, idx, [](auto i, auto) { return static_cast<double>(y_of(i)); });
}

// x, code and flag as inputs and labels/y as the target, each against its formula.
std::string first_wrong_batch(const paratrain::Batch& b, const Indices& idx) {
  if (b.inputs.size() != 3) return "got " + std::to_string(b.inputs.size()) + " inputs, want 3";
  for (auto s : {first_wrong_x(b.inputs[0], idx),
                 first_wrong(b.inputs[1], at::kByte, {2}, idx,
                             [](auto i, auto j) { return static_cast<double>(code_of(i, j)); }),
                 first_wrong(b.inputs[2], at::kByte, {}, idx,
                             [](auto i, auto) { return static_cast<double>(flag_of(i)); }),
                 first_wrong_y(b.target, idx)})
    if (!s.empty()) return s;
  return {};
}

Hdf5Dataset open_main(const std::string& file, bool direct) {
  return Hdf5Dataset(data_dir / file, {"x", "code", "flag"}, "labels/y", {.direct_reads = direct});
}

Indices random_indices(std::uint32_t seed, std::size_t n) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<std::int64_t> pick(0, samples - 1);
  Indices idx(n);
  for (auto& i : idx) i = pick(rng);
  return idx;
}

// The batches every reader must get right: runs of consecutive indices that cross the
// chunked file's chunks of 5, repeats, descending and unsorted orders, one sample, none.
std::vector<Indices> index_lists() {
  Indices all(samples);
  for (std::int64_t i = 0; i < samples; ++i) all[static_cast<std::size_t>(i)] = i;
  return {
      random_indices(1, 40),         // random, with repeats
      {3, 3, 3, 7, 3},               // repeated
      {20, 2, 11, 0, 23, 5},         // unsorted
      {4, 5, 6, 7, 8, 9, 10, 11},    // consecutive, across chunks
      {9, 8, 7, 6},                  // descending: no run
      {0, 1, 2, 10, 11, 1, 2, 3, 23},  // runs that restart
      {23},
      all,
      {},
  };
}

// The message of the paratrain::error `f` throws, after checking its operation and rank.
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const paratrain::error& e) {
    CHECK(e.operation() == "Hdf5Dataset");
    CHECK(e.rank() == -1);
    return e.what();
  }
  return "(nothing thrown)";
}

void check_says(const std::string& message, std::initializer_list<std::string_view> parts) {
  INFO("message: ", message);
  for (auto part : parts) CHECK(message.find(part) != std::string::npos);
}

}  // namespace

TEST_CASE("Hdf5Dataset: contiguous and chunked datasets read as written, with pread and through HDF5") {
  for (const std::string file : {"hdf5_contiguous.h5", "hdf5_chunked.h5"}) {
    for (bool direct : {true, false}) {
      CAPTURE(file);
      CAPTURE(direct);
      const auto d = open_main(file, direct);
      CHECK(d.size() == samples);
      REQUIRE(d.inputs().size() == 3);
      CHECK(d.inputs()[0].name == "x");
      CHECK(d.inputs()[0].sizes == std::vector<std::int64_t>{samples, 3, 4});
      CHECK((d.inputs()[1].dtype == at::kByte));  // parenthesised: c10::toString(ScalarType) confuses doctest
      CHECK((d.inputs()[2].dtype == at::kByte));  // h5py's bool
      CHECK(d.target().name == "labels/y");
      CHECK((d.target().dtype == at::kLong));
      // pread only where asked for and where the layout allows: Note [Reading HDF5 without its lock]
      const bool expect_direct = direct && file == "hdf5_contiguous.h5";
      for (const auto& a : d.inputs()) CHECK(a.direct == expect_direct);
      CHECK(d.target().direct == expect_direct);
      for (const auto& idx : index_lists()) {
        CAPTURE(idx.size());
        CHECK(first_wrong_batch(d.get(tensor_of(idx)), idx) == "");
      }
    }
  }
}

TEST_CASE("Hdf5Dataset: compact datasets and never-written ones read through HDF5") {
  const Hdf5Dataset d(data_dir / "hdf5_contiguous.h5", {"compact", "unwritten"}, "labels/y");
  CHECK_FALSE(d.inputs()[0].direct);  // compact: in the object header
  CHECK_FALSE(d.inputs()[1].direct);  // no storage: the fill value
  CHECK(d.target().direct);
  for (const auto& idx : index_lists()) {
    CAPTURE(idx.size());
    const auto b = d.get(tensor_of(idx));
    CHECK(first_wrong(b.inputs[0], at::kShort, {}, idx, [](auto i, auto) { return -static_cast<double>(i); }) == "");
    CHECK(first_wrong(b.inputs[1], at::kFloat, {2}, idx, [](auto, auto) { return 7.5; }) == "");
    CHECK(first_wrong_y(b.target, idx) == "");
  }
}

TEST_CASE("Hdf5Dataset: big-endian datasets are converted, and offsets count the user block") {
  for (bool direct : {true, false}) {
    CAPTURE(direct);
    const Hdf5Dataset big(data_dir / "hdf5_big_endian.h5", {"x", "x_chunked"}, "labels/y", {.direct_reads = direct});
    CHECK(big.inputs()[0].direct == direct);
    CHECK_FALSE(big.inputs()[1].direct);
    CHECK(big.target().direct == direct);
    const Hdf5Dataset block(data_dir / "hdf5_userblock.h5", {"x"}, "labels/y", {.direct_reads = direct});
    CHECK(block.inputs()[0].direct == direct);
    for (const auto& idx : index_lists()) {
      CAPTURE(idx.size());
      const auto b = big.get(tensor_of(idx));
      CHECK(first_wrong_x(b.inputs[0], idx) == "");
      CHECK(first_wrong_x(b.inputs[1], idx) == "");
      CHECK(first_wrong_y(b.target, idx) == "");
      const auto u = block.get(tensor_of(idx));
      CHECK(first_wrong_x(u.inputs[0], idx) == "");
      CHECK(first_wrong_y(u.target, idx) == "");
    }
  }
}

TEST_CASE("Hdf5Dataset: every error names the file, the dataset and what is wrong") {
  const auto file = data_dir / "hdf5_contiguous.h5";
  const auto open = [&](std::vector<std::string> inputs, std::string target) {
    return error_of([&] { Hdf5Dataset(file, std::move(inputs), std::move(target)); });
  };
  check_says(error_of([&] { Hdf5Dataset(data_dir / "no_such.h5", {"x"}, "labels/y"); }),
             {"paratrain: Hdf5Dataset: ", "no_such.h5: no such file"});
  check_says(error_of([&] { Hdf5Dataset(data_dir / "sampler_reference.json", {"x"}, "labels/y"); }),
             {"sampler_reference.json: not an HDF5 file"});
  check_says(error_of([&] { Hdf5Dataset(data_dir, {"x"}, "labels/y"); }), {"not a regular file"});
  // HDF5's own reason comes along.
  check_says(open({"x", "nope"}, "labels/y"), {"hdf5_contiguous.h5: has no dataset 'nope'", "doesn't exist"});
  check_says(open({"x"}, "labels"), {"has no dataset 'labels'", "not a dataset"});  // a group
  check_says(open({"x"}, "short"),
             {"hdf5_contiguous.h5: dataset 'short' holds 23 samples (its dimension 0) and 'x' 24"});
  check_says(open({"text"}, "labels/y"),
             {"dataset 'text' has elements of type variable-length string, which Hdf5Dataset cannot read"});
  check_says(open({"x"}, "u16"), {"dataset 'u16' has elements of type uint16, which Hdf5Dataset cannot read"});
  check_says(open({"scalar"}, "labels/y"), {"dataset 'scalar' is a scalar"});
  check_says(open({}, "labels/y"), {"no inputs"});
  check_says(open({"x"}, ""), {"no target"});

  for (bool direct : {true, false}) {
    CAPTURE(direct);
    const auto d = open_main("hdf5_chunked.h5", direct);
    check_says(error_of([&] { (void)d.get(tensor_of({0, 5, 24})); }),
               {"hdf5_chunked.h5: sample 24 asked for (position 2 of the batch)",
                "datasets 'x', 'code', 'flag', 'labels/y' hold 24 samples, 0 to 23"});
    check_says(error_of([&] { (void)d.get(tensor_of({-1})); }), {"sample -1 asked for (position 0"});
    check_says(error_of([&] { (void)d.get(tensor_of({1, 2}).view({2, 1})); }), {"a 1-D int64 CPU tensor"});
    // int32 indices read as int64 ones do, as index_select takes both (detail::check_sample_indices).
    CHECK(d.get(tensor_of({3, 4}).to(at::kInt)).target.equal(d.get(tensor_of({3, 4})).target));
  }
}

TEST_CASE("Hdf5Dataset: HDF5 prints nothing of its own, on any thread") {
  // HDF5 prints its error stack per thread: a fresh thread is where it would show.
  const auto log = std::filesystem::temp_directory_path() / ("paratrain_hdf5_stderr_" + std::to_string(::getpid()));
  const int into = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  REQUIRE(into >= 0);
  std::fflush(stderr);
  const int saved = ::dup(2);
  ::dup2(into, 2);
  std::string message;
  std::thread([&] {
    message = error_of([] { Hdf5Dataset(data_dir / "hdf5_contiguous.h5", {"nope"}, "labels/y"); });
  }).join();
  std::fflush(stderr);
  ::dup2(saved, 2);
  ::close(saved);
  ::close(into);
  std::ifstream in(log);
  const std::string printed{std::istreambuf_iterator<char>(in), {}};
  std::filesystem::remove(log);
  check_says(message, {"has no dataset 'nope'"});
  CHECK(printed == "");
}

TEST_CASE("Hdf5Dataset: four threads at once read the right samples, with pread and through HDF5") {
  for (const std::string file : {"hdf5_contiguous.h5", "hdf5_chunked.h5"}) {
    for (bool direct : {true, false}) {
      CAPTURE(file);
      CAPTURE(direct);
      std::optional<Hdf5Dataset> original = open_main(file, direct);
      std::vector<std::string> wrong(4);
      const auto work = [&wrong](std::uint32_t t, const Hdf5Dataset& data) {
        try {
          for (std::uint32_t round = 0; round < 50 && wrong[t].empty(); ++round) {
            const auto idx = random_indices(100 * t + round, 16);
            wrong[t] = first_wrong_batch(data.get(tensor_of(idx)), idx);
          }
        } catch (const std::exception& e) {
          wrong[t] = e.what();
        }
      };
      // Two threads share one dataset; two read through copies of it, which share its file
      // (whichever is destroyed last closes it, here or on its thread).
      std::vector<std::thread> threads;
      threads.emplace_back(work, 0, std::cref(*original));
      threads.emplace_back(work, 1, std::cref(*original));
      threads.emplace_back([work, copy = *original] { work(2, copy); });
      threads.emplace_back([work, copy = *original] { work(3, copy); });
      threads[0].join();
      threads[1].join();
      original.reset();
      threads[2].join();
      threads[3].join();
      for (const auto& w : wrong) CHECK(w == "");
    }
  }
}
