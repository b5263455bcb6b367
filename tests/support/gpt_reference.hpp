#pragma once
// The tensor-parallelism tests' model and reference (issue #38): a GPT of paratrain::tp
// layers, the same model written in plain LibTorch on one device (built in the order the tp
// layers draw their weights), the reference's slice of each parameter a rank of the tp model
// holds, and the token batches of each step. Shared by the MPI suite
// (unit/tensor_parallel_test.cpp), the Gloo suite and the GPU suite.
#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "../../examples/gpt/model.hpp"
#include "paratrain/strategy/data_parallel.hpp"
#include "paratrain/tensor_parallel/cross_entropy.hpp"
#include "paratrain/tensor_parallel/dropout.hpp"
#include "paratrain/tensor_parallel/sharding.hpp"
#include "support/doctest.hpp"

namespace paratrain_test::gpt {

namespace tp = paratrain::tp;

// The whole parameters `whole_of(name)` gives (a single-device reference's), each as the part
// `model`'s rank holds of it: its slice where a layer cuts the parameter over a group of the
// mesh (tp::sliced_parameters_of: tensor or expert), else whole; `model`'s parameters order.
template <class WholeOf>
std::vector<torch::Tensor> as_held(const torch::nn::Module& model, WholeOf&& whole_of) {
  const auto sliced = tp::sliced_parameters_of(model);
  std::vector<torch::Tensor> out;
  for (const auto& p : model.named_parameters()) {
    torch::Tensor w = whole_of(p.key());
    if (const auto it = sliced.find(p.key()); it != sliced.end())
      w = w.narrow(it->second.slice.dim, it->second.slice.offset, p.value().size(it->second.slice.dim));
    out.push_back(w);
  }
  return out;
}

// The model is the GPT example's (examples/gpt/model.hpp), at its default sizes, which every
// degree of 1-4 divides; the reference below is the same model written without paratrain.
using Config = ::gpt::Config;
using Gpt = ::gpt::Gpt;

// ---- the reference: the same model in plain LibTorch, whole, on one device ------------
// Built in the order the tp layers draw (their notes say it), its dropouts the keyed ones
// over whole tensors (Note [Keyed dropout]: the mask is a published function of the place).
struct RefBlockImpl : torch::nn::Module {
  RefBlockImpl(const Config& c) : heads(c.heads) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden})));
    q = register_module("q", torch::nn::Linear(c.hidden, c.hidden));
    k = register_module("k", torch::nn::Linear(c.hidden, c.hidden));
    v = register_module("v", torch::nn::Linear(c.hidden, c.hidden));
    out = register_module("out", torch::nn::Linear(c.hidden, c.hidden));
    attention_drop = register_module("attention_drop", tp::Dropout(c.dropout));
    drop1 = register_module("drop1", tp::Dropout(c.dropout));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden})));
    fc1 = register_module("fc1", torch::nn::Linear(c.hidden, c.ffn));
    fc2 = register_module("fc2", torch::nn::Linear(c.ffn, c.hidden));
    drop2 = register_module("drop2", tp::Dropout(c.dropout));
  }
  torch::Tensor forward(torch::Tensor x) {
    const auto b = x.size(0), s = x.size(1), h = x.size(2), d = h / heads;
    const auto a = ln1(x);
    const auto split = [&](const torch::Tensor& t) { return t.view({b, s, heads, d}).transpose(1, 2); };
    auto scores = torch::matmul(split(q(a)), split(k(a)).transpose(-2, -1)) / std::sqrt(double(d));
    scores = scores.masked_fill(torch::ones({s, s}, torch::kBool).triu(1), -INFINITY);
    const auto mixed = torch::matmul(attention_drop(scores.softmax(-1)), split(v(a))).transpose(1, 2).reshape({b, s, h});
    x = x + drop1(out(mixed));
    return x + drop2(fc2(torch::gelu(fc1(ln2(x)))));
  }
  std::int64_t heads;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, out{nullptr}, fc1{nullptr}, fc2{nullptr};
  tp::Dropout attention_drop{nullptr}, drop1{nullptr}, drop2{nullptr};
};
TORCH_MODULE(RefBlock);

struct RefGptImpl : torch::nn::Module {
  // `back_seed` >= 0: the generator is seeded with it before the second block, as a pipeline's
  // second stage is built from a seed of its own.
  explicit RefGptImpl(Config c = {}, int back_seed = -1) {
    tokens = register_module("tokens", torch::nn::Embedding(c.vocabulary, c.hidden));
    position = register_parameter("position", torch::nn::Embedding(c.positions, c.hidden)->weight.detach().clone());
    drop = register_module("drop", tp::Dropout(c.dropout));
    for (std::int64_t i = 0; i < c.layers; ++i) {
      if (i == 1 && back_seed >= 0) torch::manual_seed(back_seed);
      blocks.push_back(register_module("block" + std::to_string(i), RefBlock(c)));
    }
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.hidden})));
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(c.hidden, c.vocabulary).bias(false)));
  }
  torch::Tensor forward(torch::Tensor ids) {
    auto x = drop(tokens(ids) + position.narrow(0, 0, ids.size(1)));
    for (auto& b : blocks) x = b(x);
    return head(ln(x));
  }
  torch::nn::Embedding tokens{nullptr};
  torch::Tensor position;
  tp::Dropout drop{nullptr};
  std::vector<RefBlock> blocks;
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(RefGpt);

// The reference's parameters, in the tp model's order, each cut as the tp model cuts it on
// this rank (its sharded parameters name their slice).
inline std::vector<torch::Tensor> reference_slices(RefGpt& ref, const torch::nn::Module& model) {
  std::vector<torch::Tensor> whole;
  const auto r = ref->named_parameters();
  auto at = [&](const std::string& n) { return r[n].detach(); };
  // Names differ only where the layers nest differently: map the tp names onto the reference's.
  const auto map = [](std::string n) {
    if (n.size() > 2 && n[1] == '.' && std::isdigit(static_cast<unsigned char>(n[0]))) n = n.substr(2);  // a stage's "0."
    const auto replace = [&](const std::string& from, const std::string& to) {
      if (const auto p = n.find(from); p != std::string::npos) n.replace(p, from.size(), to);
    };
    replace("embeddings.tokens.weight", "tokens.weight");
    replace("embeddings.position", "position");
    replace("attention.q.", "q.");
    replace("attention.k.", "k.");
    replace("attention.v.", "v.");
    replace("attention.out.", "out.");
    replace("mlp.fc1.", "fc1.");
    replace("mlp.fc2.", "fc2.");
    return n;
  };
  return as_held(model, [&](const std::string& name) { return at(map(name)); });
}

inline double max_relative_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    REQUIRE(a[i].sizes() == b[i].sizes());
    worst = std::max(worst, ((a[i] - b[i]).abs().max() / b[i].abs().max().clamp_min(1e-12)).item<double>());
  }
  return worst;
}

// The worst relative difference of a pipeline's held parameters (`strategy`: its stages()
// and full_parameters()) from reference stages on one device, given in stage order: stage i's
// parameters are named "<i>.<name in the stage>" (Note [Stage names]).
template <class Strategy, class... Ref>
double stages_difference(Strategy& strategy, const Ref&... reference) {
  std::map<std::string, torch::Tensor> want;
  int stage = 0;
  for (const torch::nn::Module* ref : {static_cast<const torch::nn::Module*>(reference.get())...}) {
    for (const auto& item : ref->named_parameters()) want[std::to_string(stage) + "." + item.key()] = item.value();
    ++stage;
  }
  const auto held = as_held(*strategy.stages(), [&](const std::string& n) { return want.at(n); });
  return max_relative_difference(strategy.full_parameters(), held);
}

// Step k's token ids for `samples` sequences of `length`, and their targets (the next tokens).
inline std::pair<torch::Tensor, torch::Tensor> tokens_of_step(int step, std::int64_t samples, const Config& c,
                                                       std::int64_t length) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  const auto ids = at::randint(c.vocabulary, {samples, length + 1}, g, at::kLong);
  return {ids.narrow(1, 0, length).contiguous(), ids.narrow(1, 1, length).contiguous()};
}

/// Steps [first, last) of the single-device reference with `opt`: each on tokens_of_step's
/// `sequences` sequences, the mean cross-entropy over every token.
inline void train_reference(RefGpt& ref, torch::optim::Optimizer& opt, const Config& c, std::int64_t sequences,
                            int first, int last) {
  for (int step = first; step < last; ++step) {
    const auto [ids, targets] = tokens_of_step(step, sequences, c, c.positions);
    opt.zero_grad();
    torch::nn::functional::cross_entropy(ref(ids).reshape({-1, c.vocabulary}), targets.reshape({-1})).backward();
    opt.step();
  }
}

/// Trains Gpt at tensor degree = the size of `world` (sequence-parallel where asked; dropout
/// on), its parameters and batches on `device`, and the reference on the CPU on the same 3
/// sequences per step, SGD with momentum, 3 steps; returns the worst relative difference of
/// the parameters (compared on the CPU).
template <class Comm>
double tensor_parallel_against_reference(Comm world, bool sequence_parallel, at::Device device = at::kCPU) {
  const Config c;
  torch::manual_seed(7);
  RefGpt ref(c);
  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::manual_seed(7);
  const int t = world.size();
  paratrain::DataParallel<Gpt, Comm, torch::optim::SGD> s([&] {
                                                            Gpt g(c);
                                                            g->to(device);
                                                            return g;
                                                          },
                                                          std::move(world),
                                                          torch::optim::SGDOptions(0.05).momentum(0.9),
                                                          {.tensor_parallel = t, .sequence_parallel = sequence_parallel});
  const tp::CrossEntropy loss{s.tensor_group()};
  for (int step = 0; step < 3; ++step) {
    const auto [ids, targets] = tokens_of_step(step, 3, c, c.positions);
    train_reference(ref, ref_opt, c, 3, step, step + 1);
    s.step(paratrain::Batch(ids.to(device), targets.to(device)), loss);
  }
  std::vector<torch::Tensor> got;
  for (const auto& p : s.full_parameters()) got.push_back(p.cpu());
  return max_relative_difference(got, reference_slices(ref, *s.model()));
}

}  // namespace paratrain_test::gpt
