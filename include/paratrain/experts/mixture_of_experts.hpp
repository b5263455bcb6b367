#pragma once
/// \file
/// paratrain::moe::MixtureOfExperts — a mixture-of-experts layer whose experts are cut over an
/// expert group: a top-k router, a capacity that drops tokens (or none: dropless), the auxiliary
/// load-balancing loss, and the all-to-all dispatch and combine (Note [Experts over a group]).

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/autograd.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "paratrain/core/backward_scale.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/tensor_parallel/context.hpp"
#include "paratrain/tensor_parallel/group.hpp"
#include "paratrain/tensor_parallel/init.hpp"
#include "paratrain/tensor_parallel/regions.hpp"
#include "paratrain/tensor_parallel/sharding.hpp"

namespace paratrain::moe {

// Note [Experts over a group]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A mixture of experts replaces one MLP by E of them and a router that sends each token to its
// k most probable experts (Shazeer et al. 2017; Switch, Fedus et al. 2021: k = 1; GShard,
// Lepikhin et al. 2020: k = 2). Each rank of an expert group of ep ranks holds E/ep of the
// experts (rank g: experts g·E/ep ... (g+1)·E/ep − 1) and routes its own tokens: the ranks of
// an expert group see different tokens, as data-parallel ranks do. A forward on rank g:
//
//   1. the router's probabilities p = softmax(x·Wr) and each token's top k experts; the
//      gates are p of the chosen experts (k = 1), renormalised over the k (k > 1);
//   2. capacity: each expert takes at most C = ceil(capacity_factor · T · k / E) of this
//      rank's T tokens' k·T assignments, first choices first (all tokens' first choices, in
//      token order, then their second choices): GShard's order; the rest are dropped (their
//      slot adds nothing to the token's output). capacity_factor 0: dropless, nothing dropped;
//   3. dispatch: the kept assignments' rows, ordered by expert, go to the experts' ranks by
//      all-to-all (Group::all_to_all by rows; the counts exchanged first by an all-to-all of
//      E integers);
//   4. each local expert's MLP (d → hidden → d, GELU) on the rows it received, from every rank;
//   5. combine: the results go back by the reverse all-to-all, and each token's output is the
//      sum of its kept assignments' results times their gates.
//
// The capacity is a rank's (its tokens are one GShard group), so the tokens dropped are those
// the layer drops on one device given the same rank's tokens: the single-device reference runs
// each rank's tokens as one call. The auxiliary loss (Switch's) is E · Σ_e f_e · P_e over this
// rank's tokens, f_e the fraction whose first choice is e and P_e the mean probability of e: 1
// when the load is balanced; aux_loss() holds the last forward's, to add (times a small
// weight) to the loss.
//
// Gradients: the all-to-all's backward is the reverse all-to-all, so an expert's gradient on
// its rank sums the contributions of every rank's tokens: the expert gradient of the whole
// group's loss. It must therefore be reduced over the data ranks that hold the same expert
// (the other expert groups), not over the expert group; the router, held whole by every rank,
// over both. The layer says which are which as a tp::ShardedLayer over the mesh's expert
// dimension: w1, b1, w2 and b2 cut along their first (expert) dimension; DataParallel
// averages them over Dims::replicas() and the router over Dims::batch() (Note [Process mesh]).
//
// Each rank's loss is scaled by its own sample count before backward (Note [Exact
// averaging]), so an expert's gradient sums every source rank's tokens with their ranks'
// weights: divided by the step's global sample count, it is the gradient of the mean over
// every rank's samples, as the dense parameters' are.

// Note [Auxiliary loss in backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A loss function sees the model's output, not its layers: under a pipeline the loss is the
// last stage's, and a mixture in an earlier stage cannot add its auxiliary loss there. With
// Options::aux_weight = w the layer adds it itself, as Megatron-Core's MoEAuxLossAutoScaler
// does: its output passes through a node whose backward passes the output's gradient on and
// gives the auxiliary loss the gradient w · s, where s is what the strategy multiplies the loss
// by before backward (BackwardScale, captured at forward: this rank's samples of the (micro-)
// batch times the loss scale; 1 outside a strategy). Backward through the output therefore
// computes the gradient of (loss + w · aux_loss) · s, on every stage alike: the gradient a
// user's `loss + w * aux_loss()` gives. The reported loss leaves it out. w = 0 (the default)
// adds nothing: add aux_loss() to the loss yourself, where the loss function can reach it.

struct Options {
  std::int64_t model = 0;         ///< d: the tokens' width
  std::int64_t hidden = 0;        ///< each expert's hidden width (an MLP d → hidden → d)
  int experts = 8;                ///< E: a multiple of the expert group's size
  int top_k = 1;                  ///< experts per token: 1 (Switch) or more (2: GShard)
  double capacity_factor = 1.25;  ///< capacity = ceil(factor · T · k / E) per expert; 0: dropless
  /// The auxiliary loss's weight when the layer adds it to backward itself (Note [Auxiliary
  /// loss in backward]: what a pipeline's stages need); 0: it adds nothing, add aux_loss()
  /// times a weight to the loss yourself.
  double aux_weight = 0;
};

namespace detail {

using tensor_parallel::detail::GroupHolder;  // a Group kept by autograd (tensor_parallel/regions.hpp)

// Rows sent by per-rank counts; the backward sends the gradient's rows back the other way.
struct AllToAllRows : torch::autograd::Function<AllToAllRows> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const tensor_parallel::Group& g, std::vector<std::int64_t> in_rows,
                            std::vector<std::int64_t> out_rows) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(c10::make_intrusive<GroupHolder>(g));
    ctx->saved_data["in_rows"] = in_rows;
    ctx->saved_data["out_rows"] = out_rows;
    return g.all_to_all(x, in_rows, out_rows);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto holder = c10::static_intrusive_pointer_cast<GroupHolder>(ctx->saved_data["group"].toCapsule());
    const auto in_rows = ctx->saved_data["in_rows"].toIntVector();
    const auto out_rows = ctx->saved_data["out_rows"].toIntVector();
    return {holder->group.all_to_all(grads[0].contiguous(), out_rows, in_rows), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

// The output unchanged; in backward its gradient passes on and `aux` gets `weight`: Note
// [Auxiliary loss in backward].
struct AuxLossInBackward : torch::autograd::Function<AuxLossInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& out, const at::Tensor& aux,
                            double weight) {
    ctx->saved_data["weight"] = weight;
    ctx->saved_data["aux"] = aux.detach();  // a scalar: its dtype and device
    return out.view_as(out);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto aux = ctx->saved_data["aux"].toTensor();
    return {grads[0], at::full({}, ctx->saved_data["weight"].toDouble(), aux.options()), at::Tensor()};
  }
};

}  // namespace detail

/// A mixture of experts over an expert group (Note [Experts over a group]). forward takes
/// tokens [T, d] (or [..., d], flattened and restored) and returns their outputs; a group of
/// one holds every expert: the single-device layer. Without a group it joins the expert group
/// of the strategy building it (tp::expert_group(): DataParallelOptions::expert_parallel), or
/// holds every expert outside one.
class MixtureOfExpertsImpl : public torch::nn::Module, public tensor_parallel::ShardedLayer {
 public:
  explicit MixtureOfExpertsImpl(Options o) : MixtureOfExpertsImpl(o, tensor_parallel::expert_group()) {}
  MixtureOfExpertsImpl(Options o, tensor_parallel::Group g) : options_(o), group_(std::move(g)) {
    const auto ep = group_.size();
    if (o.model <= 0 || o.hidden <= 0)
      throw error("moe::MixtureOfExperts", group_.world_rank(), "model and hidden must be > 0");
    if (o.experts < 1 || o.experts % ep != 0)
      throw error("moe::MixtureOfExperts", group_.world_rank(),
                  std::to_string(o.experts) + " experts cannot be shared equally by an expert group of " +
                      std::to_string(ep) + " ranks; give a multiple of " + std::to_string(ep));
    if (o.top_k < 1 || o.top_k > o.experts)
      throw error("moe::MixtureOfExperts", group_.world_rank(),
                  "top_k is " + std::to_string(o.top_k) + "; it must be 1.." + std::to_string(o.experts));
    if (o.capacity_factor < 0)
      throw error("moe::MixtureOfExperts", group_.world_rank(), "capacity_factor must be >= 0 (0: dropless)");
    if (!(o.aux_weight >= 0))
      throw error("moe::MixtureOfExperts", group_.world_rank(),
                  "aux_weight is " + std::to_string(o.aux_weight) + "; it must be >= 0 (0: the layer adds no loss)");
    // Under sequence parallelism each tensor rank holds other positions between blocks, and
    // would route them through a router and experts that are whole on every tensor rank: their
    // gradients would need a sum over the tensor group that no store makes.
    if (const auto* c = tensor_parallel::Construction::current(); c && c->sequence_parallel && c->group.size() > 1)
      throw error("moe::MixtureOfExperts", group_.world_rank(),
                  "built under sequence parallelism over a tensor group of " + std::to_string(c->group.size()) +
                      " ranks: each would route its own positions through the same router and experts, whose "
                      "gradients no store sums over the tensor group; build the model without sequence parallelism "
                      "(it cuts the activations between blocks; tensor parallelism alone takes a mixture)");
    local_ = o.experts / ep;
    router = register_module("router", torch::nn::Linear(torch::nn::LinearOptions(o.model, o.experts).bias(false)));
    // Every expert's weights drawn whole, as nn::Linear draws its own, and this rank's kept:
    // rank g's experts start from exactly the single-device layer's (Note [Initialising a slice]).
    const auto first = group_.rank() * local_;
    const auto draw = [&](std::int64_t fan_in, std::int64_t cols) {
      const double bound = 1.0 / std::sqrt(static_cast<double>(fan_in));
      return tensor_parallel::slice_of_drawn(o.experts, cols, first, local_, 0, cols,
                                             [&](at::Tensor& chunk) { chunk.uniform_(-bound, bound); });
    };
    w1 = register_parameter("w1", draw(o.model, o.model * o.hidden).view({local_, o.model, o.hidden}));
    b1 = register_parameter("b1", draw(o.model, o.hidden));
    w2 = register_parameter("w2", draw(o.hidden, o.hidden * o.model).view({local_, o.hidden, o.model}));
    b2 = register_parameter("b2", draw(o.hidden, o.model));
  }

  at::Tensor forward(const at::Tensor& input) {
    const auto& o = options_;
    if (input.size(-1) != o.model)
      throw error("moe::MixtureOfExperts", group_.world_rank(),
                  "tokens of width " + std::to_string(input.size(-1)) + " given to a layer of width " +
                      std::to_string(o.model));
    const auto x = input.reshape({-1, o.model});
    const auto T = x.size(0), E = static_cast<std::int64_t>(o.experts), k = static_cast<std::int64_t>(o.top_k);
    const auto probs = at::softmax(router->forward(x), -1);
    const auto [top, chosen] = probs.topk(k, -1);
    const auto gates = k == 1 ? top : top / top.sum(-1, /*keepdim=*/true);
    // Switch's auxiliary loss: E · Σ_e f_e · P_e (f from the first choices, no gradient).
    const auto first_choice = at::one_hot(chosen.select(1, 0), E).to(probs.scalar_type());
    aux_loss_ = (first_choice.mean(0) * probs.mean(0)).sum() * static_cast<double>(E);
    // Assignments in GShard's order: every token's first choice, then every token's second.
    const auto expert_of = chosen.t().reshape({-1});
    const auto token_of = at::arange(T, x.options().dtype(at::kLong)).repeat({k});
    const auto gate_of = gates.t().reshape({-1});
    const auto position = (at::one_hot(expert_of, E).cumsum(0) - 1).gather(1, expert_of.unsqueeze(1)).squeeze(1);
    auto kept = at::arange(k * T, x.options().dtype(at::kLong));
    if (o.capacity_factor > 0) {
      capacity_ = capacity_of(o.capacity_factor, T * k, E);
      kept = kept.masked_select(position < capacity_);
    } else {
      capacity_ = -1;
    }
    dropped_ = k * T - kept.numel();
    // Dispatch order: by expert, then by position.
    const auto key = expert_of.index_select(0, kept) * (k * T + 1) + position.index_select(0, kept);
    const auto sent = kept.index_select(0, std::get<1>(key.sort()));
    const auto rows = x.index_select(0, token_of.index_select(0, sent));
    const auto per_expert = at::bincount(expert_of.index_select(0, sent), {}, E);  // [E]
    const auto results = experts_on_ranks(rows, per_expert);
    const auto weighted = results * gate_of.index_select(0, sent).unsqueeze(1);
    auto out = at::zeros({T, o.model}, weighted.options()).index_add(0, token_of.index_select(0, sent), weighted);
    if (o.aux_weight > 0 && out.requires_grad())  // Note [Auxiliary loss in backward]
      out = detail::AuxLossInBackward::apply(out, aux_loss_, o.aux_weight * BackwardScale::current());
    return out.view(input.sizes());
  }

  /// The last forward's auxiliary load-balancing loss (Switch's; 1 when balanced).
  [[nodiscard]] const at::Tensor& aux_loss() const noexcept { return aux_loss_; }
  /// How many of the last forward's token-expert assignments the capacity dropped.
  [[nodiscard]] std::int64_t dropped() const noexcept { return dropped_; }
  /// The last forward's capacity per expert (-1: dropless).
  [[nodiscard]] std::int64_t capacity() const noexcept { return capacity_; }
  /// ceil(factor · assignments / experts), where a product meant to be whole is taken as
  /// whole: in doubles 1.1 · 100 / 2 is 55.000000000000007, whose ceil would be 56.
  [[nodiscard]] static std::int64_t capacity_of(double factor, std::int64_t assignments, std::int64_t experts) {
    const double c = factor * static_cast<double>(assignments) / static_cast<double>(experts);
    const double whole = std::round(c);
    return static_cast<std::int64_t>(std::abs(c - whole) <= 1e-9 * std::max(1.0, whole) ? whole : std::ceil(c));
  }
  /// The experts this rank holds: [first, first + count).
  [[nodiscard]] std::pair<int, int> local_experts() const noexcept {
    return {group_.rank() * static_cast<int>(local_), static_cast<int>(local_)};
  }
  [[nodiscard]] const tensor_parallel::Group& group() const noexcept { return group_; }
  [[nodiscard]] const Options& options() const noexcept { return options_; }
  /// Whether `p` is one of this layer's expert parameters (cut over the expert group; its
  /// gradient is reduced over the ranks that hold the same experts) rather than the router's
  /// (whole on every rank): Note [Experts over a group].
  [[nodiscard]] bool is_expert_parameter(const at::Tensor& p) const noexcept {
    return p.is_same(w1) || p.is_same(b1) || p.is_same(w2) || p.is_same(b2);
  }
  /// The experts' parameters, cut along their first dimension over the expert group.
  [[nodiscard]] std::vector<tensor_parallel::ShardedParameter> slices() const override {
    const std::int64_t first = group_.rank() * local_, whole = options_.experts;
    return {{"w1", 0, first, whole}, {"b1", 0, first, whole}, {"w2", 0, first, whole}, {"b2", 0, first, whole}};
  }
  [[nodiscard]] const tensor_parallel::Group& slice_group() const override { return group_; }
  [[nodiscard]] Dim slice_dim() const override { return Dim::expert; }

  torch::nn::Linear router{nullptr};
  at::Tensor w1, b1, w2, b2;  // this rank's experts: [local, d, hidden], [local, hidden], [local, hidden, d], [local, d]

 private:
  // Steps 3-5 of Note [Experts over a group]: `rows` ordered by expert, per_expert[e] of them
  // for expert e; returns each row's expert output, in the same order.
  at::Tensor experts_on_ranks(const at::Tensor& rows, const at::Tensor& per_expert) {
    const auto ep = static_cast<std::int64_t>(group_.size());
    // What every rank sends this rank's experts: [ep, local] counts, source-major.
    const auto received_counts = group_.all_to_all(per_expert, 0, 0).view({ep, local_});
    // The counts are read on the host (the tokens may be on a GPU).
    const auto sent_sum = per_expert.view({ep, local_}).sum(1).cpu(), received_sum = received_counts.sum(1).cpu();
    const auto* s = sent_sum.data_ptr<std::int64_t>();
    const auto* r = received_sum.data_ptr<std::int64_t>();
    const std::vector<std::int64_t> in_rows(s, s + ep), out_rows(r, r + ep);
    const auto arrived = ep == 1 ? rows : detail::AllToAllRows::apply(rows, group_, in_rows, out_rows);
    // Arrived rows are source-major, then by local expert; each expert takes its rows from
    // every source, computes, and the results go back to where the rows came from.
    const auto counts = received_counts.cpu().contiguous();
    const auto* c = counts.data_ptr<std::int64_t>();
    std::vector<std::vector<at::Tensor>> per_local(static_cast<std::size_t>(local_));
    std::vector<std::pair<std::int64_t, std::int64_t>> where;  // (expert, index in its list) per segment
    std::int64_t offset = 0;
    for (std::int64_t src = 0; src < ep; ++src)
      for (std::int64_t e = 0; e < local_; ++e) {
        const auto n = c[src * local_ + e];
        auto& list = per_local[static_cast<std::size_t>(e)];
        where.emplace_back(e, static_cast<std::int64_t>(list.size()));
        list.push_back(arrived.narrow(0, offset, n));
        offset += n;
      }
    std::vector<std::vector<at::Tensor>> outputs(static_cast<std::size_t>(local_));
    for (std::int64_t e = 0; e < local_; ++e) {
      const auto& list = per_local[static_cast<std::size_t>(e)];
      const auto in = at::cat(list);
      const auto h = at::gelu(at::addmm(b1[e], in, w1[e]));
      const auto y = at::addmm(b2[e], h, w2[e]);
      std::vector<std::int64_t> sizes;
      for (const auto& t : list) sizes.push_back(t.size(0));
      outputs[static_cast<std::size_t>(e)] = y.split_with_sizes(sizes);
    }
    std::vector<at::Tensor> back;
    for (const auto& [e, i] : where) back.push_back(outputs[static_cast<std::size_t>(e)][static_cast<std::size_t>(i)]);
    const auto results = at::cat(back);
    return ep == 1 ? results : detail::AllToAllRows::apply(results, group_, out_rows, in_rows);
  }

  Options options_;
  tensor_parallel::Group group_;
  std::int64_t local_ = 1;
  at::Tensor aux_loss_;
  std::int64_t dropped_ = 0, capacity_ = -1;
};
TORCH_MODULE(MixtureOfExperts);

}  // namespace paratrain::moe
