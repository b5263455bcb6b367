#pragma once
/// \file
/// paratrain::cp::Layout — which positions of a sequence each rank of a context group holds,
/// and the functions that cut a sequence so and put it back together (Note [Sequence layouts]).

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "paratrain/core/error.hpp"
#include "paratrain/tensor_parallel/group.hpp"

namespace paratrain::cp {

// Note [Sequence layouts]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Context parallelism cuts a sequence of S positions over the cp ranks of a context group.
// Layout::contiguous gives rank c the positions [c·S/cp, (c+1)·S/cp). Under a causal mask
// that idles ranks: the last rank's queries see every key, the first rank's only their own,
// so ring attention's first rank would wait on the last at every step. Layout::zigzag cuts
// the sequence into 2·cp chunks and gives rank c chunks c and 2·cp−1−c (Brandon et al.
// 2023's striping, torchtitan's and Megatron-Core's head–tail order): every rank holds one
// early and one late chunk, and under a causal mask every rank computes the same number of
// query–key products at every ring step. A layout is a property of the whole model's
// activations, not of attention alone: the tokens, their position ids and their labels are
// cut by it (cp::shard), and attention is told it (AttentionOptions::layout), since its
// causal and padding masks are about positions in the whole sequence. Layers that treat
// positions alike (linears, norms, a token-wise loss) need not know it.

/// How a sequence is cut over a context group (Note [Sequence layouts]).
enum class Layout : std::uint8_t {
  contiguous,  ///< rank c: positions [c·S/cp, (c+1)·S/cp)
  zigzag,      ///< rank c: chunks c and 2·cp−1−c of 2·cp (balanced under a causal mask)
};

/// A run of consecutive positions a rank holds: positions [start, start + length), at
/// `offset` among the rank's own.
struct Chunk {
  std::int64_t start = 0;
  std::int64_t length = 0;
  std::int64_t offset = 0;
};

/// The chunks, in the rank's order, that rank `rank` of a context group of `size` holds of a
/// sequence of `length` positions. Throws where `length` cannot be cut so.
[[nodiscard]] inline std::vector<Chunk> chunks(std::int64_t length, int rank, int size, Layout layout) {
  const std::int64_t parts = layout == Layout::zigzag ? 2 * std::int64_t{size} : std::int64_t{size};
  if (size < 1 || rank < 0 || rank >= size || length < 0 || length % parts != 0)
    throw error("cp::chunks", rank,
                "a sequence of " + std::to_string(length) + " positions cannot be cut into the " +
                    std::to_string(parts) + " equal chunks " +
                    (layout == Layout::zigzag ? "the zigzag layout over " : "a context group of ") +
                    std::to_string(size) + " ranks needs; pad it to a multiple of " + std::to_string(parts));
  const auto n = length / parts;
  if (layout == Layout::contiguous) return {{rank * n, n, 0}};
  return {{rank * n, n, 0}, {(parts - 1 - rank) * n, n, n}};
}

/// The positions of a sequence of `length` that rank `rank` of `size` holds, in its order:
/// int64 [length / size].
[[nodiscard]] inline at::Tensor positions(std::int64_t length, int rank, int size, Layout layout,
                                          const at::TensorOptions& options = at::kLong) {
  std::vector<at::Tensor> parts;
  for (const auto& c : chunks(length, rank, size, layout))
    parts.push_back(at::arange(c.start, c.start + c.length, options.dtype(at::kLong)));
  return at::cat(parts);
}

/// The positions of `x` along `dim` (the whole sequence) that this rank of `group` holds, in
/// the layout's order. Differentiable.
[[nodiscard]] inline at::Tensor shard(const at::Tensor& x, std::int64_t dim, const tensor_parallel::Group& group,
                                      Layout layout = Layout::contiguous) {
  dim = at::maybe_wrap_dim(dim, x.dim());
  const auto cs = chunks(x.size(dim), group.rank(), group.size(), layout);
  if (cs.size() == 1) return x.narrow(dim, cs[0].start, cs[0].length);
  std::vector<at::Tensor> parts;
  for (const auto& c : cs) parts.push_back(x.narrow(dim, c.start, c.length));
  return at::cat(parts, dim);
}

/// The whole sequence along `dim` from every rank's shard of it (cp::shard's inverse), on
/// every rank. Collective over `group`; not differentiable (for results to look at).
[[nodiscard]] inline at::Tensor unshard(const at::Tensor& x, std::int64_t dim, const tensor_parallel::Group& group,
                                        Layout layout = Layout::contiguous) {
  dim = at::maybe_wrap_dim(dim, x.dim());
  const auto gathered = group.all_gather(x.detach(), dim);  // rank order
  if (layout == Layout::contiguous) return gathered;
  const auto length = gathered.size(dim);
  std::vector<at::Tensor> order;
  for (int r = 0; r < group.size(); ++r) order.push_back(positions(length, r, group.size(), layout));
  // gathered[i] holds position order[i]: scatter it back.
  return at::empty_like(gathered).index_copy_(dim, at::cat(order).to(gathered.device()), gathered);
}

}  // namespace paratrain::cp
