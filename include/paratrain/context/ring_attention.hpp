#pragma once
/// \file
/// paratrain::cp::ring_attention — attention over a sequence cut across a context group, the
/// key and value blocks passed around the group (Note [Ring attention]); and cp::attention
/// over a group, by the algorithm its options choose.

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "paratrain/context/all_to_all_attention.hpp"
#include "paratrain/context/attention.hpp"
#include "paratrain/context/layout.hpp"
#include "paratrain/core/error.hpp"
#include "paratrain/tensor_parallel/group.hpp"
#include "paratrain/tensor_parallel/regions.hpp"

namespace paratrain::cp {

// Note [Ring attention]
// ~~~~~~~~~~~~~~~~~~~~~
// Each rank of a context group holds its queries, keys and values, S/cp positions of every
// head (Note [Sequence layouts]). Ring attention (Liu et al. 2023) keeps the queries where
// they are and passes the key and value blocks around the group: at step i rank r holds the
// block of rank r−i, attends its queries to it, and at the end of cp steps has seen every key.
// The softmax over all keys is assembled block by block (the online softmax of Milakov &
// Gimelshein 2018 and FlashAttention): each block gives its normalised output and the
// log-sum-exp of its scores, and two partial results merge as
//   lse = log(e^lse₁ + e^lse₂),  out = out₁·e^(lse₁−lse) + out₂·e^(lse₂−lse),
// a block whose keys are all hidden (lse = −∞) adding nothing. With `overlap`, the next block
// is sent (Group::shift_async, one place along the ring) before this one is computed, so the
// exchange runs under the products (tested after each tile: Open MPI without asynchronous
// progress moves a large message only inside its calls); without it, one after the other
// (the benchmark's reference).
//
// Backward goes round the ring again, recomputing each block's probabilities from the saved
// log-sum-exp (P = e^(q·kᵀ·scale − lse)): dv += Pᵀ·dO, dS = P ⊙ (dO·vᵀ − rowsum(dO ⊙ O)),
// dq += dS·k·scale, dk += dSᵀ·q·scale. The key and value gradients of a block travel with it:
// rank r adds its part to the block's accumulator and passes it on, and after cp passes each
// accumulator is home with every rank's part. What autograd keeps is q, k, v, the output and
// the log-sum-exp: a rank's activations fall as 1/cp, and the scores, [B, H, S/cp, S/cp] a
// block, live one block at a time. Each rank sends, a layer, 2·(cp−1) blocks forward (keys and
// values) and 2·(cp−1) + 2·cp backward (those again, and their gradients), each of 1/cp of
// the sequence's keys or values.
//
// Under a causal mask a query chunk skips the key chunks after it and masks only the one it
// overlaps. With Layout::contiguous that idles ranks (the first rank's queries see only its
// own block); with Layout::zigzag each rank holds an early and a late chunk, and at every
// step after the first every rank computes two of its four chunk pairs: the same work
// everywhere, and half of the unmasked attention's. Key chunks are cut into tiles whose scores
// take at most AttentionOptions::tile_bytes (16 MiB; the online softmax merges tiles as it
// merges blocks): glibc maps larger blocks afresh at every use (Note [Allocator]), and their
// page faults cost more than the products. A query whose every key is hidden gets
// zeros here (cp::attention on one device gives NaN).

namespace detail {

// A block's part of the attention of some queries: normalised over the block's keys, and the
// log-sum-exp of their scores.
struct Partial {
  at::Tensor out;  // [B, H, Lq, D]
  at::Tensor lse;  // [B, H, Lq]
};

// What a query chunk sees of a key chunk under the causal mask.
enum class Seen : std::uint8_t { nothing, everything, some };

[[nodiscard]] inline Seen seen(const Chunk& q, const Chunk& k, bool causal) {
  if (!causal) return Seen::everything;
  if (k.start > q.start + q.length - 1) return Seen::nothing;
  if (k.start + k.length - 1 <= q.start) return Seen::everything;
  return Seen::some;
}

// True where a query of chunk q may not see a key of chunk k: the causal mask where the chunks
// overlap, the keys' padding; undefined where nothing is hidden.
[[nodiscard]] inline at::Tensor chunk_mask(const Chunk& q, const Chunk& k, Seen s, const at::Tensor& padding,
                                           const at::Tensor& like) {
  at::Tensor m;
  if (s == Seen::some) {
    const auto o = like.options().dtype(at::kLong);
    m = at::arange(k.start, k.start + k.length, o).view({1, 1, 1, -1}) >
        at::arange(q.start, q.start + q.length, o).view({1, 1, -1, 1});
  }
  if (padding.defined()) {
    const auto pad = padding.narrow(1, k.start, k.length).view({like.size(0), 1, 1, -1});
    m = m.defined() ? at::logical_or(m, pad) : pad;
  }
  return m;
}

// lse with −∞ (every key hidden) as 0, so that e^(x − it) is 0 where x is −∞.
[[nodiscard]] inline at::Tensor finite(const at::Tensor& lse) { return lse.masked_fill(at::isinf(lse), 0); }

[[nodiscard]] inline at::Tensor scores(const at::Tensor& q, const at::Tensor& k, const at::Tensor& mask, double scale) {
  auto s = at::matmul(q, k.transpose(2, 3)).mul_(scale);
  if (mask.defined()) s.masked_fill_(mask, minus_infinity);
  return s;
}

[[nodiscard]] inline Partial block(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& mask, double scale) {
  const auto s = scores(q, k, mask, scale);
  auto lse = at::logsumexp(s, -1);
  return {at::matmul(at::exp(s - finite(lse).unsqueeze(-1)), v), std::move(lse)};
}

// Merges a block's part into the running one (views of the whole result, written in place).
inline void merge(at::Tensor out, at::Tensor lse, const Partial& b) {
  const auto both = at::logaddexp(lse, b.lse);
  const auto f = finite(both);
  out.copy_(out * at::exp(lse - f).unsqueeze(-1) + b.out * at::exp(b.lse - f).unsqueeze(-1));
  lse.copy_(both);
}

struct Ring {
  tensor_parallel::Group group;
  bool causal = false;
  double scale = 1;
  Layout layout = Layout::contiguous;
  bool overlap = true;
  at::Tensor padding;  // [B, S] or undefined
  std::int64_t tile_bytes = std::int64_t{16} << 20;

  [[nodiscard]] std::vector<Chunk> chunks_of(int rank, std::int64_t local) const {
    return chunks(local * group.size(), rank, group.size(), layout);
  }
  // Rank `rank`'s key chunks cut into tiles whose scores against `queries` positions stay
  // within tile_bytes (Note [Ring attention]).
  [[nodiscard]] std::vector<Chunk> key_tiles(int rank, const at::Tensor& q, std::int64_t queries) const {
    const auto row = q.size(0) * q.size(1) * queries * static_cast<std::int64_t>(q.element_size());
    const auto most = std::max<std::int64_t>(1, tile_bytes / std::max<std::int64_t>(row, 1));
    std::vector<Chunk> out;
    for (const auto& c : chunks_of(rank, q.size(2)))
      for (std::int64_t i = 0; i < c.length; i += most)
        out.push_back({c.start + i, std::min(most, c.length - i), c.offset + i});
    return out;
  }

  // The block the ring brings next, started under this step's products or after them.
  [[nodiscard]] tensor_parallel::Pending pass(const at::Tensor& kv) const { return group.shift_async(kv); }

  // q [B, H, Sc, D], kv [2, B, H, Sc, D] → out [B, H, Sc, D], lse [B, H, Sc].
  [[nodiscard]] Partial forward(const at::Tensor& q, at::Tensor kv) const {
    const int r = group.rank(), p = group.size();
    const auto mine = chunks_of(r, q.size(2));
    Partial result{at::zeros_like(q), at::full({q.size(0), q.size(1), q.size(2)}, minus_infinity, q.options())};
    for (int step = 0; step < p; ++step) {
      const bool more = step + 1 < p;
      tensor_parallel::Pending next;
      if (more && overlap) next = pass(kv);
      for (const auto& qc : mine)
        for (const auto& kc : key_tiles((r - step + p) % p, q, qc.length)) {
          const auto s = seen(qc, kc, causal);
          if (s == Seen::nothing) continue;
          const auto part = block(q.narrow(2, qc.offset, qc.length), kv[0].narrow(2, kc.offset, kc.length),
                                  kv[1].narrow(2, kc.offset, kc.length), chunk_mask(qc, kc, s, padding, q), scale);
          merge(result.out.narrow(2, qc.offset, qc.length), result.lse.narrow(2, qc.offset, qc.length), part);
          if (more && overlap) (void)next.test();  // progress: Open MPI moves a large block only when called
        }
      if (more) kv = overlap ? next.wait() : pass(kv).wait();
    }
    return result;
  }

  // The gradients of q and of kv (Note [Ring attention]'s backward).
  [[nodiscard]] std::pair<at::Tensor, at::Tensor> backward(const at::Tensor& q, at::Tensor kv, const at::Tensor& out,
                                                           const at::Tensor& lse, const at::Tensor& dout) const {
    const int r = group.rank(), p = group.size();
    const auto mine = chunks_of(r, q.size(2));
    const auto delta = (dout * out).sum(-1);  // [B, H, Sc]
    auto dq = at::zeros_like(q);
    tensor_parallel::Pending carried;  // the previous block's gradient accumulator, on its way on
    at::Tensor arrived;
    for (int step = 0; step < p; ++step) {
      const bool more = step + 1 < p;
      tensor_parallel::Pending next;
      if (more && overlap) next = pass(kv);
      auto dkv = at::zeros_like(kv);
      for (const auto& qc : mine)
        for (const auto& kc : key_tiles((r - step + p) % p, q, qc.length)) {
          const auto s = seen(qc, kc, causal);
          if (s == Seen::nothing) continue;
          const auto qn = q.narrow(2, qc.offset, qc.length), don = dout.narrow(2, qc.offset, qc.length);
          const auto kn = kv[0].narrow(2, kc.offset, kc.length), vn = kv[1].narrow(2, kc.offset, kc.length);
          const auto pr = at::exp(scores(qn, kn, chunk_mask(qc, kc, s, padding, q), scale) -
                                  finite(lse.narrow(2, qc.offset, qc.length)).unsqueeze(-1));
          dkv[1].narrow(2, kc.offset, kc.length).add_(at::matmul(pr.transpose(2, 3), don));
          const auto ds = pr * (at::matmul(don, vn.transpose(2, 3)) - delta.narrow(2, qc.offset, qc.length).unsqueeze(-1));
          dq.narrow(2, qc.offset, qc.length).add_(at::matmul(ds, kn), scale);
          dkv[0].narrow(2, kc.offset, kc.length).add_(at::matmul(ds.transpose(2, 3), qn), scale);
          if (overlap && more) (void)next.test();
          if (overlap && step > 0) (void)carried.test();
        }
      if (step > 0) dkv.add_(overlap ? carried.wait() : arrived);
      if (overlap) {
        carried = pass(dkv);
      } else {
        arrived = pass(dkv).wait();
      }
      if (more) kv = overlap ? next.wait() : pass(kv).wait();
    }
    return {dq, overlap ? carried.wait() : arrived};
  }
};

// The ring and its options, kept by autograd for backward (the padding mask is no input of
// the function: LibTorch 1.13's Function::apply takes no undefined tensor).
struct RingHolder : torch::CustomClassHolder {
  explicit RingHolder(Ring r) : ring(std::move(r)) {}
  Ring ring;
};

struct RingAttention : torch::autograd::Function<RingAttention> {
  // q, k, v [B, Sc, H, D]; the result likewise.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const Ring& ring) {
    const auto qh = q.transpose(1, 2).contiguous();
    const auto kv = at::stack({k.transpose(1, 2), v.transpose(1, 2)});  // [2, B, H, Sc, D]
    auto result = ring.forward(qh, kv);
    ctx->saved_data["ring"] = c10::IValue::make_capsule(c10::make_intrusive<RingHolder>(ring));
    ctx->save_for_backward({qh, kv, result.out, result.lse});
    return result.out.transpose(1, 2);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto holder = c10::static_intrusive_pointer_cast<RingHolder>(ctx->saved_data["ring"].toCapsule());
    const auto [dq, dkv] =
        holder->ring.backward(saved[0], saved[1], saved[2], saved[3], grads[0].transpose(1, 2).contiguous());
    return {dq.transpose(1, 2), dkv[0].transpose(1, 2), dkv[1].transpose(1, 2), at::Tensor()};
  }
};

}  // namespace detail

/// Attention over sequences cut across `group` (a context group: `tp::Group(mesh,
/// Dim::context)`), by ring (Note [Ring attention]): q, k, v hold this rank's positions of
/// every head in `o.layout`, [B, S/cp, H, D], the result likewise; `key_padding_mask` is the
/// whole sequence's, [B, S]. Any head count.
[[nodiscard]] inline at::Tensor ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                               const tensor_parallel::Group& group, const AttentionOptions& o = {}) {
  detail::check_shapes("cp::ring_attention", q, k, v, group, o);
  const auto padding = o.key_padding_mask.defined() ? o.key_padding_mask.to(q.device()) : at::Tensor();
  return detail::RingAttention::apply(
      q, k, v,
      detail::Ring{group, o.causal, detail::scale_of(o, q.size(3)), o.layout, o.overlap, padding, o.tile_bytes});
}

/// Attention over sequences cut across `group`, by `o.algorithm`: ring_attention (any head
/// count; its exchanges under its products) or all_to_all_attention (heads a multiple of the
/// group's size; fewer, larger exchanges). Both equal cp::attention over the whole sequence
/// on one device.
[[nodiscard]] inline at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          const tensor_parallel::Group& group, const AttentionOptions& o) {
  return o.algorithm == Algorithm::ring ? ring_attention(q, k, v, group, o) : all_to_all_attention(q, k, v, group, o);
}

}  // namespace paratrain::cp
