// paratrain_plan: per-rank memory of model state under DDP and ZeRO stages 1-3.
//
//   paratrain_plan --params 7.5e9 --optimizer adam --precision mixed --ranks 64 [--activations 2GiB]
//   paratrain_plan --params 44.1M --ranks 2 --autocast bf16 --reduce bf16
//
// Arguments are parsed by hand: there are eleven of them, and the tool builds with the
// library's dependencies alone (CLI11 is the tests' and the Fashion-MNIST examples'). docs/plan.md.

#include <paratrain/strategy/plan.hpp>

#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

namespace plan = paratrain::plan;

namespace {

constexpr std::string_view usage = R"(usage: paratrain_plan --params N --ranks N_d [options]

Per-rank bytes of parameters, gradients and optimizer state under DDP and ZeRO
stages 1-3 (Rajbhandari et al. 2019), in GB (1e9 bytes) and MiB.

  --params N             parameter count Psi: 7.5e9, 7.5B, 350M, 1T
  --ranks N_d            data-parallel degree (processes), >= 1
  --optimizer NAME       sgd, sgd_momentum, adam (default), adamw, adagrad, rmsprop,
                         rmsprop_momentum
  --precision P          fp32 (default: B_p = B_g = 4) or mixed (B_p = B_g = 2, plus an
                         fp32 master copy in K: mixed Adam has K = 12)
  --activations SIZE     activation estimate per rank: 2GiB, 512MiB, 3.5GB, 1e9 (bytes)
  --buckets N            flat buffers, each padded to a multiple of N_d: adds the padding bound
  --autocast T           bf16: paratrain's Precision::autocast, fp32 parameters plus bf16
                         copies of the weights from forward to backward; none (default)
  --reduce T             bf16 or fp32: the type gradients are summed in across ranks
                         (Precision::reduce); default: B_g
  --gather T             with --autocast bf16: the type ZeRO-3 gathers units in
                         (Precision::gather): bf16 (default; no autocast copies of units,
                         taken to hold every parameter) or fp32
  --bucket SIZE          the largest gradient bucket (25MiB: DataParallel's default cap;
                         at least the largest parameter): adds the peak of a step
  --unit N               the largest paratrain::Unit's parameter count (ZeRO-3's gathers)
  --largest-param N      the largest parameter's element count (autograd's gradients,
                         the optimizer's scratch)
  --prefetch N           units ZeRO-3 gathers ahead (DataParallelOptions::prefetch, 1)
  --optimizer-bytes K    K in bytes per parameter, instead of --optimizer's
  --param-bytes B        B_p, instead of --precision's
  --grad-bytes B         B_g, instead of --precision's
  -h, --help             this text
)";

struct usage_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A number and what follows it: "7.5GiB" -> {7.5, "GiB"}.
std::pair<double, std::string_view> number_and_suffix(std::string_view flag, std::string_view text) {
  double value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc{} || end == text.data())
    throw usage_error(std::string(flag) + " takes a number, not \"" + std::string(text) + "\"");
  return {value, text.substr(static_cast<std::size_t>(end - text.data()))};
}

double scaled(std::string_view flag, std::string_view text,
              std::initializer_list<std::pair<std::string_view, double>> units, std::string_view allowed) {
  const auto [value, suffix] = number_and_suffix(flag, text);
  for (const auto& [unit, scale] : units)
    if (suffix == unit) return value * scale;
  throw usage_error(std::string(flag) + " \"" + std::string(text) + "\": unknown unit \"" + std::string(suffix) +
                    "\"; use " + std::string(allowed));
}

double parameter_count(std::string_view text) {
  return scaled("--params", text, {{"", 1}, {"K", 1e3}, {"M", 1e6}, {"B", 1e9}, {"G", 1e9}, {"T", 1e12}},
                "a plain number (7.5e9) or K, M, B, T (7.5B)");
}

double bytes(std::string_view flag, std::string_view text) {
  return scaled(flag, text,
                {{"", 1},
                 {"B", 1},
                 {"KB", 1e3},
                 {"kB", 1e3},
                 {"MB", 1e6},
                 {"GB", 1e9},
                 {"TB", 1e12},
                 {"KiB", 1024.0},
                 {"MiB", 1024.0 * 1024},
                 {"GiB", 1024.0 * 1024 * 1024},
                 {"TiB", 1024.0 * 1024 * 1024 * 1024}},
                "bytes or B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (2GiB)");
}

double per_parameter(std::string_view flag, std::string_view text) {
  return scaled(flag, text, {{"", 1}}, "a plain number of bytes per parameter (12)");
}

std::int64_t whole(std::string_view flag, std::string_view text) {
  std::int64_t value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc{} || end != text.data() + text.size())
    throw usage_error(std::string(flag) + " takes a whole number, not \"" + std::string(text) + "\"");
  return value;
}

// Precision::autocast's copies of the weights, bytes per parameter.
double autocast_copy_bytes(std::string_view text) {
  if (text == "bf16") return 2;
  if (text == "none") return 0;
  throw usage_error("--autocast is bf16 or none, not \"" + std::string(text) +
                    "\" (paratrain autocasts to bf16 only: fp16 would need loss scaling)");
}

// Precision::reduce: bytes per gradient element summed across ranks.
double reduced_bytes(std::string_view text) {
  if (text == "bf16") return 2;
  if (text == "fp32") return 4;
  throw usage_error("--reduce is bf16 or fp32, not \"" + std::string(text) +
                    "\" (fp16 sums over samples overflow)");
}

plan::Model parse(int argc, char** argv) {
  std::optional<double> params;
  std::optional<std::int64_t> ranks;
  std::optional<double> optimizer_bytes, param_bytes, grad_bytes;
  std::string optimizer = "adam";
  plan::Precision precision = plan::fp32;
  double activations = 0;
  std::int64_t buckets = 0;
  double autocast_bytes = 0, reduce_bytes = 0;
  std::optional<double> gather_bytes;
  double bucket_bytes = 0, unit = 0, largest = 0;
  std::int64_t prefetch = 1;

  for (int i = 1; i < argc; ++i) {
    std::string_view flag = argv[i], value;
    if (flag == "-h" || flag == "--help") {
      std::cout << usage;
      std::exit(0);
    }
    if (const auto eq = flag.find('='); eq != std::string_view::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
    } else if (i + 1 < argc) {
      value = argv[++i];
    } else {
      throw usage_error(std::string(flag) + " needs a value");
    }
    if (flag == "--params") params = parameter_count(value);
    else if (flag == "--ranks") ranks = whole("--ranks", value);
    else if (flag == "--optimizer") optimizer = value;
    else if (flag == "--precision") {
      if (value == "fp32") precision = plan::fp32;
      else if (value == "mixed") precision = plan::mixed;
      else throw usage_error("--precision is fp32 or mixed, not \"" + std::string(value) + "\"");
    } else if (flag == "--activations") activations = bytes("--activations", value);
    else if (flag == "--buckets") buckets = whole("--buckets", value);
    else if (flag == "--autocast") autocast_bytes = autocast_copy_bytes(value);
    else if (flag == "--reduce") reduce_bytes = reduced_bytes(value);
    else if (flag == "--gather") {
      if (value == "bf16") gather_bytes = 2;
      else if (value == "fp32") gather_bytes = 4;
      else throw usage_error("--gather is bf16 or fp32, not \"" + std::string(value) + "\"");
    }
    else if (flag == "--bucket") bucket_bytes = bytes("--bucket", value);
    else if (flag == "--unit") unit = parameter_count(value);
    else if (flag == "--largest-param") largest = parameter_count(value);
    else if (flag == "--prefetch") prefetch = whole("--prefetch", value);
    else if (flag == "--optimizer-bytes") optimizer_bytes = per_parameter("--optimizer-bytes", value);
    else if (flag == "--param-bytes") param_bytes = per_parameter("--param-bytes", value);
    else if (flag == "--grad-bytes") grad_bytes = per_parameter("--grad-bytes", value);
    else throw usage_error("unknown option " + std::string(flag));
  }
  if (!params) throw usage_error("--params is required (the parameter count, e.g. --params 7.5e9)");
  if (!ranks) throw usage_error("--ranks is required (the data-parallel degree, e.g. --ranks 64)");
  // paratrain's autocast keeps fp32 parameters and adds 2-byte copies; parameters held in
  // 2 bytes already (ZeRO's mixed precision) are not copied.
  const double b_p = param_bytes.value_or(precision.param_bytes);
  if (gather_bytes && autocast_bytes == 0)
    throw usage_error("--gather is the type ZeRO-3 gathers units in under autocast: give --autocast bf16 too");
  // Precision::gather's default: autocast's type (Note [Gathers in the compute type]).
  const double gather = autocast_bytes > 0 ? gather_bytes.value_or(2) : 0;
  if (autocast_bytes > 0 && b_p <= 2)
    throw usage_error("--autocast adds bf16 copies of fp32 parameters, and these are 2 bytes already (--precision "
                      "mixed or --param-bytes): leave out --autocast, or keep fp32 parameters");

  return {.parameters = *params,
          .param_bytes = b_p,
          .grad_bytes = grad_bytes.value_or(precision.grad_bytes),
          .optimizer_bytes = optimizer_bytes ? *optimizer_bytes : plan::optimizer_bytes(optimizer, precision),
          .ranks = *ranks,
          .activation_bytes = activations,
          .buckets = buckets,
          .autocast_bytes = autocast_bytes,
          .reduce_bytes = reduce_bytes,
          .gather_bytes = gather,
          .narrow_parameters = gather > 0 && gather < b_p ? *params : 0,
          .bucket_elements = bucket_bytes / grad_bytes.value_or(precision.grad_bytes),
          .unit_elements = unit,
          .prefetch = prefetch,
          .largest_parameter = largest,
          .scratch_bytes = optimizer_bytes ? 0.0 : plan::scratch_bytes(optimizer)};
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::cout << plan::format_table(parse(argc, argv));
    return 0;
  } catch (const usage_error& e) {
    std::cerr << "paratrain_plan: " << e.what() << "\n\n" << usage;
  } catch (const paratrain::error& e) {
    std::cerr << e.what() << '\n';
  }
  return 2;
}
