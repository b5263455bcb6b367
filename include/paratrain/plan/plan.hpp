#pragma once
/// \file
/// paratrain::plan — how many bytes of model state each rank holds under DDP and the
/// three ZeRO stages (Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward
/// Training Trillion Parameter Models", arXiv:1910.02054). Standard library only: no
/// LibTorch, so a planning tool builds in a second. docs/plan.md.

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <sstream>
#include <string>
#include <string_view>

#include "paratrain/core/error.hpp"

namespace paratrain::plan {

// Note [ZeRO memory model]
// ZeRO-DP counts three kinds of model state per parameter: B_p bytes of parameters, B_g
// bytes of gradients and K bytes of optimizer state (mixed-precision Adam: an fp32 master
// copy, momentum and variance, K = 12). With Ψ parameters and N_d data-parallel ranks,
// each rank holds
//   DDP                  (B_p + B_g + K) Ψ
//   stage 1   (P_os)     (B_p + B_g) Ψ + K Ψ / N_d
//   stage 2   (P_os+g)   B_p Ψ + (B_g + K) Ψ / N_d
//   stage 3   (P_os+g+p) (B_p + B_g + K) Ψ / N_d
// These are the paper's continuous formulas, kept exact so its Table 1 can be checked.
// Real shards are whole elements: a flat buffer of E elements split N_d ways is padded to
// a multiple of N_d, at most N_d − 1 elements more; a rank holding the whole padded
// buffer holds those, a rank holding one shard ceil(E / N_d) holds at most (N_d − 1) / N_d
// of an element more. Model::buckets bounds that (Memory::padding), apart from the paper's
// numbers. Activations are not sharded by ZeRO-DP: every rank holds its own, as estimated.
// Not counted: temporary communication buffers (DDP's buckets, ZeRO's all-gather
// prefetch), the allocator's fragmentation, the CUDA context.
//
// Under autocast (paratrain::Precision::autocast, Note [Mixed precision]) parameters,
// gradients and optimizer state stay fp32, and each rank also holds autocast's
// low-precision copies of the weights from forward to backward: Model::autocast_bytes
// per parameter (2 for bf16), for the whole model at every stage, unless units recompute
// their activations; at stage 3 not for the parameters gathered in the compute type
// (Model::narrow_parameters, Note [Gathers in the compute type]). The gradients
// a rank hands to the step's collectives (gradient_traffic) are Model::reduce_bytes per
// parameter: 2 where Precision::reduce is bf16.

/// The four ways of placing model state, in the paper's order (ZeRO Fig. 1).
///
///   ddp     nothing sharded: every rank holds parameters, gradients and optimizer state
///   stage1  P_os:      optimizer state sharded
///   stage2  P_os+g:    optimizer state and gradients sharded
///   stage3  P_os+g+p:  optimizer state, gradients and parameters sharded
enum class stage { ddp, stage1, stage2, stage3 };

/// Every stage, in order: what `per_rank(model)` reports.
inline constexpr std::array<stage, 4> stages{stage::ddp, stage::stage1, stage::stage2, stage::stage3};

/// "DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3".
[[nodiscard]] constexpr std::string_view to_string(stage s) noexcept {
  switch (s) {
    case stage::ddp: return "DDP";
    case stage::stage1: return "ZeRO-1";
    case stage::stage2: return "ZeRO-2";
    case stage::stage3: return "ZeRO-3";
  }
  return "?";
}

/// The paper's name for what a stage shards: "-", "P_os", "P_os+g", "P_os+g+p".
[[nodiscard]] constexpr std::string_view paper_name(stage s) noexcept {
  switch (s) {
    case stage::ddp: return "-";
    case stage::stage1: return "P_os";
    case stage::stage2: return "P_os+g";
    case stage::stage3: return "P_os+g+p";
  }
  return "?";
}

/// How parameters and gradients are stored: bytes per parameter.
///
///   fp32   B_p = B_g = 4; the optimizer updates the parameters themselves (LibTorch's default)
///   mixed  B_p = B_g = 2 (fp16 or bf16); the optimizer keeps an fp32 master copy,
///          4 bytes per parameter that ZeRO counts in K (so mixed Adam has K = 4 + 8 = 12)
struct Precision {
  double param_bytes = 4;   ///< B_p
  double grad_bytes = 4;    ///< B_g
  double master_bytes = 0;  ///< the optimizer's own copy of the parameters, part of K
};

inline constexpr Precision fp32{.param_bytes = 4, .grad_bytes = 4, .master_bytes = 0};
inline constexpr Precision mixed{.param_bytes = 2, .grad_bytes = 2, .master_bytes = 4};

/// What is being trained, and on how many ranks. Sizes are in bytes.
///
/// \code
///   // ZeRO Table 1's first model: 7.5B parameters, mixed-precision Adam, 64 ranks.
///   plan::Model m{.parameters = 7.5e9, .param_bytes = 2, .grad_bytes = 2,
///                 .optimizer_bytes = plan::optimizer_bytes("adam", plan::mixed), .ranks = 64};
///   plan::per_rank(m, plan::stage::stage2).total();   // 16.64e9 bytes
/// \endcode
struct Model {
  double parameters = 0;        ///< Ψ, the number of parameters
  double param_bytes = 4;       ///< B_p, bytes per parameter
  double grad_bytes = 4;        ///< B_g, bytes per gradient element
  double optimizer_bytes = 0;   ///< K, optimizer-state bytes per parameter: optimizer_bytes(name)
  std::int64_t ranks = 1;       ///< N_d, the data-parallel degree (without the expert degree ep)
  double activation_bytes = 0;  ///< per rank, the user's estimate; never sharded by ZeRO-DP
  std::int64_t buckets = 0;     ///< flat buffers each padded to a multiple of N_d (N_d · ep); 0: no bound
  /// Autocast's copies of the weights, bytes per parameter: 2 under bf16 or fp16
  /// autocast (Precision::autocast), 0 without. Never sharded.
  double autocast_bytes = 0;
  /// Bytes per gradient element summed across ranks: 2 with Precision::reduce = bf16;
  /// 0: grad_bytes.
  double reduce_bytes = 0;
  /// ZeRO-3 under autocast: bytes per element of its pool of gathered units (2 where every
  /// unit is gathered in bf16: Precision::gather); 0: param_bytes.
  double gather_bytes = 0;
  /// ZeRO-3 under autocast: the parameters it gathers in the compute type, of which
  /// autocast makes no copies (Note [Gathers in the compute type]).
  double narrow_parameters = 0;
  // What plan::peak adds to the model states (Note [Peak memory model]); 0: left out.
  double bucket_elements = 0;     ///< the largest gradient bucket, in elements
  double unit_elements = 0;       ///< the largest paratrain::Unit, in parameters (ZeRO-3)
  std::int64_t prefetch = 1;      ///< units gathered ahead of the one computing (ZeRO-3)
  double largest_parameter = 0;   ///< the largest parameter tensor, in elements
  double scratch_bytes = 0;       ///< the optimizer's temporaries per element it steps: scratch_bytes(name)
  /// Tensor parallelism (Note [Tensor-parallel memory]): the tensor degree t, and how many of
  /// the parameters every rank of a tensor group holds whole (layer norms, row-parallel
  /// biases, layers that are not cut); the others are cut t ways.
  std::int64_t tensor = 1;
  double tensor_replicated = 0;
  /// Expert parallelism (Note [Tensor-parallel memory]): the expert degree ep, and how many
  /// of the parameters are experts, cut ep ways (whole on every tensor rank; not counted in
  /// tensor_replicated).
  std::int64_t expert = 1;
  double expert_parameters = 0;
};

// Note [Tensor-parallel memory]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Tensor parallelism cuts a model's matrices over t ranks before ZeRO cuts the model state
// over N_d: a rank holds Ψ_t = (Ψ − Ψ_r) / t + Ψ_r parameters, Ψ_r those every tensor rank
// holds whole (Model::tensor_replicated), and the ZeRO formulas apply to Ψ_t (each tensor
// slice sharded further over its data group). Expert parallelism cuts a mixture's experts
// Ψ_e ep ways (Note [Experts over a group]), whole on every tensor rank:
// Ψ_t = (Ψ − Ψ_r − Ψ_e) / t + Ψ_r + Ψ_e / ep. ZeRO then shards each over its own ranks
// (Note [Expert buckets]): the experts' Ψ_e / ep over the N_d ranks that hold them alike, the
// rest of Ψ_t over the N_d ranks of each expert rank together, N_d · ep, so a rank's shard
// holds (Ψ_t − Ψ_e / ep) / (N_d · ep) + Ψ_e / (ep · N_d) parameters (shard_parameters); each
// bucket is padded to a multiple of its ranks, at most N_d · ep. A strategy's own plan counts
// the parameters this rank holds, which are Ψ_t already (t = 1 there; ep is the mesh's, its
// experts counted ep times).
//
// Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
// Transformer Models", §4, Table 2): one GPT layer keeps, per s·b·h (sequence, batch,
// hidden) and a·s²·b (heads), with 16-bit values and 1-byte dropout masks,
//   no parallelism                 sbh (34 + 5as/h)
//   tensor parallel                sbh (10 + 24/t + 5as/(ht))
//   tensor + sequence parallel     sbh (34 + 5as/h) / t
// The 34 are 16 tensors of sbh values (2 bytes each) and 2 masks; the 5as/h are 2 tensors
// of a·s·s values and 1 mask; without sequence parallelism the layer norms' inputs, the
// attention's and MLP's inputs and the two residual dropouts' masks (10) are whole on every
// tensor rank. transformer_activations() counts them for values of V bytes and masks of M
// bytes: sbh (4V + 2M + 12V/t) + as²b (2V + M)/t, all of it divided by t with sequence
// parallelism; (V, M) = (2, 1) gives the published numbers exactly.
//
// Context parallelism (Note [Sequence layouts]) gives each rank s/cp of every sequence's
// positions: every sbh term falls as 1/cp, and so do the scores, which all-to-all attention
// keeps as [b, a/cp, s, s] (Note [All-to-all attention]); Transformer::context divides the
// whole by cp. Ring attention keeps no scores at all (Note [Ring attention]):
// attention_activations() counts what each algorithm keeps of attention alone.

/// One stack of GPT layers, for transformer_activations().
struct Transformer {
  double sequence = 0;  ///< s, tokens per sequence
  double batch = 0;     ///< b, sequences per rank (a micro-batch)
  double hidden = 0;    ///< h
  double heads = 0;     ///< a
  double layers = 1;    ///< L
  std::int64_t tensor = 1;         ///< t
  bool sequence_parallel = false;  ///< the activations between the regions cut along the sequence
  double value_bytes = 2;          ///< the activations' type: 2 (fp16/bf16, the paper's), 4 (fp32)
  double mask_bytes = 1;           ///< a dropout mask's element: 1 (the paper's), 4 (paratrain's keyed masks, float)
  std::int64_t context = 1;        ///< cp: each rank holds s/cp of a sequence's positions
};

/// Attention alone over a context group, for attention_activations().
struct Attention {
  double sequence = 0;        ///< s, the whole sequence
  double batch = 0;           ///< b
  double heads = 0;           ///< a
  double head_width = 0;      ///< d
  std::int64_t context = 1;   ///< cp
  bool ring = false;          ///< ring attention (no scores kept); false: all-to-all, or one device at cp = 1
  double value_bytes = 4;     ///< V
};

/// The bytes one rank's attention keeps for backward (Note [Tensor-parallel memory]): q, k, v
/// and the output, 4·b·(s/cp)·a·d values, and then the probabilities b·(a/cp)·s² (all-to-all,
/// one device) or the log-sum-exp b·a·(s/cp) (ring). Masks (bool) are left out.
[[nodiscard]] inline double attention_activations(const Attention& x) {
  if (!(x.sequence >= 0 && x.batch >= 0 && x.heads > 0 && x.head_width > 0 && x.context >= 1 && x.value_bytes > 0))
    throw error("plan::attention_activations", -1,
                "give a sequence and batch >= 0, heads and head width > 0, a context degree >= 1 and positive value "
                "bytes");
  const double s = x.sequence, b = x.batch, a = x.heads, cp = static_cast<double>(x.context);
  const double inputs_and_output = 4 * b * (s / cp) * a * x.head_width;
  const double kept = x.ring ? b * a * (s / cp) : b * (a / cp) * s * s;
  return (inputs_and_output + kept) * x.value_bytes;
}

/// The activations one rank keeps for backward over L layers (Note [Tensor-parallel
/// memory]): Korthikanti et al.'s Table 2 for values of `value_bytes` and masks of `mask_bytes`.
[[nodiscard]] inline double transformer_activations(const Transformer& x) {
  if (!(x.sequence >= 0 && x.batch >= 0 && x.hidden > 0 && x.heads > 0 && x.layers >= 0 && x.tensor >= 1 &&
        x.context >= 1 && x.value_bytes > 0 && x.mask_bytes >= 0))
    throw error("plan::transformer_activations", -1,
                "give a sequence, batch and layers >= 0, hidden and heads > 0, tensor and context degrees >= 1 and "
                "positive value bytes");
  const double s = x.sequence, b = x.batch, h = x.hidden, a = x.heads, t = static_cast<double>(x.tensor);
  const double v = x.value_bytes, m = x.mask_bytes;
  const double sbh = s * b * h, as2b = a * s * s * b;
  // 16 sbh tensors of values and 2 masks; of them 4 values and the 2 masks are whole on every
  // tensor rank without sequence parallelism (with it, every one is cut t ways).
  const double whole = 4 * v + 2 * m, cut = 12 * v;
  const double per_layer = x.sequence_parallel ? (sbh * (whole + cut) + as2b * (2 * v + m)) / t
                                               : sbh * (whole + cut / t) + as2b * (2 * v + m) / t;
  return x.layers * per_layer / static_cast<double>(x.context);
}

/// Bytes of each kind one rank holds under one stage.
///
/// `parameters`, `gradients` and `optimizer_state` are the paper's formulas exactly;
/// `padding` is the upper bound of Note [ZeRO memory model] (0 when Model::buckets is 0).
struct Memory {
  stage strategy = stage::ddp;
  double parameters = 0;
  double gradients = 0;
  double optimizer_state = 0;
  double activations = 0;
  double padding = 0;
  double autocast_copies = 0;  ///< Model::autocast_bytes × Ψ, at every stage

  [[nodiscard]] constexpr double total() const noexcept {
    return parameters + gradients + optimizer_state + activations + padding + autocast_copies;
  }
};

namespace detail {

inline constexpr std::string_view operation = "plan::per_rank";

inline void require_non_negative(double value, std::string_view field, std::string_view fix) {
  if (std::isfinite(value) && value >= 0) return;
  std::ostringstream s;
  s << "Model::" << field << " is " << value << "; it must be a finite number >= 0 (" << fix << ")";
  throw error(operation, -1, s.str());
}

inline void validate(const Model& m) {
  require_non_negative(m.parameters, "parameters", "the parameter count Psi, e.g. 7.5e9");
  require_non_negative(m.param_bytes, "param_bytes", "bytes per parameter: 4 for fp32, 2 for fp16/bf16");
  require_non_negative(m.grad_bytes, "grad_bytes", "bytes per gradient element: 4 for fp32, 2 for fp16/bf16");
  require_non_negative(m.optimizer_bytes, "optimizer_bytes",
                       "K, e.g. plan::optimizer_bytes(\"adam\") = 8, or 12 for mixed-precision Adam");
  require_non_negative(m.activation_bytes, "activation_bytes", "an estimate in bytes, or 0 to leave activations out");
  require_non_negative(m.autocast_bytes, "autocast_bytes", "2 under bf16 or fp16 autocast, 0 without");
  require_non_negative(m.reduce_bytes, "reduce_bytes", "2 where gradients are summed in bf16, 0 for grad_bytes");
  require_non_negative(m.gather_bytes, "gather_bytes", "2 where ZeRO-3 gathers units in bf16, 0 for param_bytes");
  if (!(m.narrow_parameters >= 0 && m.narrow_parameters <= m.parameters))
    throw error(operation, -1,
                "Model::narrow_parameters is " + std::to_string(m.narrow_parameters) +
                    "; it counts the parameters ZeRO-3 gathers in bf16, between 0 and Model::parameters");
  if (m.ranks < 1)
    throw error(operation, -1,
                "Model::ranks is " + std::to_string(m.ranks) +
                    "; the data-parallel degree N_d must be at least 1 (set it to the number of processes)");
  if (m.tensor < 1)
    throw error(operation, -1,
                "Model::tensor is " + std::to_string(m.tensor) + "; the tensor degree t must be at least 1 (1: none)");
  if (!(m.tensor_replicated >= 0 && m.tensor_replicated <= m.parameters))
    throw error(operation, -1,
                "Model::tensor_replicated is " + std::to_string(m.tensor_replicated) +
                    "; it counts the parameters every tensor rank holds whole, between 0 and Model::parameters");
  if (m.expert < 1)
    throw error(operation, -1,
                "Model::expert is " + std::to_string(m.expert) + "; the expert degree ep must be at least 1 (1: none)");
  if (!(m.expert_parameters >= 0 && m.tensor_replicated + m.expert_parameters <= m.parameters))
    throw error(operation, -1,
                "Model::expert_parameters is " + std::to_string(m.expert_parameters) +
                    "; it counts the experts' parameters, at least 0 and, with Model::tensor_replicated, at most "
                    "Model::parameters");
  if (m.buckets < 0)
    throw error(operation, -1,
                "Model::buckets is " + std::to_string(m.buckets) +
                    "; it must be >= 0 (the number of flat buffers, or 0 to leave padding out)");
}

}  // namespace detail

/// Ψ_t, the parameters one rank of a tensor and expert group holds (Note [Tensor-parallel memory]).
[[nodiscard]] inline double rank_parameters(const Model& m) {
  return (m.parameters - m.tensor_replicated - m.expert_parameters) / static_cast<double>(m.tensor) +
         m.tensor_replicated + m.expert_parameters / static_cast<double>(m.expert);
}

/// The parameters of one rank's ZeRO shard of Ψ_t: the experts' over N_d ranks, the others'
/// over N_d · ep (Note [Tensor-parallel memory]); Ψ_t / N_d without experts.
[[nodiscard]] inline double shard_parameters(const Model& m) {
  const double n = static_cast<double>(m.ranks), ep = static_cast<double>(m.expert);
  const double experts = m.expert_parameters / ep;
  return (rank_parameters(m) - experts) / (n * ep) + experts / n;
}

/// The bytes one rank holds under stage `s`: Note [ZeRO memory model].
///
/// Throws paratrain::error, naming the field and the fix, for a negative or non-finite
/// size or for `ranks < 1`.
[[nodiscard]] inline Memory per_rank(const Model& m, stage s) {
  detail::validate(m);
  // Note [Tensor-parallel memory]: what one tensor rank holds of the model, and of its shard;
  // each bucket is padded to a multiple of at most n ranks.
  const double psi = rank_parameters(m), shard = shard_parameters(m);
  const double n = static_cast<double>(m.ranks * m.expert);
  const bool params_sharded = s == stage::stage3;
  const bool grads_sharded = s == stage::stage2 || s == stage::stage3;
  const bool state_sharded = s != stage::ddp;

  // Parameters gathered in the compute type have no autocast copies (Note [Gathers in the compute type]).
  const double narrow = m.parameters > 0 ? m.narrow_parameters * psi / m.parameters : 0;
  const double copied = s == stage::stage3 ? psi - narrow : psi;
  Memory out{.strategy = s, .activations = m.activation_bytes, .autocast_copies = m.autocast_bytes * copied};
  out.parameters = m.param_bytes * (params_sharded ? shard : psi);
  out.gradients = m.grad_bytes * (grads_sharded ? shard : psi);
  out.optimizer_state = m.optimizer_bytes * (state_sharded ? shard : psi);

  // DDP all-reduces whole buffers, which need no padding; the ZeRO stages pad every flat
  // buffer so it splits evenly.
  if (s != stage::ddp) {
    const double whole = (n - 1) * static_cast<double>(m.buckets);  // elements per rank
    const double part = whole / n;
    out.padding = m.param_bytes * (params_sharded ? part : whole) +
                  m.grad_bytes * (grads_sharded ? part : whole) + m.optimizer_bytes * part;
  }
  return out;
}

/// The bytes of gradients each rank hands to one step's collectives under stage `s`
/// (DDP and stage 1 all-reduce them, stages 2 and 3 reduce-scatter them): Ψ elements of
/// Model::reduce_bytes (grad_bytes where 0), plus at most (N_d · ep − 1) elements of padding
/// per bucket at the ZeRO stages (Model::buckets). DataParallel::
/// gradient_bytes_sent() measures it.
[[nodiscard]] inline double gradient_traffic(const Model& m, stage s) {
  detail::validate(m);
  const double bytes = m.reduce_bytes > 0 ? m.reduce_bytes : m.grad_bytes;
  const bool padded = s != stage::ddp;  // the ZeRO stages pad each bucket to a multiple of N_d
  const double most = static_cast<double>(m.ranks * m.expert - 1);  // a bucket's padding: Note [Tensor-parallel memory]
  return bytes * (rank_parameters(m) + (padded ? most * static_cast<double>(m.buckets) : 0.0));
}

/// `per_rank(m, s)` for every stage, in the order of `stages`.
[[nodiscard]] inline std::array<Memory, 4> per_rank(const Model& m) {
  return {per_rank(m, stage::ddp), per_rank(m, stage::stage1), per_rank(m, stage::stage2),
          per_rank(m, stage::stage3)};
}

// Note [Peak memory model]
// What a rank holds at its busiest moment of a step, beyond the process it started as:
// the model states between steps (per_rank: parameters, gradients, optimizer state, the
// user's activation estimate, autocast's copies, padding) plus
//   gradient buckets  stages 2 and 3 keep only a shard of the gradients between steps,
//                     but gradients arrive whole, into whole-bucket buffers from a pool of
//                     three (Note [Pooled transients]): three of the largest bucket
//                     (Model::bucket_elements; at stage 3 no bucket is larger than a
//                     unit), in B_g and, where the sum is narrower, its narrowed copy;
//   gathered units    stage 3 gathers units into a pool of 1 + prefetch slots of the
//                     largest unit, in Model::gather_bytes (B_p where 0), and where that
//                     is narrower, each rank's shard of them cast to it while in flight;
// (both pools, once filled in the first step, stay: they bound what steps churn) and the
// larger of what backward and the optimizer step allocate and free again, which never
// coexist:
//   gradients         autograd computes each parameter's gradient into a tensor of its
//                     own before adding it to the parameter's bucket, and computes the next
//                     one meanwhile: two of the largest parameter, in B_g;
//   optimizer scratch the temporaries of one optimizer step on the largest tensor it
//                     updates at once (a parameter; under ZeRO, a piece of it no longer
//                     than a bucket's shard): scratch_bytes per element (Adam's square root
//                     and quotient: 8).
// DDP and stage 1 hold their whole gradient buckets between steps (in the states). Not
// counted: the allocator's fragmentation, communication libraries' own buffers (Open
// MPI's scratch for a non-blocking collective, its shared-memory segments), BLAS's work
// buffers, a CUDA context; docs/benchmarks.md compares the figure with measured peaks.

/// The bytes one rank holds at its peak in a step: the model states and the transient terms.
struct Peak {
  Memory states;
  double gradient_buckets = 0;   ///< the pool of whole gradient buckets (stages 2, 3)
  double gathered_units = 0;     ///< the pool of gathered units (stage 3)
  double gradients = 0;          ///< autograd's gradients before they reach their buckets
  double optimizer_scratch = 0;  ///< one optimizer step's temporaries
  [[nodiscard]] constexpr double transient() const noexcept {
    return gradient_buckets + gathered_units + (gradients > optimizer_scratch ? gradients : optimizer_scratch);
  }
  [[nodiscard]] constexpr double total() const noexcept { return states.total() + transient(); }
};

/// `per_rank(m, s)` plus what a step allocates: Note [Peak memory model].
[[nodiscard]] inline Peak peak(const Model& m, stage s) {
  detail::require_non_negative(m.bucket_elements, "bucket_elements", "the largest bucket in elements, or 0");
  detail::require_non_negative(m.unit_elements, "unit_elements", "the largest unit's parameters, or 0");
  detail::require_non_negative(m.largest_parameter, "largest_parameter", "the largest parameter's elements, or 0");
  detail::require_non_negative(m.scratch_bytes, "scratch_bytes", "plan::scratch_bytes(\"adam\") = 8, or 0");
  if (m.prefetch < 0)
    throw error(detail::operation, -1, "Model::prefetch is " + std::to_string(m.prefetch) + "; it must be >= 0");
  Peak out{.states = per_rank(m, s)};
  const double n = static_cast<double>(m.ranks);
  // At stage 3 a unit's buckets hold that unit's parameters only.
  const double psi = rank_parameters(m);
  const double bucket = std::min({m.bucket_elements, psi, s == stage::stage3 && m.unit_elements > 0 ? m.unit_elements : psi});
  if (s == stage::stage2 || s == stage::stage3) {
    const double narrow = m.reduce_bytes > 0 && m.reduce_bytes < m.grad_bytes ? m.reduce_bytes * (1 + 1 / n) : 0;
    out.gradient_buckets = 3 * bucket * (m.grad_bytes + narrow);
  }
  if (s == stage::stage3) {
    const bool narrow = m.gather_bytes > 0 && m.gather_bytes < m.param_bytes;
    const double unit = m.unit_elements * (narrow ? m.gather_bytes * (1 + 1 / n) : m.param_bytes);
    out.gathered_units = static_cast<double>(1 + m.prefetch) * unit;
  }
  out.gradients = 2 * m.largest_parameter * m.grad_bytes;
  const double stepped = s == stage::ddp ? m.largest_parameter : std::min(m.largest_parameter, std::ceil(bucket / n));
  out.optimizer_scratch = m.scratch_bytes * stepped;
  return out;
}

namespace detail {
/// LibTorch's optimizers: K (state bytes per fp32 parameter) and a step's scratch bytes
/// per element (optimizer_bytes, scratch_bytes).
struct OptimizerEntry {
  std::string_view name;
  double state;
  double scratch;
};
inline constexpr std::array<OptimizerEntry, 7> optimizers{{{"sgd", 0, 0},
                                                           {"sgd_momentum", 4, 0},
                                                           {"adam", 8, 8},
                                                           {"adamw", 8, 8},
                                                           {"adagrad", 4, 8},
                                                           {"rmsprop", 4, 8},
                                                           {"rmsprop_momentum", 8, 8}}};
inline std::string optimizer_names() {
  std::string names;
  for (const auto& e : optimizers) names += (names.empty() ? "" : ", ") + std::string(e.name);
  return names;
}
}  // namespace detail

/// Bytes of temporaries per element an optimizer step of a LibTorch optimizer allocates
/// (on fp32 parameters): "adam" and "adamw" 8 (the denominator and its square root), "sgd"
/// 0 (4 with weight decay: the decayed gradient), "sgd_momentum" 0, "rmsprop" 8, "adagrad" 8.
/// The names of optimizer_bytes; others throw, naming them.
[[nodiscard]] inline double scratch_bytes(std::string_view optimizer) {
  for (const auto& e : detail::optimizers)
    if (e.name == optimizer) return e.scratch;
  throw error("plan::scratch_bytes", -1,
              "unknown optimizer \"" + std::string(optimizer) + "\"; use one of " + detail::optimizer_names() +
                  ", or set Model::scratch_bytes yourself");
}

/// K, the optimizer-state bytes per parameter, of a LibTorch optimizer on fp32 parameters,
/// plus `precision.master_bytes` (the fp32 master copy mixed precision keeps).
///
///   "sgd"               0   torch::optim::SGD, momentum = 0
///   "sgd_momentum"      4   SGD's momentum_buffer
///   "adam", "adamw"     8   exp_avg and exp_avg_sq (amsgrad adds max_exp_avg_sq: 12)
///   "adagrad"           4   sum
///   "rmsprop"           4   square_avg (centered adds grad_avg: +4)
///   "rmsprop_momentum"  8   square_avg and momentum_buffer
///
/// Per-parameter scalars (Adam's step) are left out. Throws paratrain::error, listing the
/// names, for any other name.
[[nodiscard]] inline double optimizer_bytes(std::string_view optimizer, const Precision& precision = fp32) {
  for (const auto& e : detail::optimizers)
    if (e.name == optimizer) return e.state + precision.master_bytes;
  throw error("plan::optimizer_bytes", -1,
              "unknown optimizer \"" + std::string(optimizer) + "\"; use one of " + detail::optimizer_names() +
                  ", or set Model::optimizer_bytes (K) yourself");
}

namespace detail {

// Rounded half away from zero, as the paper rounds (41.25 GB is printed 41.3): iostreams
// round half to even.
inline std::string fixed(double x, int decimals) {
  const double scale = std::pow(10.0, decimals);
  std::ostringstream s;
  s << std::fixed << std::setprecision(decimals) << std::round(x * scale) / scale;
  return s.str();
}

// At least `digits` significant digits and never an exponent: 120, 31.4, 1.88, 0.117.
inline std::string significant(double x, int digits = 3) {
  if (x == 0) return "0";
  const int magnitude = static_cast<int>(std::floor(std::log10(std::fabs(x))));
  return fixed(x, magnitude >= digits - 1 ? 0 : digits - 1 - magnitude);
}

}  // namespace detail

/// A table of `per_rank(m)`: one row per stage, sizes in GB (1e9 bytes, as ZeRO's
/// tables), each to three significant digits, and the total also in MiB (2^20 bytes);
/// then each stage's `gradient_traffic(m, s)`.
///
/// \code
///   std::cout << plan::format_table({.parameters = 7.5e9, .param_bytes = 2, .grad_bytes = 2,
///                                    .optimizer_bytes = 12, .ranks = 64});
/// \endcode
[[nodiscard]] inline std::string format_table(const Model& m) {
  const auto rows = per_rank(m);
  std::ostringstream s;
  s << "Per-rank model state (ZeRO, Rajbhandari et al. 2019): Psi = " << std::setprecision(6) << m.parameters
    << " parameters, B_p = " << m.param_bytes << ", B_g = " << m.grad_bytes << ", K = " << m.optimizer_bytes
    << " bytes/parameter, N_d = " << m.ranks;
  if (m.buckets > 0) s << ", " << m.buckets << " buckets";
  if (m.tensor > 1)
    s << ", tensor degree t = " << m.tensor << " (" << std::setprecision(6) << m.tensor_replicated
      << " parameters whole on every tensor rank): Psi_t = " << rank_parameters(m) << " per rank";
  s << "\nGB = 1e9 bytes, MiB = 2^20 bytes\n\n";

  constexpr std::array<int, 8> width{8, 10, 11, 11, 11, 11, 11, 12};
  auto row = [&](const std::array<std::string, 8>& cells) {
    for (std::size_t i = 0; i < cells.size(); ++i) {
      if (i < 2)
        s << std::left << std::setw(width[i]) << cells[i] << ' ';
      else
        s << std::right << std::setw(width[i]) << cells[i];
    }
    s << '\n';
  };
  row({"strategy", "shards", "params GB", "grads GB", "optim GB", "activ. GB", "total GB", "total MiB"});
  const auto gb = [](double bytes) { return detail::significant(bytes / 1e9); };
  for (const Memory& r : rows) {
    row({std::string(to_string(r.strategy)), std::string(paper_name(r.strategy)), gb(r.parameters),
         gb(r.gradients), gb(r.optimizer_state), gb(r.activations), gb(r.total()),
         detail::fixed(r.total() / (1024.0 * 1024.0), 1)});
  }
  if (m.buckets > 0) {
    s << "\ntotals include bucket padding, at most";
    for (const Memory& r : rows)
      if (r.strategy != stage::ddp)
        s << (r.strategy == stage::stage1 ? ": " : ", ") << to_string(r.strategy) << ' ' << detail::fixed(r.padding, 0)
          << " bytes";
    s << '\n';
  }
  if (m.autocast_bytes > 0) {
    const bool all = rows[3].autocast_copies == rows[0].autocast_copies;
    s << "\ntotals include autocast's copies of the weights at every stage" << (all ? "" : " but ZeRO-3") << ": "
      << gb(rows[0].autocast_copies) << " GB (" << m.autocast_bytes << " bytes/parameter)";
    if (!all)  // Note [Gathers in the compute type]
      s << "; ZeRO-3 gathers its units in " << m.gather_bytes << " bytes/parameter and copies "
        << gb(rows[3].autocast_copies) << " GB";
    s << '\n';
  }
  if (m.bucket_elements > 0 || m.unit_elements > 0 || m.largest_parameter > 0) {
    s << "\npeak of a step per rank (model states plus what a step allocates: paratrain::plan::peak), MiB:\n";
    const auto mib = [](double bytes) { return detail::fixed(bytes / (1024.0 * 1024.0), 1); };
    for (const stage st : stages) {
      const auto p = peak(m, st);
      s << "  " << std::left << std::setw(8) << to_string(st) << std::right << " states " << mib(p.states.total())
        << " + buckets " << mib(p.gradient_buckets) << " + units " << mib(p.gathered_units) << " + max(gradients "
        << mib(p.gradients) << ", optimizer scratch " << mib(p.optimizer_scratch) << ") = " << mib(p.total()) << '\n';
    }
  }
  s << "\ngradients each rank sends per step (" << (m.reduce_bytes > 0 ? m.reduce_bytes : m.grad_bytes)
    << " bytes/element" << (m.buckets > 0 ? ", padding included" : "") << "):";
  for (const stage st : stages)
    s << (st == stage::ddp ? " " : ", ") << to_string(st) << ' ' << gb(gradient_traffic(m, st)) << " GB";
  s << '\n';
  return s.str();
}

/// Dense peak FLOP/s of an accelerator in one precision, from its maker's data sheet (no
/// structured sparsity): the denominator of MFU (FitOptions::throughput).
struct DevicePeak {
  std::string_view gpu;
  double fp32 = 0, tf32 = 0, bf16 = 0, fp16 = 0;  ///< FLOP/s; 0 where the device has no such unit
};

/// The accelerators peak_flops knows. NVIDIA's data sheets, dense tensor-core figures (half
/// the "with sparsity" ones): H100 SXM5 and H200 (989 TFLOP/s bf16), H100 PCIe (756), A100
/// (312), L40S (366), A10 (125), L4 (121), V100 (125 fp16, no bf16), T4 (65 fp16, no bf16).
inline constexpr std::array<DevicePeak, 9> known_devices{{
    {"H100-SXM", 67e12, 494.5e12, 989.4e12, 989.4e12},
    {"H100-PCIe", 51e12, 378e12, 756e12, 756e12},
    {"H200", 67e12, 494.5e12, 989.4e12, 989.4e12},
    {"A100", 19.5e12, 156e12, 312e12, 312e12},
    {"L40S", 91.6e12, 183e12, 366e12, 366e12},
    {"A10", 31.2e12, 62.5e12, 125e12, 125e12},
    {"L4", 30.3e12, 60e12, 121e12, 121e12},
    {"V100", 15.7e12, 0, 0, 125e12},
    {"T4", 8.1e12, 0, 0, 65e12},
}};

/// The peak FLOP/s of `gpu` (a name of known_devices, any case) in `precision` ("fp32",
/// "tf32", "bf16", "fp16"). Throws paratrain::error naming the known ones, or saying that
/// the device has no such unit.
inline double peak_flops(std::string_view gpu, std::string_view precision) {
  const auto lower = [](std::string_view v) {
    std::string out(v);
    for (auto& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return out;
  };
  std::string names;
  for (const auto& p : known_devices) {
    names += (names.empty() ? "" : ", ") + std::string(p.gpu);
    if (lower(p.gpu) != lower(gpu)) continue;
    const auto which = lower(precision);
    const double v = which == "fp32" ? p.fp32 : which == "tf32" ? p.tf32 : which == "bf16" ? p.bf16
                     : which == "fp16" ? p.fp16 : -1;
    if (v < 0) throw error("plan::peak_flops", -1, "the precision is fp32, tf32, bf16 or fp16, not '" + std::string(precision) + "'");
    if (v == 0)
      throw error("plan::peak_flops", -1, std::string(p.gpu) + " has no " + which + " unit; use fp16 or fp32");
    return v;
  }
  throw error("plan::peak_flops", -1, "'" + std::string(gpu) + "' is none of the known accelerators (" + names +
                                          "); state the peak yourself");
}

}  // namespace paratrain::plan
