// paratrain_plan: per-rank memory of model state under DDP and ZeRO stages 1-3.
//
//   paratrain_plan --params 7.5e9 --optimizer adam --precision mixed --ranks 64 [--activations 2GiB]
//   paratrain_plan --params 44.1M --ranks 2 --autocast bf16 --reduce bf16
//
//   paratrain_plan --peak H100-SXM
//
// Options by CLI11, as every example's and benchmark's: --help on stdout, --name=value, a bad
// value an error naming the option. docs/plan.md.

#include <CLI/CLI.hpp>
#include <paratrain/plan/plan.hpp>

#include <cctype>
#include <charconv>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

namespace plan = paratrain::plan;

namespace {

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
  if (text == "bf16" || text == "fp16") return 2;  // fp16: on a GPU, with loss scaling
  if (text == "none") return 0;
  throw usage_error("--autocast is bf16, fp16 or none, not \"" + std::string(text) + "\"");
}

// Precision::reduce: bytes per gradient element summed across ranks.
double reduced_bytes(std::string_view text) {
  if (text == "bf16") return 2;
  if (text == "fp32") return 4;
  throw usage_error("--reduce is bf16 or fp32, not \"" + std::string(text) +
                    "\" (fp16 sums over samples overflow)");
}

// The peaks paratrain::plan knows for `gpu` ("all": every one), a line each, in TFLOP/s.
std::string peaks(std::string_view gpu) {
  std::ostringstream out;
  bool found = false;
  for (const auto& p : plan::known_devices) {
    std::string name(p.gpu), lower = name, wanted(gpu);
    for (auto* s : {&lower, &wanted})
      for (auto& c : *s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (wanted != "all" && wanted != lower) continue;
    found = true;
    const auto tf = [](double v) { return v > 0 ? std::to_string(v / 1e12).substr(0, std::to_string(v / 1e12).find('.') + 2) : std::string("-"); };
    out << name << ": fp32 " << tf(p.fp32) << ", tf32 " << tf(p.tf32) << ", bf16 " << tf(p.bf16) << ", fp16 "
        << tf(p.fp16) << " TFLOP/s (dense; MFU's denominator per GPU)\n";
  }
  if (!found) plan::peak_flops(gpu, "fp32");  // throws, naming the known ones
  return out.str();
}

// What to print: the plan of a model, or the peaks of --peak.
struct Request {
  plan::Model model;
  std::string peak;
};

// Parses the command line; returns the exit status when the program should end now.
std::optional<int> parse(int argc, char** argv, Request& request) {
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
  std::int64_t tensor = 1;
  double tensor_replicated = 0;
  std::int64_t expert = 1;
  double expert_parameters = 0;
  plan::Transformer transformer;
  bool sequence_parallel = false;

  CLI::App app("Per-rank bytes of parameters, gradients and optimizer state under DDP and ZeRO stages 1-3 "
               "(Rajbhandari et al. 2019), in GB (1e9 bytes) and MiB.");
  app.get_formatter()->column_width(30);
  // An option whose text `convert` reads (its errors name the option).
  const auto option = [&](const std::string& flag, auto convert, const std::string& help) {
    return app.add_option_function<std::string>(
        flag, [flag, convert](const std::string& text) { convert(text); }, help);
  };
  option("--params", [&](const std::string& v) { params = parameter_count(v); },
         "parameter count Psi: 7.5e9, 7.5B, 350M, 1T (required)");
  option("--ranks", [&](const std::string& v) { ranks = whole("--ranks", v); },
         "data-parallel degree (processes), >= 1 (required)");
  app.add_option("--optimizer", optimizer, "sgd, sgd_momentum, adam, adamw, adagrad, rmsprop, rmsprop_momentum")
      ->capture_default_str();
  option("--precision",
         [&](const std::string& v) {
           if (v == "fp32") precision = plan::fp32;
           else if (v == "mixed") precision = plan::mixed;
           else throw usage_error("--precision is fp32 or mixed, not \"" + v + "\"");
         },
         "fp32 (default: B_p = B_g = 4) or mixed (B_p = B_g = 2, plus an fp32 master copy in K)");
  option("--activations", [&](const std::string& v) { activations = bytes("--activations", v); },
         "activation estimate per rank: 2GiB, 512MiB, 3.5GB, 1e9 (bytes)");
  option("--buckets", [&](const std::string& v) { buckets = whole("--buckets", v); },
         "flat buffers, each padded to a multiple of N_d: adds the padding bound");
  option("--autocast", [&](const std::string& v) { autocast_bytes = autocast_copy_bytes(v); },
         "bf16 or fp16: Precision::autocast, fp32 parameters plus 2-byte copies of the weights from forward to "
         "backward; none (default)");
  option("--reduce", [&](const std::string& v) { reduce_bytes = reduced_bytes(v); },
         "bf16 or fp32: the type gradients are summed in across ranks (Precision::reduce); default: B_g");
  option("--gather",
         [&](const std::string& v) {
           if (v == "bf16") gather_bytes = 2;
           else if (v == "fp32") gather_bytes = 4;
           else throw usage_error("--gather is bf16 or fp32, not \"" + v + "\"");
         },
         "with --autocast bf16: the type ZeRO-3 gathers units in (Precision::gather): bf16 (default) or fp32");
  option("--bucket", [&](const std::string& v) { bucket_bytes = bytes("--bucket", v); },
         "the largest gradient bucket (25MiB: DataParallel's default cap): adds the peak of a step");
  option("--unit", [&](const std::string& v) { unit = parameter_count(v); },
         "the largest paratrain::Unit's parameter count (ZeRO-3's gathers)");
  option("--largest-param", [&](const std::string& v) { largest = parameter_count(v); },
         "the largest parameter's element count (autograd's gradients, the optimizer's scratch)");
  option("--prefetch", [&](const std::string& v) { prefetch = whole("--prefetch", v); },
         "units ZeRO-3 gathers ahead (DataParallelOptions::prefetch, 1)");
  option("--optimizer-bytes", [&](const std::string& v) { optimizer_bytes = per_parameter("--optimizer-bytes", v); },
         "K in bytes per parameter, instead of --optimizer's");
  option("--param-bytes", [&](const std::string& v) { param_bytes = per_parameter("--param-bytes", v); },
         "B_p, instead of --precision's");
  option("--grad-bytes", [&](const std::string& v) { grad_bytes = per_parameter("--grad-bytes", v); },
         "B_g, instead of --precision's");
  option("--tensor", [&](const std::string& v) { tensor = whole("--tensor", v); },
         "tensor degree t (DataParallelOptions::tensor_parallel): the matrices cut t ways before ZeRO shards them");
  option("--tensor-replicated", [&](const std::string& v) { tensor_replicated = parameter_count(v); },
         "with --tensor: the parameters every tensor rank holds whole (layer norms, biases of row-parallel layers)");
  option("--expert", [&](const std::string& v) { expert = whole("--expert", v); },
         "expert degree ep (DataParallelOptions::expert_parallel): the experts cut ep ways before ZeRO shards them "
         "over --ranks, the other parameters' state sharded over --ranks x ep (--ranks: the data degree without ep)");
  option("--expert-parameters", [&](const std::string& v) { expert_parameters = parameter_count(v); },
         "with --expert: how many of --params are the mixtures' experts (the rest, router included, whole)");
  app.add_option("--gpt-layers", transformer.layers, "GPT layers: activations by Korthikanti et al.'s formula, with "
                                                    "--sequence, --micro-batch, --hidden and --heads");
  app.add_option("--sequence", transformer.sequence, "tokens per sequence (s)");
  app.add_option("--micro-batch", transformer.batch, "sequences per micro-batch and rank (b)");
  app.add_option("--hidden", transformer.hidden, "hidden size (h)");
  app.add_option("--heads", transformer.heads, "attention heads (a)");
  app.add_flag("--sequence-parallel", sequence_parallel, "with --tensor: activations cut along the sequence too");
  app.add_option("--context", transformer.context,
                 "context degree cp: each rank holds 1/cp of a sequence's positions, and with --gpt-layers its "
                 "activations fall as 1/cp")
      ->check(CLI::PositiveNumber);
  app.add_option("--peak", request.peak,
                 "print a GPU's dense peak TFLOP/s for MFU (FitOptions::throughput), or every known one's with "
                 "\"all\"; nothing else is needed then");
  const auto check = [&] {
    if (!request.peak.empty()) {
      request.peak = peaks(request.peak);
      return;
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
    if (app.count("--gpt-layers") > 0) {
      if (activations > 0) throw usage_error("give --activations or --gpt-layers, not both");
      if (transformer.sequence <= 0 || transformer.batch <= 0 || transformer.hidden <= 0 || transformer.heads <= 0)
        throw usage_error("--gpt-layers needs --sequence, --micro-batch, --hidden and --heads, each > 0");
      transformer.tensor = tensor;
      transformer.sequence_parallel = sequence_parallel;
      transformer.value_bytes = autocast_bytes > 0 ? 2 : precision.param_bytes;
      activations = plan::transformer_activations(transformer);
    }
    request.model = {.parameters = *params,
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
                     .scratch_bytes = optimizer_bytes ? 0.0 : plan::scratch_bytes(optimizer),
                     .tensor = tensor,
                     .tensor_replicated = tensor_replicated,
                     .expert = expert,
                     .expert_parameters = expert_parameters};
  };
  try {
    app.parse(argc, argv);
    check();
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const usage_error& e) {
    std::cerr << "paratrain_plan: " << e.what() << "\nRun with --help for more information.\n";
    return 2;
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Request request;
    if (const auto status = parse(argc, argv, request)) return *status;
    std::cout << (request.peak.empty() ? plan::format_table(request.model) : request.peak);
    return 0;
  } catch (const paratrain::error& e) {
    std::cerr << e.what() << '\n';
  }
  return 2;
}
