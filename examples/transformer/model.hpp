#pragma once
// torch.nn.Transformer (batch_first=True) in LibTorch, cut where a pipeline cuts it: an
// Encoder stage, (src, tgt) -> (memory, tgt), and a Decoder stage, (memory, tgt) -> out;
// the whole Transformer is the two chained. The submodules are named as PyTorch names
// them ("encoder.layers.0.self_attn.in_proj_weight", "decoder.norm.weight", ...), so
// every build of the example (one device, DDP, ZeRO-3, pipeline) holds the same state
// under the same names. Each encoder and decoder layer is a paratrain::Unit: ZeRO stage 3
// gathers one layer's parameters at a time; elsewhere a Unit is the plain layer. The
// final LayerNorms are outside every unit and stay whole under ZeRO-3. Each layer can
// recompute its activations in backward instead of keeping them (Config::recompute:
// paratrain::Recompute, activation checkpointing).
//
// Shapes, as the reference program's batch_first model: src (N, S, E), tgt (N, T, E), out (N, T, E).
// LibTorch's layers take (sequence, batch, feature), so each stage transposes at its
// edges (views, no copies) and what passes between the stages is batch-first too.
#include <torch/torch.h>

#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "paratrain/strategy/recompute.hpp"
#include "paratrain/strategy/unit.hpp"

namespace transformer {

/// torch.nn.Transformer()'s defaults, and the reference program's data.
struct Config {
  std::int64_t d_model = 512;
  std::int64_t nhead = 8;
  std::int64_t encoder_layers = 6;
  std::int64_t decoder_layers = 6;
  std::int64_t dim_feedforward = 2048;
  double dropout = 0.1;
  std::int64_t samples = 2048;  ///< the synthetic data set: src = rand(samples, src_len, d_model)
  std::int64_t src_len = 1;     ///< the reference's torch.rand(2048, 1, 512)
  std::int64_t tgt_len = 20;    ///< the reference's torch.rand(2048, 20, 512)
  bool recompute = false;       ///< each layer's activations recomputed in backward, not kept
};

namespace detail {

// nn.Transformer._reset_parameters: Xavier-uniform for every parameter of more than one
// dimension (LibTorch's layers initialise otherwise on their own).
inline void xavier(torch::nn::Module& m) {
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters())
    if (p.dim() > 1) torch::nn::init::xavier_uniform_(p);
}

/// `count` layers from `make`, registered in `owner` as "layers.<i>" (PyTorch's names).
template <class Layer, class Make>
std::vector<Layer> layer_stack(torch::nn::Module& owner, torch::nn::ModuleList& list, std::int64_t count,
                               bool recompute, Make make) {
  list = owner.register_module("layers", torch::nn::ModuleList());
  std::vector<Layer> layers;
  for (std::int64_t i = 0; i < count; ++i) {
    Layer layer = make();
    layer->set_recompute(recompute);
    list->push_back(layer);
    layers.push_back(layer);
  }
  return layers;
}

}  // namespace detail

/// (src, tgt) -> (memory, tgt): the encoder stack over src; tgt passes through untouched
/// (it needs no gradient, so a pipeline sends none back for it).
struct EncoderImpl : torch::nn::Module {
  using Layer = paratrain::Unit<paratrain::Recompute<torch::nn::TransformerEncoderLayer>>;

  explicit EncoderImpl(const Config& c) {
    layers = detail::layer_stack<Layer>(*this, layers_list, c.encoder_layers, c.recompute, [&] {
      return Layer(torch::nn::TransformerEncoderLayerOptions(c.d_model, c.nhead)
                       .dim_feedforward(c.dim_feedforward)
                       .dropout(c.dropout));
    });
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
    detail::xavier(*this);
  }

  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor src, torch::Tensor tgt) {
    auto x = src.transpose(0, 1);  // (S, N, E)
    // A Unit's forward repeats its layer's parameter list without the defaults: no masks.
    for (auto& layer : layers) x = layer(x, torch::Tensor(), torch::Tensor());
    return {norm(x).transpose(0, 1), tgt};
  }

  torch::nn::ModuleList layers_list{nullptr};
  std::vector<Layer> layers;
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(Encoder);

/// (memory, tgt) -> out: the decoder stack over tgt, attending to memory.
struct DecoderImpl : torch::nn::Module {
  using Layer = paratrain::Unit<paratrain::Recompute<torch::nn::TransformerDecoderLayer>>;

  explicit DecoderImpl(const Config& c) {
    layers = detail::layer_stack<Layer>(*this, layers_list, c.decoder_layers, c.recompute, [&] {
      return Layer(torch::nn::TransformerDecoderLayerOptions(c.d_model, c.nhead)
                       .dim_feedforward(c.dim_feedforward)
                       .dropout(c.dropout));
    });
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.d_model})));
    detail::xavier(*this);
  }

  torch::Tensor forward(torch::Tensor memory, torch::Tensor tgt) {
    const auto m = memory.transpose(0, 1);  // (S, N, E)
    auto x = tgt.transpose(0, 1);           // (T, N, E)
    const torch::Tensor none;
    for (auto& layer : layers) x = layer(x, m, none, none, none, none);
    return norm(x).transpose(0, 1);  // (N, T, E)
  }

  torch::nn::ModuleList layers_list{nullptr};
  std::vector<Layer> layers;
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(Decoder);

/// Parameters of the encoder and of the decoder, from the configuration: per encoder layer
/// self-attention 4d² + 4d, feed-forward 2·d·ff + ff + d, two norms 4d; per decoder layer two
/// attentions 8d² + 8d, the feed-forward, three norms 6d; each stack's final norm 2d.
inline std::pair<double, double> parameter_counts(const Config& c) {
  const double d = double(c.d_model), ff = double(c.dim_feedforward);
  const double encoder = double(c.encoder_layers) * (4 * d * d + 2 * d * ff + 9 * d + ff) + 2 * d;
  const double decoder = double(c.decoder_layers) * (8 * d * d + 2 * d * ff + 15 * d + ff) + 2 * d;
  return {encoder, decoder};
}

/// Training FLOPs of one sample, forward and backward: 6 × parameters × the tokens they
/// see (the encoder's S source tokens, the decoder's T target tokens; Kaplan et al. 2020),
/// plus attention's score and value products, 12 · d per pair of positions per layer
/// (PaLM, Chowdhery et al. 2022, appendix B): S² per encoder layer, T² + T·S per decoder
/// layer (self- and cross-attention).
inline double flops_per_sample(const Config& c) {
  const auto [encoder, decoder] = parameter_counts(c);
  const double d = double(c.d_model), S = double(c.src_len), T = double(c.tgt_len);
  return 6 * (encoder * S + decoder * T) +
         12 * d * (double(c.encoder_layers) * S * S + double(c.decoder_layers) * (T * T + T * S));
}

/// The whole model: torch.nn.Transformer(batch_first=True), forward(src, tgt) -> out.
struct TransformerImpl : torch::nn::Module {
  TransformerImpl(Encoder e, Decoder d) {
    encoder = register_module("encoder", std::move(e));
    decoder = register_module("decoder", std::move(d));
  }
  explicit TransformerImpl(const Config& c) : TransformerImpl(Encoder(c), Decoder(c)) {}

  torch::Tensor forward(torch::Tensor src, torch::Tensor tgt) {
    auto [memory, t] = encoder(std::move(src), std::move(tgt));
    return decoder(std::move(memory), std::move(t));
  }

  Encoder encoder{nullptr};
  Decoder decoder{nullptr};
};
TORCH_MODULE(Transformer);

}  // namespace transformer
