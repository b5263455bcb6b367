// torch.nn.Transformer trained as the PyTorch DDP reference program (benchmarks/transformer_vs_torch.py) trains it (synthetic
// src (N, 1, 512) and tgt (N, 20, 512), tgt also the target of a cross-entropy over
// dim 1, Adam at 0.001 × replicas), built five ways from this one source: the strategy
// is the one alias below, chosen by a compile definition (examples/CMakeLists.txt). The
// single build also trains, with --reference R, what R replicas must, in plain LibTorch:
// the independent reference every build is compared with in ctest.
//
//   transformer_single          one device
//   transformer_ddp             DDP over MPI
//   transformer_zero3           DDP with ZeRO stage 3 (each layer a paratrain::Unit)
//   transformer_pipeline        encoder | decoder on 2 ranks (1F1B, GPipe or ZB-H1)
//   transformer_pipeline_zero3  2 stages × 2 ZeRO-3 replicas on 4 ranks
//
//   mpirun -n 2 transformer_ddp --max-steps 8 --warmup 2 --lr-schedule cosine --lr-warmup 2
//   mpirun -n 2 transformer_pipeline --micro-batches 4 --schedule gpipe
//   transformer_single --write-data data.h5 && mpirun -n 2 transformer_ddp --data data.h5 --workers 2
//
// The data is the reference program's, made in memory, or read from an HDF5 file (--data) by the
// library's data::Hdf5Dataset through its loader's worker threads (--workers); --write-data
// writes the in-memory data to such a file (datasets "src" and "tgt", float32).
//
// Prints each step's time, the planner's per-rank model-state estimate beside what the
// strategy holds, and one JSON summary line (printed by the rank that computes replica
// 0's loss: rank 0, or a pipeline's last stage).
#include <ATen/CPUGeneratorImpl.h>
#include <sys/resource.h>
#include <torch/torch.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <numbers>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <vector>

#include <CLI/CLI.hpp>

#include "model.hpp"
#include "paratrain/paratrain.hpp"
#if PARATRAIN_HAS_HDF5  // linked to paratrain::hdf5 where it exists (examples/CMakeLists.txt)
#include <H5Cpp.h>

#include <filesystem>

#include "paratrain/data/hdf5/hdf5_dataset.hpp"
#endif

namespace transformer {

using Adam = torch::optim::Adam;
using paratrain::DataParallel;
using paratrain::Pipeline;
using paratrain::Sharded;
namespace comm = paratrain::comm;
namespace zero = paratrain::zero;

#if defined(TRANSFORMER_SINGLE)
using Strategy = DataParallel<Transformer, comm::SingleDevice, Adam>;
#elif !PARATRAIN_HAS_MPI
#error "this build needs MPI (paratrain::mpi); without it, only transformer_single builds"
#elif defined(TRANSFORMER_DDP)
using Strategy = DataParallel<Transformer, comm::Mpi, Adam>;
#elif defined(TRANSFORMER_ZERO3)
using Strategy = DataParallel<Transformer, comm::Mpi, Sharded<Adam, zero::stage3>>;
#elif defined(TRANSFORMER_PIPELINE)
using Strategy = DataParallel<Pipeline<Encoder, Decoder>, comm::Mpi, Adam>;
#elif defined(TRANSFORMER_PIPELINE_ZERO3)
using Strategy = DataParallel<Pipeline<Encoder, Decoder>, comm::Mpi, Sharded<Adam, zero::stage3>>;
#else
#error "define one of TRANSFORMER_SINGLE, _DDP, _ZERO3, _PIPELINE, _PIPELINE_ZERO3 (examples/CMakeLists.txt does)"
#endif

template <class M>
inline constexpr bool is_pipeline = false;
template <class... Stage>
inline constexpr bool is_pipeline<Pipeline<Stage...>> = true;
constexpr bool pipelined = is_pipeline<Strategy::model_type>;

constexpr const char* strategy_name() {
  constexpr bool mpi = !std::is_same_v<Strategy::communicator_type, comm::SingleDevice>;
  if constexpr (!mpi) return "single";
  else if constexpr (pipelined) return Strategy::stage == 3 ? "pipeline_zero3" : "pipeline";
  else return Strategy::stage == 3 ? "zero3" : "ddp";
}

struct Args {
  Config model;
  int epochs = 1;
  std::int64_t batch = 32;                         // per data-parallel replica, per step (the reference's)
  std::int64_t micro_batches = pipelined ? 4 : 1;  // a pipeline's M; batch / M samples each
  std::int64_t max_steps = 0;                      // 0: the epochs decide
  std::int64_t warmup = 1;                         // first steps left out of ms_per_step
  std::string lr_schedule = "constant";            // constant, cosine or linear, per step
  std::int64_t lr_warmup = 0;                      // steps of linear warm-up before it
  double lr_final = 0;                             // cosine's and linear's last factor
  std::string schedule = "1f1b";
  std::string trace;
  std::string data;        // an HDF5 file with datasets "src" and "tgt"; empty: made in memory
  std::string write_data;  // write the in-memory data to this HDF5 file, and stop
  std::string checkpoint_dir;  // checkpoints here, and resume from the newest
  std::int64_t checkpoint_every = 0;  // steps between checkpoints (0: after each epoch only)
  double time_limit = 0;       // seconds; 0: none (and SLURM's job end, where Slurm says it)
  int workers = paratrain::data::LoaderOptions{}.workers;
  bool bf16 = false;  // forward under bf16 autocast, gradients summed in bf16
  std::string device;  // cpu or cuda; empty: cuda for transformer_single where there is a GPU, else cpu
  double peak_tflops = 0;  // a rank's peak for MFU, stated
  std::string gpu;         // or looked up: paratrain::plan::peak_flops
  std::uint64_t seed = 0;
  double lr = 0.001;         // Adam's, times the replicas (the reference's 0.001 x world size)
  double adam_eps = 1e-8;    // Adam's epsilon (LibTorch's default)
  std::int64_t reference = 0;  // transformer_single: plain LibTorch for this many replicas
};

// A whole number of at least `low`, said so when it is not ("--batch: takes a whole number,
// not 'x'"), rather than CLI11's range message with its bound.
CLI::Validator at_least(std::int64_t low) {
  return CLI::Validator(
      [low](std::string& v) -> std::string {
        std::int64_t x = 0;
        const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
        if (ec != std::errc{} || end != v.data() + v.size()) return "takes a whole number, not '" + v + "'";
        if (x < low) return "must be >= " + std::to_string(low) + ", not " + v;
        return {};
      },
      ">= " + std::to_string(low));
}

// A number above 0, all of the text.
const CLI::Validator positive_real(
    [](std::string& v) -> std::string {
      char* end = nullptr;
      const double x = std::strtod(v.c_str(), &end);
      if (v.empty() || *end != '\0' || !std::isfinite(x)) return "takes a number, not '" + v + "'";
      if (!(x > 0)) return "must be > 0, not " + v;
      return {};
    },
    "> 0");

// The options, by CLI11 as every example's: --help on stdout from one rank, a missing or
// malformed value an error naming the option, --name=value accepted. Returns the exit
// status when the program should end now.
std::optional<int> parse(int argc, char** argv, Args& a) {
  auto& m = a.model;
  CLI::App app(std::string("torch.nn.Transformer trained as the PyTorch DDP reference program trains it; this build: ") +
               strategy_name());
  app.get_formatter()->column_width(28);
  const auto positive = at_least(1), counted = at_least(0);
  app.add_option("--d-model", m.d_model, "model width")->check(positive)->capture_default_str();
  app.add_option("--heads", m.nhead, "attention heads")->check(positive)->capture_default_str();
  app.add_option_function<std::int64_t>(
         "--layers", [&](std::int64_t n) { m.encoder_layers = m.decoder_layers = n; },
         "encoder and decoder layers, each (6)")
      ->check(positive);
  app.add_option("--ff", m.dim_feedforward, "feed-forward width")->check(positive)->capture_default_str();
  app.add_option("--dropout", m.dropout, "dropout probability")->check(CLI::Range(0.0, 1.0))->capture_default_str();
  app.add_option("--samples", m.samples, "synthetic samples")->check(positive)->capture_default_str();
  app.add_option("--tgt-len", m.tgt_len, "target length")->check(positive)->capture_default_str();
  app.add_option("--src-len", m.src_len, "source length")->check(positive)->capture_default_str();
  app.add_option("--epochs", a.epochs, "epochs over --samples")->check(at_least(0))->capture_default_str();
  app.add_option("--batch", a.batch, "samples per replica per step")->check(positive)->capture_default_str();
  app.add_option("--micro-batches", a.micro_batches, "pipeline builds: micro-batches per step, batch / M samples each")
      ->check(positive)
      ->capture_default_str();
  app.add_option("--max-steps,--steps", a.max_steps, "stop after N optimizer steps (0: the epochs decide)")
      ->check(counted)
      ->capture_default_str();
  app.add_option("--warmup", a.warmup, "first steps left out of ms_per_step")->check(counted)->capture_default_str();
  app.add_option("--lr", a.lr, "Adam's learning rate per replica (times the replicas in all)")
      ->check(positive_real)
      ->capture_default_str();
  app.add_option("--lr-schedule", a.lr_schedule, "the rate per step after the warm-up: constant, or cosine or linear "
                                                 "decay to --lr-final x --lr at the last step")
      ->check(CLI::IsMember({"constant", "cosine", "linear"}))
      ->capture_default_str();
  app.add_option("--lr-warmup", a.lr_warmup, "steps of linear warm-up first")->check(counted)->capture_default_str();
  app.add_option("--lr-final", a.lr_final, "the decay's last factor")->check(CLI::Range(0.0, 1.0))->capture_default_str();
  app.add_option("--adam-eps", a.adam_eps,
                 "Adam's epsilon; far above the gradients' size (1e8) Adam's step is (lr / eps) x its momentum: "
                 "linear in the gradient, so a wrong gradient scale shows (examples/CMakeLists.txt)")
      ->check(positive_real)
      ->capture_default_str();
  app.add_option("--schedule", a.schedule, "pipeline builds: gpipe, 1f1b or zb (ZB-H1)")
      ->check(CLI::IsMember({"gpipe", "1f1b", "zb"}))
      ->capture_default_str();
  app.add_option("--trace", a.trace, "write a Chrome trace of every rank's steps to FILE");
  app.add_option("--seed", a.seed, "data, initial weights and sample order")->check(counted)->capture_default_str();
  app.add_option("--data", a.data, "train on an HDF5 file's datasets src [N, S, d_model] and tgt [N, T, d_model] "
                                   "(float32) instead of data made in memory; they set --samples, --src-len, --tgt-len");
  app.add_option("--write-data", a.write_data, "write the data made in memory to FILE in that form, and stop");
  app.add_option("--checkpoint-dir", a.checkpoint_dir, "save a checkpoint at the end (and before --time-limit runs "
                                                       "out) and resume from the newest one there");
  app.add_option("--time-limit", a.time_limit, "seconds: stop before they run out, with a checkpoint (also before "
                                               "SLURM_JOB_END_TIME, where Slurm sets it)")
      ->check(positive_real);
  app.add_option("--checkpoint-every", a.checkpoint_every,
                 "also save a checkpoint after every N steps, in the background (0: after each epoch only)")
      ->check(counted)->capture_default_str();
  app.add_flag("--bf16", a.bf16, "mixed precision: bf16 autocast, gradients summed in bf16; fp32 parameters and Adam");
  app.add_flag("--recompute", m.recompute, "recompute each layer's activations in backward (paratrain::Recompute)");
  app.add_option("--device", a.device, "cpu or cuda (transformer_single; default: cuda where LibTorch sees a GPU)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--workers", a.workers, "loader threads reading the next batches (0: the training thread)")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  app.add_option("--peak-tflops", a.peak_tflops, "one rank's peak TFLOP/s, for MFU")->check(positive_real);
  app.add_option("--gpu", a.gpu, "or the GPU whose peak paratrain::plan knows (H100-SXM, A100, ...), for MFU");
  app.add_option("--reference", a.reference, "transformer_single: train as R replicas would together, in plain "
                                             "LibTorch: the independent reference (needs --max-steps, --dropout 0)")
      ->check(counted);
  const auto check = [&] {
    if (m.d_model % m.nhead != 0) throw CLI::ValidationError("--d-model", "must be a multiple of --heads");
    if (a.batch % a.micro_batches != 0) throw CLI::ValidationError("--batch", "must be a multiple of --micro-batches");
    if (!pipelined && a.micro_batches != 1)
      throw CLI::ValidationError("--micro-batches", "is for the pipeline builds; this one takes the whole batch");
    if (!pipelined && a.schedule != "1f1b") throw CLI::ValidationError("--schedule", "is for the pipeline builds");
    if (!a.data.empty() && !a.write_data.empty()) throw CLI::ValidationError("--data", "excludes --write-data");
    // The other builds reduce over MPI, in host memory (comm::Mpi takes CPU tensors).
    if (a.device == "cuda" && strategy_name() != std::string_view("single"))
      throw CLI::ValidationError("--device", "cuda is transformer_single's: the other builds reduce over MPI, on the host");
    if (a.reference > 0 && (strategy_name() != std::string_view("single") || a.max_steps == 0 || m.dropout != 0 ||
                            a.bf16 || !a.data.empty() || a.epochs != 1))
      throw CLI::ValidationError("--reference", "is transformer_single's, with --max-steps N, --dropout 0 and one epoch, "
                                                "from memory and without --bf16");
    if (a.peak_tflops > 0 && !a.gpu.empty()) throw CLI::ValidationError("--gpu", "excludes --peak-tflops");
    if (!a.gpu.empty()) {
      try {
        a.peak_tflops = paratrain::plan::peak_flops(a.gpu, a.bf16 ? "bf16" : "fp32") / 1e12;
      } catch (const std::exception& e) {
        throw CLI::ValidationError("--gpu", e.what());
      }
    }
#if !PARATRAIN_HAS_HDF5
    if (!a.data.empty() || !a.write_data.empty())
      throw CLI::ValidationError("--data", "and --write-data need HDF5: this build has no paratrain::hdf5 (apt-get "
                                           "install libhdf5-dev, then configure again)");
#endif
  };
  try {
    app.parse(argc, argv);
    check();
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    // Every rank parses the same command line; one of them prints.
    if (paratrain::detail::known_rank() <= 0) return app.exit(e);
    return e.get_exit_code();
  }
}

paratrain::pipeline::Kind schedule_kind(const std::string& name) {
  if (name == "gpipe") return paratrain::pipeline::Kind::gpipe;
  if (name == "1f1b") return paratrain::pipeline::Kind::one_f_one_b;
  if (name == "zb") return paratrain::pipeline::Kind::zero_bubble_h1;
  throw std::invalid_argument("--schedule is gpipe, 1f1b or zb, not " + name);
}

std::int64_t count(torch::nn::Module& m) {
  std::int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

// The encoder and the decoder each from a seed of their own, so that every build starts
// from the same weights whichever rank builds which part.
Encoder make_encoder(const Args& a) {
  torch::manual_seed(a.seed + 1);
  return Encoder(a.model);
}
Decoder make_decoder(const Args& a) {
  torch::manual_seed(a.seed + 2);
  return Decoder(a.model);
}

// This rank's strategy, and in `parameters` how many parameters its model part has
// (counted before ZeRO-3 shards them): the whole model, or a pipeline rank's stage.
// (A template, so that `if constexpr` discards the other build's branch.)
template <class S = Strategy>
std::unique_ptr<S> make_strategy(const Args& a, std::int64_t& parameters) {
  const auto adam = torch::optim::AdamOptions(a.lr).eps(a.adam_eps);  // lr scaled by the replicas once known
  paratrain::DataParallelOptions options;
  if (a.bf16) options.precision = {.autocast = torch::kBFloat16, .reduce = torch::kBFloat16};
  if constexpr (pipelined) {
    typename S::model_type stages(
        [&] {
          auto e = make_encoder(a);
          parameters = count(*e);
          return e;
        },
        [&] {
          auto d = make_decoder(a);
          parameters = count(*d);
          return d;
        });
    stages.named({"encoder", "decoder"});  // the whole model's names: Note [Stage names]
    return std::make_unique<S>(std::move(stages), adam,
                               paratrain::PipelineOptions{.schedule = schedule_kind(a.schedule), .data_parallel = options});
  } else {
    Transformer model(make_encoder(a), make_decoder(a));
    parameters = count(*model);
    // Where it trains: batches follow the model there (Note [One move per batch]).
    model->to(a.device.empty() && strategy_name() != std::string_view("single") ? torch::Device(torch::kCPU)
                                                                                : paratrain::local_device(a.device));
    return std::make_unique<S>(model, adam, options);
  }
}

/// The reference program's data: src = rand(samples, src_len, d_model), tgt = rand(samples, tgt_len,
/// d_model), from `seed`, the same on every rank (and as the reference's torch.rand makes them).
std::pair<torch::Tensor, torch::Tensor> synthetic(const Config& c, std::uint64_t seed) {
  torch::manual_seed(seed);
  auto src = torch::rand({c.samples, c.src_len, c.d_model});
  auto tgt = torch::rand({c.samples, c.tgt_len, c.d_model});
  return {src, tgt};
}

/// The reference program's batches from `rows` (input src, target tgt): inputs (src, tgt) and target
/// tgt, each read once.
struct SeedBatches {
  paratrain::data::DatasetRef rows;
  [[nodiscard]] std::int64_t size() const { return rows.size(); }
  [[nodiscard]] paratrain::Batch get(const torch::Tensor& indices) const {
    auto b = rows.get(indices);
    auto src = std::move(b.inputs.at(0));
    return paratrain::Batch({std::move(src), b.target}, b.target);
  }
};

#if PARATRAIN_HAS_HDF5
/// Writes src and tgt to `path` as float32 datasets "src" and "tgt", through a temporary
/// file renamed into place: a run stopped part-way leaves no truncated file under the name.
void write_hdf5(const std::string& path, const torch::Tensor& src, const torch::Tensor& tgt) {
  const std::string part = path + ".part";
  try {
    H5::Exception::dontPrint();  // the message goes into the exception below instead
    H5::H5File file(part, H5F_ACC_TRUNC);
    for (const auto& [name, t] : {std::pair{"src", src}, std::pair{"tgt", tgt}}) {
      const auto c = t.contiguous();
      std::vector<hsize_t> dims(c.sizes().begin(), c.sizes().end());
      const H5::DataSpace space(static_cast<int>(dims.size()), dims.data());
      file.createDataSet(name, H5::PredType::NATIVE_FLOAT, space).write(c.data_ptr<float>(), H5::PredType::NATIVE_FLOAT);
    }
    file.close();
    std::filesystem::rename(part, path);
  } catch (const H5::Exception& e) {
    std::filesystem::remove(part);
    throw std::runtime_error("cannot write " + path + ": " + e.getDetailMsg());
  }
}

/// The reference program's data read from `path`; sets the configuration's samples, src_len and tgt_len
/// from the file, which must match its d_model.
paratrain::data::Hdf5Dataset open_hdf5(const std::string& path, Config& c) {
  paratrain::data::Hdf5Dataset file(path, {"src"}, "tgt");
  const auto& src = file.inputs()[0];
  const auto& tgt = file.target();
  for (const auto* a : {&src, &tgt})
    if (a->sizes.size() != 3 || a->sizes[2] != c.d_model || a->dtype != torch::kFloat)
      throw std::runtime_error(path + ": dataset " + a->name + " must be float32 [samples, length, " +
                               std::to_string(c.d_model) + "] (d_model " + std::to_string(c.d_model) + "), not " +
                               std::string(c10::toString(a->dtype)) + " " + c10::str(c10::IntArrayRef(a->sizes)));
  c.samples = file.size(), c.src_len = src.sizes[1], c.tgt_len = tgt.sizes[1];
  return file;
}
#endif

/// A "Name: <kB> kB" line of /proc/self/status (VmRSS, VmHWM) in MiB; 0 where unreadable.
double resident_mib(const std::string& name) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(name + ":", 0) == 0) return std::stod(line.substr(name.size() + 1)) / 1024.0;
  return 0;
}

std::string json_number(double x, const char* format = "%.6g") {
  if (!std::isfinite(x)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof buf, format, x);
  return buf;
}

/// --reference R: what R replicas of any build must train to, computed without paratrain's
/// strategies, loader or fit: the same model from the same seeds, plain LibTorch Adam at
/// lr x R, and each step the mean loss over the union of the R replicas' batches as
/// PyTorch's DistributedSampler deals them (torch::randperm from a generator seeded with
/// seed + epoch; replica r takes every R-th index from r, so step t's union is positions
/// [t B R, (t + 1) B R) of the permutation, B the batch per replica), the rate of step t
/// set by --lr-schedule's formula written out here. Prints the last step's loss as the
/// builds' summary line does.
int train_reference(const Args& a) {
  const std::int64_t replicas = a.reference, per_step = a.batch * replicas, steps = a.max_steps;
  if (steps * per_step > a.model.samples)
    throw std::invalid_argument("--reference: --max-steps x --batch x R samples exceed --samples (one epoch)");
  Transformer model(make_encoder(a), make_decoder(a));
  model->train();
  const double lr = a.lr * double(replicas);
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(lr).eps(a.adam_eps));
  const auto [src, tgt] = synthetic(a.model, a.seed);
  const auto order = torch::randperm(a.model.samples, at::make_generator<at::CPUGeneratorImpl>(a.seed), torch::kLong);
  // Linear warm-up to 1 over W steps ((t + 1) / W), then from 1 to the final factor f over
  // the other steps: a half cosine, or a straight line, of p = (t - W) / (steps - W).
  const auto factor = [&](std::int64_t t) {
    const auto W = a.lr_warmup;
    if (t < W) return double(t + 1) / double(W);
    if (a.lr_schedule == "constant" || steps <= W) return 1.0;
    const double p = double(t - W) / double(steps - W), f = a.lr_final;
    return a.lr_schedule == "cosine" ? f + (1 - f) * 0.5 * (1 + std::cos(std::numbers::pi * p)) : f + (1 - f) * (1 - p);
  };
  double loss = 0;
  for (std::int64_t t = 0; t < steps; ++t) {
    for (auto& g : adam.param_groups()) g.options().set_lr(lr * factor(t));
    const auto idx = order.narrow(0, t * per_step, per_step);
    const auto x = src.index_select(0, idx), y = tgt.index_select(0, idx);
    adam.zero_grad();
    const auto l = torch::nn::functional::cross_entropy(model->forward(x, y), y);
    l.backward();
    adam.step();
    loss = l.item<double>();
    std::printf("step %lld/%lld: loss %.6f\n", (long long)t + 1, (long long)steps, loss);
  }
  std::printf("{\"example\": \"transformer\", \"strategy\": \"reference\", \"replicas\": %lld, \"steps\": %lld, "
              "\"loss\": %s, \"first_loss\": null}\n",
              (long long)replicas, (long long)steps, json_number(loss).c_str());
  return std::isfinite(loss) ? 0 : 1;
}

int run(int argc, char** argv) {
  const auto start = std::chrono::steady_clock::now();
  Args a;
  if (const auto status = parse(argc, argv, a)) return *status;
  // MPI started where the strategy needs it, one intra-op thread per process; an error on any
  // rank: one "paratrain: ..." line, and the whole job ends. (The seeds are the reference
  // program's, set where it sets them.)
  return paratrain::main(argc, argv, [&]() -> int {
  if (a.reference > 0) return train_reference(a);
#if PARATRAIN_HAS_HDF5
  if (!a.write_data.empty()) {
    if (paratrain::detect_placement().world_size > 1)
      throw std::runtime_error("--write-data writes one file: run it as one process, without mpirun");
    const auto [src, tgt] = synthetic(a.model, a.seed);
    write_hdf5(a.write_data, src, tgt);
    std::printf("wrote %s: src %s, tgt %s, float32\n", a.write_data.c_str(), c10::str(src.sizes()).c_str(),
                c10::str(tgt.sizes()).c_str());
    return 0;
  }
  std::optional<paratrain::data::Hdf5Dataset> file;
  if (!a.data.empty()) file.emplace(open_hdf5(a.data, a.model));
#endif
  const auto& cfg = a.model;

  std::int64_t parameters = 0;
  const double baseline_mib = resident_mib("VmRSS");  // the process before the model
  const auto strategy = make_strategy(a, parameters);
  auto& s = *strategy;
  const int rank = s.rank(), world = s.world_size();
  const auto shard = s.data_shard();
  const int pipeline_ranks = world / shard.count;
  // The rank that computes replica 0's loss reports: the last pipeline rank of replica 0.
  const bool reporter = rank == pipeline_ranks - 1;
  // The reference's Adam(lr=0.001 * world_size): one replica per process there, so replicas here.
  for (auto& g : s.optimizer().param_groups()) g.options().set_lr(a.lr * shard.count);

  // The samples, from memory or from the file.
  std::optional<paratrain::data::TensorDataset> memory;
  paratrain::data::DatasetRef rows;
#if PARATRAIN_HAS_HDF5
  if (file) rows = &*file;
#endif
  if (!rows) {
    const auto [src, tgt] = synthetic(cfg, a.seed);
    rows = &memory.emplace(src, tgt);
  }
  // Dropout's draws from here on: the same whether the data was made or read.
  torch::manual_seed(a.seed + 3);
  // DistributedSampler pads the replicas' shards to equal sizes; --max-steps may end sooner.
  const std::int64_t per_epoch = ((cfg.samples + shard.count - 1) / shard.count + a.batch - 1) / a.batch;
  const std::int64_t steps =
      a.max_steps > 0 ? std::min<std::int64_t>(a.max_steps, per_epoch * a.epochs) : per_epoch * a.epochs;
  // What a sample costs (model.hpp): its tokens, source and target, and its training FLOPs.
  const paratrain::Throughput throughput{.tokens_per_sample = double(cfg.src_len + cfg.tgt_len),
                                         .flops_per_sample = flops_per_sample(cfg),
                                         .peak_flops_per_rank = a.peak_tflops * 1e12};
  paratrain::lr::Schedule schedule;
  if (a.lr_schedule == "cosine") schedule = paratrain::lr::warmup_cosine(a.lr_warmup, a.lr_final);
  else if (a.lr_schedule == "linear") schedule = paratrain::lr::warmup_linear(a.lr_warmup, a.lr_final);
  else if (a.lr_warmup > 0) schedule = paratrain::lr::warmup_linear(a.lr_warmup, 1.0);  // warm-up, then constant

  if (reporter) {
    std::printf("Transformer (d_model %lld, %lld heads, %lld+%lld layers, ff %lld, dropout %g), %s: %d rank(s), "
                "%d replica(s), batch %lld per replica",
                (long long)cfg.d_model, (long long)cfg.nhead, (long long)cfg.encoder_layers,
                (long long)cfg.decoder_layers, (long long)cfg.dim_feedforward, cfg.dropout, strategy_name(), world,
                shard.count, (long long)a.batch);
    if constexpr (pipelined)
      std::printf(" in %lld micro-batches, schedule %s", (long long)a.micro_batches, a.schedule.c_str());
    std::printf(", %lld steps, Adam lr %g (%s", (long long)steps, a.lr * shard.count, a.lr_schedule.c_str());
    if (a.lr_warmup > 0) std::printf(" after %lld warm-up steps", (long long)a.lr_warmup);
    std::printf("), data from %s, %d loader worker(s), %.3g GFLOP per sample\n", a.data.empty() ? "memory" : a.data.c_str(),
                a.workers, throughput.flops_per_sample / 1e9);
    std::fflush(stdout);
  }

  std::vector<double> seconds, waits, losses;
  bool first_has_loss = false, last_has_loss = false;
  const auto result = paratrain::fit(
      s, SeedBatches{rows},
      {.epochs = a.epochs,
       .batch_size = a.batch / a.micro_batches,
       .accumulation = static_cast<int>(a.micro_batches),
       .seed = a.seed,
       .loader = {.workers = a.workers, .depth = std::max(2, a.workers)},
       .lr_schedule = schedule,
       .max_steps = a.max_steps,
       .time_limit = {.seconds = a.time_limit},
       .throughput = throughput,
       .log_every = 1 << 30,  // the per-step lines below instead
       .progress = false,
       .on_step =
           [&](const paratrain::StepInfo& i) {
             seconds.push_back(i.seconds);
             waits.push_back(i.data_seconds);
             losses.push_back(i.loss);
             if (losses.size() == 1) first_has_loss = i.has_loss;
             last_has_loss = i.has_loss;
             if (reporter) {
               std::printf("step %lld/%lld: %.1f ms (data %.2f ms), loss %.6f, lr %.4g\n", (long long)i.step + 1,
                           (long long)steps, 1e3 * i.seconds, 1e3 * i.data_seconds, i.loss, i.lr);
               std::fflush(stdout);
             }
           },
       .observe = {.trace_file = a.trace},
       .checkpoint = {.directory = a.checkpoint_dir, .every_steps = a.checkpoint_every, .every_epoch = true}},
      paratrain::CrossEntropy{});  // float targets: class probabilities over dim 1, as the reference's

  // Step time and the wait for data in it: the slowest rank's means over the steps after
  // the warm-up.
  const auto measured = static_cast<std::int64_t>(seconds.size()) - a.warmup;
  auto timing = torch::zeros({2}, torch::kDouble);
  for (std::int64_t k = a.warmup; k < static_cast<std::int64_t>(seconds.size()); ++k) {
    timing[0] += seconds[k];
    timing[1] += waits[k];
  }
  s.all_reduce(timing, paratrain::reduce_op::max);
  const auto per_step_ms = [&](int i) {
    return measured > 0 ? 1e3 * timing[i].item<double>() / double(measured) : std::nan("");
  };
  const double ms_per_step = per_step_ms(0), data_ms_per_step = per_step_ms(1);

  // The first and the last step's losses, averaged over the replicas (only their last
  // stages have one); a NaN stays NaN.
  auto ends = torch::zeros({4}, torch::kDouble);
  if (first_has_loss) ends[0] = losses.front(), ends[1] = 1.0;
  if (last_has_loss) ends[2] = losses.back(), ends[3] = 1.0;
  s.all_reduce(ends, paratrain::reduce_op::sum);
  const auto mean = [&](int i) {
    return ends[i + 1].item<double>() > 0 ? ends[i].item<double>() / ends[i + 1].item<double>() : std::nan("");
  };
  const double first_loss = mean(0), loss = mean(2);

  // The most memory any rank's process held at once (its peak resident set), in MiB.
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  // Also above the process's baseline, beside paratrain::plan::peak for the strategy (Note
  // [Peak memory model]; activations are not in it: the example gives no estimate).
  const double plan_peak_mib = [](auto& strategy) {  // generic, so that a pipeline's build drops the call
    if constexpr (requires { strategy.planned_peak(); }) return strategy.planned_peak().total() / (1 << 20);
    else return std::nan("");
  }(s);
  auto peak = torch::tensor({double(usage.ru_maxrss) / 1024.0, baseline_mib, resident_mib("VmHWM") - baseline_mib,
                             std::isnan(plan_peak_mib) ? 0.0 : plan_peak_mib},
                            torch::kDouble);  // ru_maxrss: KiB
  s.all_reduce(peak, paratrain::reduce_op::max);
  const double peak_rss_mib = peak[0].item<double>();

  // Model state per rank: what paratrain::plan predicts for this rank's part of the model
  // (its whole model, or its pipeline stage) and this strategy, beside what it holds now.
  // Also the bytes of gradients each rank sends per step, planned and measured.
  namespace plan = paratrain::plan;
  const auto stage = Strategy::stage == 3 ? plan::stage::stage3 : plan::stage::ddp;
  const plan::Model part{.parameters = double(parameters),
                         .optimizer_bytes = plan::optimizer_bytes("adam"),
                         .ranks = shard.count,
                         .autocast_bytes = a.bf16 ? 2.0 : 0.0,
                         .reduce_bytes = a.bf16 ? 2.0 : 0.0};
  const auto planned = plan::per_rank(part, stage);
  const auto held = s.model_state_bytes();
  auto table = torch::zeros({world, 9}, torch::kDouble);
  table[rank].copy_(torch::tensor({double(parameters), planned.parameters, planned.gradients,
                                   planned.optimizer_state, double(held.parameters), double(held.gradients),
                                   double(held.optimizer_state), plan::gradient_traffic(part, stage),
                                   double(s.gradient_bytes_sent())},
                                  torch::kDouble));
  s.all_reduce(table, paratrain::reduce_op::sum);

  if (reporter) {
    const auto mib = [](double b) { return b / (1 << 20); };
    std::int64_t total_parameters = 0;
    double planned_max = 0, held_max = 0, traffic_planned = 0, traffic_sent = 0;
    std::printf("model state per rank, MiB (planned by paratrain::plan, %s, N_d = %d | held after training):\n",
                std::string(plan::to_string(Strategy::stage == 3 ? plan::stage::stage3 : plan::stage::ddp)).c_str(),
                shard.count);
    for (int r = 0; r < world; ++r) {
      const auto row = table[r];
      const auto v = [&](int c) { return row[c].item<double>(); };
      if (r < pipeline_ranks) total_parameters += static_cast<std::int64_t>(v(0));  // replica 0's parts
      planned_max = std::max(planned_max, v(1) + v(2) + v(3));
      held_max = std::max(held_max, v(4) + v(5) + v(6));
      traffic_planned = std::max(traffic_planned, v(7));
      traffic_sent = std::max(traffic_sent, v(8));
      std::printf("  rank %d: %lld parameters; planned params %.1f + grads %.1f + Adam %.1f = %.1f | held %.1f + "
                  "%.1f + %.1f = %.1f\n",
                  r, (long long)v(0), mib(v(1)), mib(v(2)), mib(v(3)), mib(v(1) + v(2) + v(3)), mib(v(4)),
                  mib(v(5)), mib(v(6)), mib(v(4) + v(5) + v(6)));
    }
    if (a.bf16)  // this (the reporting) rank's
      std::printf("  and from forward to backward autocast's bf16 copies of the weights: planned %.1f on rank %d\n",
                  mib(planned.autocast_copies), rank);
    std::printf("gradients sent per step and rank, MiB: planned %.1f, sent %.1f (the most of any rank)\n",
                mib(traffic_planned), mib(traffic_sent));
    const auto& rates = result.rates;
    std::printf("throughput: %.1f samples/s, %.0f tokens/s, %.3g TFLOP/s over %d rank(s), MFU %s\n",
                rates.samples_per_second, rates.tokens_per_second, rates.tflops, world,
                a.peak_tflops > 0 ? (json_number(100 * rates.mfu, "%.2f") + "% of " + json_number(a.peak_tflops) +
                                     " TFLOP/s per rank")
                                        .c_str()
                                  : "n/a (give --peak-tflops or --gpu)");
    if (!result.stopped.empty()) std::printf("stopped: %s\n", result.stopped.c_str());
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf(
        "{\"example\": \"transformer\", \"strategy\": \"%s\", \"world_size\": %d, \"replicas\": %d, "
        "\"pipeline_ranks\": %d, \"schedule\": %s, \"micro_batches\": %lld, \"batch_per_replica\": %lld, "
        "\"parameters\": %lld, \"steps\": %lld, \"warmup\": %lld, \"loss\": %s, \"first_loss\": %s, "
        "\"train_loss\": %s, \"ms_per_step\": %s, \"data_ms_per_step\": %s, \"data\": \"%s\", \"workers\": %d, "
        "\"samples_per_second\": %s, \"planned_bytes_per_rank_max\": %.0f, \"held_bytes_per_rank_max\": %.0f, "
        "\"recompute\": %s, \"bf16\": %s, \"tgt_len\": %lld, \"peak_rss_mib_max\": %.1f, "
        "\"gradient_bytes_planned\": %.0f, \"gradient_bytes_sent\": %.0f, \"baseline_mib\": %.1f, "
        "\"peak_above_baseline_mib\": %.1f, \"plan_peak_mib\": %s, \"tokens_per_second\": %s, \"tflops\": %s, "
        "\"mfu\": %s, \"lr_schedule\": \"%s\", \"wall_seconds\": %.2f}\n",
        strategy_name(), world, shard.count, pipeline_ranks, pipelined ? ("\"" + a.schedule + "\"").c_str() : "null",
        (long long)a.micro_batches, (long long)a.batch, (long long)total_parameters, (long long)seconds.size(),
        (long long)a.warmup, json_number(loss).c_str(), json_number(first_loss).c_str(),
        json_number(result.epochs.empty() ? std::nan("") : result.epochs.back().train_loss).c_str(),
        json_number(ms_per_step, "%.1f").c_str(), json_number(data_ms_per_step, "%.3f").c_str(),
        a.data.empty() ? "memory" : "hdf5", a.workers, json_number(result.samples_per_second, "%.2f").c_str(), planned_max,
        held_max, cfg.recompute ? "true" : "false", a.bf16 ? "true" : "false", (long long)cfg.tgt_len, peak_rss_mib,
        traffic_planned, traffic_sent, peak[1].item<double>(), peak[2].item<double>(),
        pipelined ? "null" : json_number(peak[3].item<double>(), "%.1f").c_str(),
        json_number(result.rates.tokens_per_second, "%.1f").c_str(), json_number(result.rates.tflops, "%.4g").c_str(),
        a.peak_tflops > 0 ? json_number(result.rates.mfu, "%.4g").c_str() : "null", a.lr_schedule.c_str(), wall);
    std::fflush(stdout);
  }
  return std::isfinite(loss) ? 0 : 1;  // a run whose loss is not a number failed
  });
}

}  // namespace transformer

int main(int argc, char** argv) { return transformer::run(argc, argv); }
