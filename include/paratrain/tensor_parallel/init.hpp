#pragma once
/// \file
/// A slice of the tensor a layer's initialisation would draw whole, drawn chunk by chunk
/// from the same generator (Note [Initialising a slice]).

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/nn/init.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>

namespace paratrain::tensor_parallel {

// Note [Initialising a slice]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A model at tensor degree t must start from exactly the weights the single-device model
// starts from, and no rank may build a whole large matrix to get its slice. LibTorch's CPU
// initialisers consume the generator element by element in memory order: uniform_ draws one
// number per element, and normal_ fills uniforms and transforms them in blocks of 16, the last
// block of a tensor whose size is not a multiple of 16 drawn again (ATen's normal_fill). So
// the rows of a [R, C] matrix can be drawn a chunk at a time, each chunk a whole number of
// 16-element blocks and the last at least 16 elements, and every chunk holds exactly the
// values the whole draw puts there, the generator ending where the whole draw leaves it (the
// next layer then draws what it would). Each rank keeps its rows or columns of each chunk and
// drops the rest: a chunk (about 4 MB) at a time, never the matrix. Every rank draws every
// chunk, so the time is that of the whole draw; tests compare the slices with LibTorch's own
// layers built from the same seed, on both LibTorch versions.

/// The columns [col, col + cols) of the rows [row, row + rows) of the [R, C] tensor that
/// `draw(chunk)` fills in place, drawn in chunks of whole rows (Note [Initialising a slice]).
template <class Draw>
[[nodiscard]] at::Tensor slice_of_drawn(std::int64_t R, std::int64_t C, std::int64_t row, std::int64_t rows,
                                        std::int64_t col, std::int64_t cols, Draw&& draw,
                                        const at::TensorOptions& options = at::kFloat) {
  c10::NoGradGuard no_grad;
  auto out = at::empty({rows, cols}, options);
  const std::int64_t unit = 16 / std::gcd<std::int64_t>(C, 16);  // rows per 16-element multiple
  const std::int64_t per_chunk = unit * std::max<std::int64_t>(1, (std::int64_t{1} << 20) / (unit * C));
  for (std::int64_t r = 0; r < R;) {
    std::int64_t n = std::min(per_chunk, R - r);
    if (R - r - n > 0 && (R - r - n) * C < 16) n = R - r;  // a tail under 16 elements joins this chunk
    auto chunk = at::empty({n, C}, options);
    draw(chunk);
    const auto lo = std::max(r, row), hi = std::min(r + n, row + rows);
    if (lo < hi) out.narrow(0, lo - row, hi - lo).copy_(chunk.narrow(0, lo - r, hi - lo).narrow(1, col, cols));
    r += n;
  }
  return out;
}

/// torch::nn::Linear(in, out)'s weight, rows [row, row + rows) and columns [col, col + cols).
[[nodiscard]] inline at::Tensor linear_weight_slice(std::int64_t in, std::int64_t out, std::int64_t row,
                                                    std::int64_t rows, std::int64_t col, std::int64_t cols) {
  // kaiming_uniform_(weight, sqrt(5)) on a chunk of whole rows reads fan_in = in, as on the whole.
  return slice_of_drawn(out, in, row, rows, col, cols,
                        [](at::Tensor& c) { torch::nn::init::kaiming_uniform_(c, std::sqrt(5.0)); });
}

/// torch::nn::Linear(in, out)'s bias, elements [begin, begin + count).
[[nodiscard]] inline at::Tensor linear_bias_slice(std::int64_t in, std::int64_t out, std::int64_t begin,
                                                  std::int64_t count) {
  const auto bound = 1 / std::sqrt(in);  // as LibTorch: 1 / sqrt(fan_in), fan_in an int64_t
  return slice_of_drawn(out, 1, begin, count, 0, 1, [&](at::Tensor& c) { torch::nn::init::uniform_(c, -bound, bound); })
      .reshape({count});
}

/// torch::nn::Embedding(count, dim)'s weight (normal, mean 0, std 1), rows [row, row + rows).
[[nodiscard]] inline at::Tensor embedding_weight_slice(std::int64_t count, std::int64_t dim, std::int64_t row,
                                                       std::int64_t rows) {
  return slice_of_drawn(count, dim, row, rows, 0, dim, [](at::Tensor& c) { torch::nn::init::normal_(c); });
}

}  // namespace paratrain::tensor_parallel
