// paratrain::plan against the ZeRO paper's Table 1 (Rajbhandari et al. 2019, arXiv:1910.02054).
// Its own executable: plan/plan.hpp needs neither MPI nor LibTorch, and neither does this test.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <paratrain/plan/plan.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace plan = paratrain::plan;

namespace {

// Table 1 prints GB rounded half up to the digits shown ("41.3" for 41.25, "1.88" for
// 1.875): a computed value matches a printed one when it rounds to it.
bool prints_as(double bytes, std::string_view published) {
  const auto dot = published.find('.');
  const int decimals = dot == std::string_view::npos ? 0 : static_cast<int>(published.size() - dot - 1);
  const double scale = std::pow(10.0, decimals);
  const double shown = std::floor(bytes / 1e9 * scale + 0.5) / scale;
  return std::fabs(shown - std::stod(std::string(published))) < 0.5 / scale;
}

// One row of Table 1: GB per device for P_os, P_os+g, P_os+g+p; "" for a cell left out.
struct Row {
  double parameters;
  std::int64_t ranks;
  std::string_view os, os_g, os_g_p;
};

// Every cell of the 7.5B column. Of the 128B and 1T columns, the cells whose formula value
// is exact at the printed precision: the paper prints some others truncated to whole GB
// (e.g. 128B at N_d = 1024, P_os: 513.5 GB), and those are not asserted here.
const std::vector<Row> table_1{
    {7.5e9, 1, "120", "120", "120"},
    {7.5e9, 4, "52.5", "41.3", "30"},
    {7.5e9, 16, "35.6", "21.6", "7.5"},
    {7.5e9, 64, "31.4", "16.6", "1.88"},
    {7.5e9, 256, "30.4", "15.4", "0.47"},
    {7.5e9, 1024, "30.1", "15.1", "0.12"},
    {128e9, 1, "2048", "2048", "2048"},
    {128e9, 4, "896", "704", "512"},
    {128e9, 16, "608", "368", "128"},
    {128e9, 64, "536", "284", "32"},
    {128e9, 256, "518", "263", "8"},
    {128e9, 1024, "", "", "2"},
    {1e12, 1, "16000", "16000", "16000"},
    {1e12, 4, "7000", "5500", "4000"},
    {1e12, 16, "4750", "2875", "1000"},
    {1e12, 64, "", "", "250"},
    {1e12, 256, "", "", "62.5"},
    {1e12, 1024, "", "", "15.6"},
};

// The paper's setting: mixed-precision Adam, B_p = B_g = 2, K = 12.
plan::Model paper_model(double parameters, std::int64_t ranks) {
  return {.parameters = parameters,
          .param_bytes = plan::mixed.param_bytes,
          .grad_bytes = plan::mixed.grad_bytes,
          .optimizer_bytes = plan::optimizer_bytes("adam", plan::mixed),
          .ranks = ranks};
}

}  // namespace

TEST_CASE("plan: the ZeRO paper's Table 1") {
  for (const Row& row : table_1) {
    const auto m = paper_model(row.parameters, row.ranks);
    CAPTURE(row.parameters);
    CAPTURE(row.ranks);
    const std::pair<plan::stage, std::string_view> cells[] = {
        {plan::stage::stage1, row.os}, {plan::stage::stage2, row.os_g}, {plan::stage::stage3, row.os_g_p}};
    for (const auto& [s, published] : cells) {
      if (published.empty()) continue;
      CAPTURE(plan::to_string(s));
      CAPTURE(published);
      CHECK(prints_as(plan::per_rank(m, s).total(), published));
    }
    // Baseline DDP is the N_d = 1 row, whatever N_d: 16 Ψ bytes.
    CHECK(plan::per_rank(m, plan::stage::ddp).total() == doctest::Approx(16 * row.parameters));
  }
}

TEST_CASE("plan: the paper's headline numbers at 7.5B parameters") {
  const auto at64 = plan::per_rank(paper_model(7.5e9, 64));
  CHECK(prints_as(at64[0].total(), "120"));
  CHECK(prints_as(at64[1].total(), "31.4"));
  CHECK(prints_as(at64[2].total(), "16.6"));
  CHECK(prints_as(at64[3].total(), "1.88"));
  // The split behind P_os: 2Ψ + 2Ψ + 12Ψ/N_d.
  CHECK(at64[1].parameters == 15e9);
  CHECK(at64[1].gradients == 15e9);
  CHECK(at64[1].optimizer_state == 90e9 / 64);
  CHECK(at64[3].parameters == 15e9 / 64);
  for (const auto& r : at64) CHECK(r.activations == 0);
  for (const auto& r : at64) CHECK(r.padding == 0);
}

TEST_CASE("plan: K of LibTorch's optimizers") {
  CHECK(plan::optimizer_bytes("sgd") == 0);
  CHECK(plan::optimizer_bytes("sgd_momentum") == 4);
  CHECK(plan::optimizer_bytes("adam") == 8);
  CHECK(plan::optimizer_bytes("adamw") == 8);
  CHECK(plan::optimizer_bytes("adagrad") == 4);
  CHECK(plan::optimizer_bytes("rmsprop") == 4);
  CHECK(plan::optimizer_bytes("rmsprop_momentum") == 8);
  // Mixed precision adds the fp32 master copy: the paper's K = 12 for Adam.
  CHECK(plan::optimizer_bytes("adam", plan::mixed) == 12);
  CHECK(plan::optimizer_bytes("sgd", plan::mixed) == 4);
  CHECK_THROWS_WITH_AS((void)plan::optimizer_bytes("lamb"), doctest::Contains("use one of sgd, sgd_momentum, adam"),
                       paratrain::error);
}

TEST_CASE("plan: activations are per rank and never sharded") {
  auto m = paper_model(7.5e9, 64);
  m.activation_bytes = 2.0 * 1024 * 1024 * 1024;
  const auto without = plan::per_rank(paper_model(7.5e9, 64));
  const auto with = plan::per_rank(m);
  for (std::size_t i = 0; i < with.size(); ++i) {
    CHECK(with[i].activations == m.activation_bytes);
    CHECK(with[i].total() == doctest::Approx(without[i].total() + m.activation_bytes));
  }
}

TEST_CASE("plan: fp32 Adam in LibTorch") {
  // 1e9 parameters, fp32 weights and gradients, Adam's two moments: 16 bytes each under DDP.
  const plan::Model m{.parameters = 1e9, .optimizer_bytes = plan::optimizer_bytes("adam"), .ranks = 8};
  CHECK(plan::per_rank(m, plan::stage::ddp).total() == 16e9);
  CHECK(plan::per_rank(m, plan::stage::stage1).total() == 8e9 + 1e9);
  CHECK(plan::per_rank(m, plan::stage::stage2).total() == 4e9 + 1.5e9);
  CHECK(plan::per_rank(m, plan::stage::stage3).total() == 2e9);
}

TEST_CASE("plan: bf16 autocast adds its weight copies at every stage; bf16 reduction halves the gradient bytes") {
  // fp32 Adam as above, under bf16 autocast: 2 bytes of copies per parameter, never sharded.
  plan::Model m{.parameters = 1e9, .optimizer_bytes = plan::optimizer_bytes("adam"), .ranks = 8};
  auto mixed = m;
  mixed.autocast_bytes = 2;
  for (const auto s : plan::stages) {
    CHECK(plan::per_rank(mixed, s).autocast_copies == 2e9);
    CHECK(plan::per_rank(mixed, s).total() == plan::per_rank(m, s).total() + 2e9);
  }
  // Gradients sent per step: Ψ elements of grad_bytes, or of reduce_bytes; the ZeRO stages
  // pad each of 3 buckets by at most N - 1 = 7 elements.
  m.buckets = 3;
  CHECK(plan::gradient_traffic(m, plan::stage::ddp) == 4e9);
  CHECK(plan::gradient_traffic(m, plan::stage::stage2) == 4 * (1e9 + 21));
  m.reduce_bytes = 2;
  CHECK(plan::gradient_traffic(m, plan::stage::ddp) == 2e9);
  CHECK(plan::gradient_traffic(m, plan::stage::stage3) == 2 * (1e9 + 21));
}

TEST_CASE("plan: the padding bound holds for real shards, and is reached") {
  // Shards computed element by element: a bucket of E elements is padded to
  // ceil(E / N) * N; a rank holding it whole holds all of that, a shard holder ceil(E / N).
  const std::int64_t n = 8;
  const plan::Model base{.parameters = 0, .param_bytes = 2, .grad_bytes = 2, .optimizer_bytes = 12, .ranks = n};
  for (const std::vector<std::int64_t>& buckets : {std::vector<std::int64_t>{1, 9, 17}, {8, 16, 800}, {5, 1000, 3}}) {
    std::int64_t elements = 0;
    double whole_extra = 0, shard_extra = 0;
    for (const std::int64_t e : buckets) {
      const std::int64_t shard = (e + n - 1) / n;
      elements += e;
      whole_extra += static_cast<double>(shard * n - e);
      shard_extra += static_cast<double>(shard) - static_cast<double>(e) / static_cast<double>(n);
    }
    auto m = base;
    m.parameters = static_cast<double>(elements);
    m.buckets = static_cast<std::int64_t>(buckets.size());
    const double actual[] = {
        0,                                  // DDP: not padded
        2 * whole_extra + 2 * whole_extra + 12 * shard_extra,  // stage 1
        2 * whole_extra + 2 * shard_extra + 12 * shard_extra,  // stage 2
        (2 + 2 + 12) * shard_extra,                            // stage 3
    };
    const auto rows = plan::per_rank(m);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      CAPTURE(i);
      CHECK(actual[i] <= rows[i].padding + 1e-9);
      // Buckets of 1, 9 and 17 elements are each one past a multiple of 8: the worst case.
      if (buckets.front() == 1) CHECK(actual[i] == doctest::Approx(rows[i].padding));
    }
  }
}

TEST_CASE("plan: invalid input names the field and the fix") {
  const auto m = paper_model(7.5e9, 64);
  auto bad = m;
  bad.ranks = 0;
  CHECK_THROWS_WITH_AS((void)plan::per_rank(bad, plan::stage::stage1),
                       doctest::Contains("Model::ranks is 0; the data-parallel degree N_d must be at least 1"),
                       paratrain::error);
  bad = m;
  bad.parameters = -1;
  CHECK_THROWS_WITH_AS((void)plan::per_rank(bad), doctest::Contains("Model::parameters is -1"), paratrain::error);
  bad = m;
  bad.optimizer_bytes = std::nan("");
  CHECK_THROWS_WITH_AS((void)plan::per_rank(bad), doctest::Contains("Model::optimizer_bytes"), paratrain::error);
  bad = m;
  bad.activation_bytes = -5;
  CHECK_THROWS_WITH_AS((void)plan::per_rank(bad), doctest::Contains("Model::activation_bytes"), paratrain::error);
  bad = m;
  bad.buckets = -1;
  CHECK_THROWS_WITH_AS((void)plan::per_rank(bad), doctest::Contains("Model::buckets"), paratrain::error);
  bad = m;
  bad.grad_bytes = -2;
  CHECK_THROWS_WITH_AS((void)plan::format_table(bad), doctest::Contains("Model::grad_bytes"), paratrain::error);
}

TEST_CASE("plan: the table prints the paper's rounding") {
  const std::string table = plan::format_table(paper_model(7.5e9, 64));
  for (const char* cell : {" 120 ", " 31.4 ", " 16.6 ", " 1.88 ", "DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "P_os+g+p"}) {
    CAPTURE(cell);
    CHECK(table.find(cell) != std::string::npos);
  }
  // 41.25 GB is printed 41.3, as in Table 1 (iostreams alone would print 41.2).
  CHECK(plan::format_table(paper_model(7.5e9, 4)).find(" 41.3 ") != std::string::npos);
}

TEST_CASE("plan: the peak of a step adds the pools and the larger of gradients and optimizer scratch") {
  // Ψ = 1000, Adam (K = 8, scratch 8), 4 ranks; largest bucket 100 elements, unit 200,
  // parameter 50; prefetch 1. By hand (Note [Peak memory model]):
  //   DDP     16000                          + max(2·50·4, 8·50)            = 16400
  //   ZeRO-1  8000 + 8000/4                  + max(400, 8·min(50, 25))       = 10400
  //   ZeRO-2  4000 + 12000/4 + 3·100·4       + max(400, 200)                 = 8600
  //   ZeRO-3  16000/4 + 3·100·4 + 2·200·4    + max(400, 200)                 = 7200
  const plan::Model m{.parameters = 1000,
                      .optimizer_bytes = 8,
                      .ranks = 4,
                      .bucket_elements = 100,
                      .unit_elements = 200,
                      .prefetch = 1,
                      .largest_parameter = 50,
                      .scratch_bytes = plan::scratch_bytes("adam")};
  CHECK(plan::peak(m, plan::stage::ddp).total() == 16400);
  CHECK(plan::peak(m, plan::stage::stage1).total() == 10400);
  CHECK(plan::peak(m, plan::stage::stage2).total() == 8600);
  CHECK(plan::peak(m, plan::stage::stage3).total() == 7200);
  // At stage 3 a bucket is never larger than a unit; a deeper prefetch holds more units.
  auto deep = m;
  deep.bucket_elements = 500;
  deep.prefetch = 3;
  CHECK(plan::peak(deep, plan::stage::stage3).gradient_buckets == 3 * 200 * 4);
  CHECK(plan::peak(deep, plan::stage::stage3).gathered_units == 4 * 200 * 4);
  // Under bf16 autocast with units gathered in bf16 (Note [Gathers in the compute type]):
  // stage 3 copies only the 1000 - 800 parameters outside units (2 bytes each), and its
  // pool holds bf16 units plus each rank's bf16 shard of them in flight, 2·200·2·(1 + 1/4).
  auto narrow = m;
  narrow.autocast_bytes = 2;
  narrow.gather_bytes = 2;
  narrow.narrow_parameters = 800;
  CHECK(plan::per_rank(narrow, plan::stage::stage2).autocast_copies == 2000);
  CHECK(plan::per_rank(narrow, plan::stage::stage3).autocast_copies == 400);
  CHECK(plan::peak(narrow, plan::stage::stage3).gathered_units == 2 * 200 * 2 * 1.25);
  CHECK(plan::peak(narrow, plan::stage::stage3).total() == 7200 - 2 * 200 * 4 + 1000 + 400);
  CHECK_THROWS_WITH_AS((void)plan::per_rank({.parameters = 10, .narrow_parameters = 11}, plan::stage::ddp),
                       doctest::Contains("narrow_parameters"), paratrain::error);
  CHECK_THROWS_WITH_AS((void)plan::peak({.parameters = 1, .prefetch = -1}, plan::stage::stage3),
                       doctest::Contains("prefetch"), paratrain::error);
  CHECK_THROWS_WITH_AS((void)plan::scratch_bytes("lamb"), doctest::Contains("scratch_bytes"), paratrain::error);
}

TEST_CASE("plan: peak_flops gives the data sheets' dense peaks, any case, and names what it knows") {
  // NVIDIA's data sheets, dense (half the "with sparsity" figures): H100 SXM5 1979/2 TFLOP/s
  // bf16, A100 312, T4 65 fp16.
  CHECK(plan::peak_flops("H100-SXM", "bf16") == doctest::Approx(989.4e12));
  CHECK(plan::peak_flops("h100-sxm", "BF16") == doctest::Approx(989.4e12));
  CHECK(plan::peak_flops("A100", "tf32") == doctest::Approx(156e12));
  CHECK(plan::peak_flops("T4", "fp16") == doctest::Approx(65e12));
  CHECK_THROWS_WITH(plan::peak_flops("V100", "bf16"), doctest::Contains("V100 has no bf16 unit"));
  CHECK_THROWS_WITH(plan::peak_flops("H100", "bf16"), doctest::Contains("none of the known accelerators (H100-SXM, "));
  CHECK_THROWS_WITH(plan::peak_flops("A100", "int8"), doctest::Contains("fp32, tf32, bf16 or fp16"));
}

TEST_CASE("plan: tensor parallelism cuts the model before ZeRO, and the activations by Korthikanti et al.'s Table 2") {
  // Psi = 1000 parameters, 100 of them whole on every tensor rank, t = 4: a rank holds
  // 900 / 4 + 100 = 325; DDP fp32 SGD with momentum (K = 4): 325 x 12 bytes; ZeRO-3 over 2
  // data ranks: half of it.
  const plan::Model m{.parameters = 1000, .optimizer_bytes = 4, .ranks = 2, .tensor = 4, .tensor_replicated = 100};
  CHECK(plan::rank_parameters(m) == 325);
  CHECK(plan::per_rank(m, plan::stage::ddp).total() == 325 * 12);
  CHECK(plan::per_rank(m, plan::stage::stage3).total() == 325 * 12 / 2.0);
  CHECK(plan::gradient_traffic(m, plan::stage::ddp) == 325 * 4);
  // Parameters per rank fall as 1/t where nothing is replicated.
  for (std::int64_t t : {1, 2, 4, 8})
    CHECK(plan::per_rank({.parameters = 8000, .tensor = t}, plan::stage::ddp).parameters == 4.0 * 8000 / t);
  // The paper's Table 2 (16-bit values, 1-byte masks), per layer: sbh(34 + 5as/h) without
  // parallelism; sbh(10 + 24/t + 5as/(ht)) tensor-parallel; sbh(34 + 5as/h)/t with sequence
  // parallelism. GPT-3 175B's layer (s 2048, h 12288, a 96) at b = 1, t = 8.
  const double s = 2048, b = 1, h = 12288, a = 96, t = 8, sbh = s * b * h;
  const plan::Transformer gpt3{.sequence = s, .batch = b, .hidden = h, .heads = a};
  CHECK(plan::transformer_activations(gpt3) == doctest::Approx(sbh * (34 + 5 * a * s / h)));
  auto tp = gpt3;
  tp.tensor = 8;
  CHECK(plan::transformer_activations(tp) == doctest::Approx(sbh * (10 + 24 / t + 5 * a * s / (h * t))));
  tp.sequence_parallel = true;
  CHECK(plan::transformer_activations(tp) == doctest::Approx(sbh * (34 + 5 * a * s / h) / t));
  tp.layers = 96;
  CHECK(plan::transformer_activations(tp) == doctest::Approx(96 * sbh * (34 + 5 * a * s / h) / t));
  // fp32 values and float masks (paratrain's keyed dropout): 16 sbh tensors of 4 bytes and 2
  // masks of 4; 2 as2b tensors and 1 mask.
  CHECK(plan::transformer_activations({.sequence = 8, .batch = 2, .hidden = 16, .heads = 4, .value_bytes = 4,
                                       .mask_bytes = 4}) == 8 * 2 * 16 * (16 * 4 + 2 * 4) + 4 * 64 * 2 * (2 * 4 + 4));
  CHECK_THROWS_WITH_AS((void)plan::per_rank({.parameters = 10, .tensor = 0}, plan::stage::ddp),
                       doctest::Contains("Model::tensor is 0"), paratrain::error);
  CHECK_THROWS_WITH_AS((void)plan::per_rank({.parameters = 10, .tensor = 2, .tensor_replicated = 11}, plan::stage::ddp),
                       doctest::Contains("tensor_replicated"), paratrain::error);
  CHECK_THROWS_AS((void)plan::transformer_activations({.hidden = 0, .heads = 1}), paratrain::error);
  // Expert parallelism: Psi = 1000, 800 of them experts cut ep = 4 ways, 100 whole on every
  // tensor rank, t = 2: (1000 - 100 - 800) / 2 + 100 + 800 / 4 = 350.
  const plan::Model moe{.parameters = 1000, .optimizer_bytes = 4, .ranks = 2, .tensor = 2, .tensor_replicated = 100,
                        .expert = 4, .expert_parameters = 800};
  CHECK(plan::rank_parameters(moe) == 350);
  // ZeRO-3 shards the 200 experts a rank holds over its N_d = 2 ranks, the 150 dense
  // parameters over N_d x ep = 8: 100 + 18.75 parameters of 12 bytes.
  CHECK(plan::shard_parameters(moe) == 118.75);
  CHECK(plan::per_rank(moe, plan::stage::stage3).total() == (200 / 2.0 + 150 / 8.0) * 12);
  CHECK(plan::per_rank(moe, plan::stage::stage1).optimizer_state == (200 / 2.0 + 150 / 8.0) * 4);
  CHECK(plan::per_rank(moe, plan::stage::stage1).parameters == 350 * 4);
  CHECK_THROWS_WITH_AS((void)plan::per_rank({.parameters = 10, .expert = 0}, plan::stage::ddp),
                       doctest::Contains("Model::expert is 0"), paratrain::error);
  CHECK_THROWS_WITH_AS((void)plan::per_rank({.parameters = 10, .tensor_replicated = 5, .expert = 2, .expert_parameters = 6},
                                            plan::stage::ddp),
                       doctest::Contains("Model::expert_parameters is 6"), paratrain::error);
  // Context parallelism: each rank holds s/cp positions, so the whole layer's falls as 1/cp.
  for (std::int64_t cp : {2, 4}) {
    auto c = gpt3;
    c.context = cp;
    CHECK(plan::transformer_activations(c) == doctest::Approx(sbh * (34 + 5 * a * s / h) / double(cp)));
  }
  CHECK_THROWS_AS((void)plan::transformer_activations({.hidden = 1, .heads = 1, .context = 0}), paratrain::error);
  // Attention alone: q, k, v and the output (4 b s a d / cp values), then the probabilities
  // b (a/cp) s^2 (all-to-all, one device) or the log-sum-exp b a s / cp (ring), 4 bytes each.
  CHECK(plan::attention_activations({.sequence = 64, .batch = 2, .heads = 4, .head_width = 8}) ==
        4 * (4 * 2 * 64 * 4 * 8 + 2 * 4 * 64 * 64));
  CHECK(plan::attention_activations({.sequence = 64, .batch = 2, .heads = 4, .head_width = 8, .context = 4}) ==
        4 * (4 * 2 * 16 * 4 * 8 + 2 * 1 * 64 * 64));
  CHECK(plan::attention_activations(
            {.sequence = 64, .batch = 2, .heads = 4, .head_width = 8, .context = 4, .ring = true}) ==
        4 * (4 * 2 * 16 * 4 * 8 + 2 * 4 * 16));
}
