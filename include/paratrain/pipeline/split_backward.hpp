#pragma once
/// \file
/// paratrain::pipeline::detail::SplitBackward — a stage's backward in two halves: the
/// gradient of its inputs first (to send on), the gradient of its weights later.

#include <torch/csrc/autograd/edge.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/variable.h>

#include <cstddef>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace paratrain::pipeline::detail {

// Note [Splitting backward]
// Zero-bubble schedules (Qi et al. 2023) run a stage's backward as B, the gradient of
// the stage's inputs, which the previous stage waits for, and W, the gradient of its
// weights, which nobody waits for and which fills the pipeline's idle ticks. LibTorch's
// autograd computes both in one pass; we cut its graph where they part:
//
//  - D is the set of graph nodes from which a stage input is reachable: the chain B
//    must walk (in an MLP, every layer's matmul backward).
//  - A *weight node* is a node of D with an edge leaving D towards a parameter (a
//    Linear's AddmmBackward: one edge to the layer's input, in D, and one to its weight).
//    Nothing outside D leads back into D (it would then reach an input).
//
// B runs the engine from the stage outputs to the inputs' edges, and also captures the
// gradient flowing into each weight node (the engine hands over a node's whole input
// when it is a requested output, and still runs it, computing only its edges into D).
// W then cuts each weight node's edges into D (B is done with them) and runs the engine
// once from all weight nodes, with their captured gradients, and from the outputs that
// lie outside D: each weight node now computes only its weight half, the subgraphs
// outside D (a transpose, a projection's split weight, a tensor made from parameters and
// used twice) receive every contribution before they run, and the accumulators fire
// DataParallel's bucket hooks. So B + W cost one backward, not two, and every parameter's
// gradient is the sum a plain backward makes. A stage whose inputs need no gradient (the
// first) has an empty D: B is nothing and W is the plain backward.

using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::Node;
using torch::autograd::variable_list;

/// One micro-batch's backward on one stage, run as B then W. Note [Splitting backward].
class SplitBackward {
 public:
  /// `outputs`: the stage's outputs (roots of its graph); `grads`: their gradients
  /// (undefined for a scalar loss); `inputs`: the stage's inputs that need a gradient.
  SplitBackward(variable_list outputs, variable_list grads, variable_list inputs)
      : inputs_(std::move(inputs)) {
    // The roots' edges hold the graph alive; the output tensors are not needed after.
    for (std::size_t i = 0; i < outputs.size(); ++i)
      if (outputs[i].requires_grad()) {
        roots_.push_back(torch::autograd::impl::gradient_edge(outputs[i]));
        root_grads_.push_back(grads[i].defined() ? std::move(grads[i]) : at::ones_like(outputs[i]));
      }
  }

  /// B: the inputs' gradients (one per input, in order; zeros where none flows).
  variable_list input_gradients() {
    if (inputs_.empty() || roots_.empty()) return zeros_like_inputs();
    find_weight_nodes();
    edge_list wanted;
    for (const auto& x : inputs_) wanted.push_back(torch::autograd::impl::gradient_edge(x));
    for (const auto& w : weight_nodes_)
      for (std::uint32_t k = 0; k < w.node->num_inputs(); ++k) wanted.emplace_back(w.node, k);
    auto got = engine().execute(roots_, root_grads_, /*keep_graph=*/true, /*create_graph=*/false,
                                /*accumulate_grad=*/false, wanted);
    variable_list out(got.begin(), got.begin() + static_cast<std::ptrdiff_t>(inputs_.size()));
    for (std::size_t i = 0; i < out.size(); ++i)
      if (!out[i].defined()) out[i] = at::zeros_like(inputs_[i]);
    std::size_t at = inputs_.size();
    for (auto& w : weight_nodes_)
      for (std::uint32_t k = 0; k < w.node->num_inputs(); ++k) w.incoming.push_back(got[at++]);
    split_ = true;
    return out;
  }

  /// W: accumulates the parameters' gradients into their .grad; frees the graph.
  void weight_gradients() {
    if (!split_) {  // B found nothing to split off: this is the whole backward
      if (!roots_.empty())
        engine().execute(roots_, root_grads_, /*keep_graph=*/false, /*create_graph=*/false,
                         /*accumulate_grad=*/true);
      release();
      return;
    }
    edge_list roots = std::move(outside_roots_);
    variable_list grads = std::move(outside_grads_);
    for (auto& w : weight_nodes_) {
      // B is done with the chain: without these edges the engine computes only the
      // weight half of the node and never walks D again.
      for (const auto i : w.into_d) w.node->next_edges()[i] = Edge();
      for (std::uint32_t k = 0; k < w.node->num_inputs(); ++k)
        if (w.incoming[k].defined()) {
          roots.emplace_back(w.node, k);
          grads.push_back(std::move(w.incoming[k]));
        }
    }
    if (!roots.empty())
      engine().execute(roots, grads, /*keep_graph=*/false, /*create_graph=*/false, /*accumulate_grad=*/true);
    release();
  }

 private:
  struct WeightNode {
    std::shared_ptr<Node> node;
    std::vector<std::size_t> into_d;  // its edges into D, cut before W
    variable_list incoming;           // the gradient B captured flowing into it
  };

  static torch::autograd::Engine& engine() { return torch::autograd::Engine::get_default_engine(); }

  variable_list zeros_like_inputs() const {
    variable_list out;
    for (const auto& x : inputs_) out.push_back(at::zeros_like(x));
    return out;
  }

  // Walks the graph from the roots once, depth first, and classifies its nodes.
  void find_weight_nodes() {
    std::unordered_set<const Node*> input_nodes;
    for (const auto& x : inputs_) input_nodes.insert(torch::autograd::impl::gradient_edge(x).function.get());
    std::unordered_map<const Node*, bool> in_d, to_param;
    // Iterative post-order: a node is classified once its children are.
    std::vector<std::pair<Node*, bool>> stack;
    for (const auto& r : roots_)
      if (r.function) stack.emplace_back(r.function.get(), false);
    std::vector<Node*> order;
    std::unordered_set<const Node*> seen;
    while (!stack.empty()) {
      auto [node, expanded] = stack.back();
      stack.pop_back();
      if (expanded) {
        order.push_back(node);
        continue;
      }
      if (!seen.insert(node).second) continue;
      stack.emplace_back(node, true);
      for (const auto& e : node->next_edges())
        if (e.function && !seen.count(e.function.get())) stack.emplace_back(e.function.get(), false);
    }
    for (Node* node : order) {  // children before parents
      bool d = input_nodes.count(node) > 0;
      // A leaf's accumulator that is not a stage input belongs to a parameter.
      bool p = !d && node->next_edges().empty() && node->num_inputs() == 1 && is_accumulator(node);
      for (const auto& e : node->next_edges()) {
        if (!e.function) continue;
        d = d || in_d[e.function.get()];
        p = p || to_param[e.function.get()];
      }
      in_d[node] = d;
      to_param[node] = p;
    }
    for (Node* node : order) {
      if (!in_d[node] || input_nodes.count(node)) continue;
      bool weights = false;
      std::vector<std::size_t> into_d;
      const auto& edges = node->next_edges();
      for (std::size_t i = 0; i < edges.size(); ++i) {
        const auto* child = edges[i].function.get();
        if (child == nullptr) continue;
        if (in_d[child]) into_d.push_back(i);
        else weights = weights || to_param[child];
      }
      if (weights) weight_nodes_.push_back({node->shared_from_this(), std::move(into_d), {}});
    }
    // Outputs computed from parameters alone (outside D): W's roots as they are.
    for (std::size_t i = 0; i < roots_.size(); ++i) {
      const auto* f = roots_[i].function.get();
      if (f != nullptr && !in_d[f] && to_param[f]) {
        outside_roots_.push_back(roots_[i]);
        outside_grads_.push_back(root_grads_[i]);
      }
    }
  }

  static bool is_accumulator(const Node* node) {
    return dynamic_cast<const torch::autograd::AccumulateGrad*>(node) != nullptr;
  }

  void release() {
    weight_nodes_.clear();
    outside_roots_.clear();
    outside_grads_.clear();
    roots_.clear();
    root_grads_.clear();
    inputs_.clear();
  }

  variable_list inputs_;
  edge_list roots_;
  variable_list root_grads_;
  std::vector<WeightNode> weight_nodes_;
  edge_list outside_roots_;  // outputs whose graph never reaches an input
  variable_list outside_grads_;
  bool split_ = false;
};

}  // namespace paratrain::pipeline::detail
