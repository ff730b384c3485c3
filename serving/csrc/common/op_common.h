// What the torch ops (bitmap/op.cpp, bitmap_q4/op.cpp, bitmap_q4_i8/op.cpp, int8_rows/op.cpp)
// share: the chosen ISA, the dtype of x, the output, the zero-padded copy of the last rows' weights, the split
// of rows between threads, bf16 x interleaved for the AVX-512 kernels. Plain C++ with ATen, no intrinsics.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "common/types.h"

namespace leap_sparse {
namespace {

constexpr int64_t kTaskWeights = 1 << 15;  // fewest weights (dense count) worth a thread of their own
constexpr int64_t kTileBytes = 2 << 20;    // tile of W decoded per GEMM above kSparseMaxM (bitmap_linear)
// Weights of W per tile of the bitmap-q4 ops' GEMMs (tiled_gemm): 2 MB as bf16, 4 MB as fp32. Measured with
// bf16 tiles (bench/prefill_q4.py's Llama-3.2-1B shapes, M = 400, 50%, 1 thread, sizes interleaved in one
// process, medians of 15, ratios to dense bf16 F.linear): 0.5M weights (the fp32 2 MB before) 1.003-1.009,
// 0.75M 0.984-1.003, 1M 0.987-0.990, 1.5M 0.983-0.995; 0.25M 1.02-1.04, 4M and 8M 1.01-1.05.
constexpr int64_t kTileWeights = 1 << 20;

// The kernel that leap_sparse_cpu::isa() names ("avx512", "avx2" or "none"): common/isa.cpp keeps the
// choice, and asking its op keeps the other ops' files independent of that one.
inline std::string chosen_isa() {
  static const auto isa_op =
      c10::Dispatcher::singleton().findSchemaOrThrow("leap_sparse_cpu::isa", "").typed<std::string()>();
  return isa_op.call();
}

// The kernels' dtype for x of `type`; else an error naming the op (`what`: what the op says it takes).
inline DType x_dtype(at::ScalarType type, const char* op, const char* what) {
  switch (type) {
    case at::kBFloat16: return DType::BF16;
    case at::kHalf: return DType::F16;
    case at::kFloat: return DType::F32;
    default: break;
  }
  TORCH_CHECK(false, op, " supports bfloat16, float16 and float32", what, ", not ", type);
}

// y, x's shape with `rows` features, uninitialised.
inline at::Tensor empty_output(const at::Tensor& x, int64_t rows) {
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = rows;
  return at::empty(out_shape, x.options());
}

// The fields that Problem, Q4Problem and Q4PairProblem share (Operands), but for x (packed by each op).
inline void set_operands(Operands& p, DType dtype, int64_t rows, int64_t cols, int64_t m, const std::optional<at::Tensor>& bias32,
                         at::Tensor& y) {
  p.dtype = dtype;
  p.rows = rows;
  p.cols = cols;
  p.m = m;
  p.bias = bias32.has_value() ? bias32->data_ptr<float>() : nullptr;
  p.y = y.data_ptr();
  p.y_stride = rows;
}

// bf16 x [m, cols] (rows row_stride elements apart) interleaved by 32-column word as the AVX-512 kernels
// read it (Problem::x, Q4Problem::x), zeros past cols.
inline void interleave_words(const uint16_t* x, int64_t row_stride, int64_t m, int64_t cols, uint16_t* out) {
  const int64_t full = cols / 32, tail = cols - 32 * full;
  for (int64_t i = 0; i < m; ++i) {
    const uint16_t* row = x + i * row_stride;
    for (int64_t w = 0; w < full; ++w) std::memcpy(out + (w * m + i) * 32, row + 32 * w, 64);
    if (tail > 0) {
      uint16_t* last = out + (full * m + i) * 32;
      std::memcpy(last, row + 32 * full, tail * 2);
      std::memset(last + tail, 0, (32 - tail) * 2);
    }
  }
}

// The first row from which every row ends less than `pad` elements before the end of the weights (n of
// them): the kernels' vector loads past those rows' last elements would leave the tensor. Rows end in
// order, so this walks back from the last row (one or two steps unless rows hold fewer than `pad`).
template <typename Offset>
int64_t first_unpadded_row(const Offset* offsets, int64_t rows, int64_t n, int64_t pad) {
  int64_t row = rows;
  while (row > 0 && (row < rows ? offsets[row] : n) + pad > n) --row;
  return row;
}

// Elements `first`.. of the 1-D contiguous `flat`, with `pad` zeros after them.
inline at::Tensor padded_tail(const at::Tensor& flat, int64_t first, int64_t pad) {
  const int64_t n = flat.numel(), elem = flat.element_size();
  at::Tensor tail = at::empty({n - first + pad}, flat.options());
  char* data = static_cast<char*>(tail.data_ptr());
  std::memcpy(data, static_cast<const char*>(flat.data_ptr()) + first * elem, (n - first) * elem);
  std::memset(data + (n - first) * elem, 0, pad * elem);
  return tail;
}

// Rows begin..end over ATen's threads: fn(false, b, e) for rows before `unpadded` (read from the weights),
// fn(true, b, e) from there on (read from their padded copy).
template <typename Fn>
void parallel_rows(int64_t begin, int64_t end, int64_t grain, int64_t unpadded, const Fn& fn) {
  at::parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    const int64_t split = std::clamp(unpadded, b, e);
    if (b < split) fn(false, b, split);
    if (split < e) fn(true, split, e);
  });
}

// Above the sparse kernels' rows of x: y ([m, rows] of x2's [m, cols]) = x2 W^T (+ bias) from tiles of W
// (about kTileWeights weights, at least 16 rows, a multiple of `align` rows) that decode(first, last, tile,
// bf16) writes (rows first..last at tile's row 0): exact fp32 values, or with bf16 = true those values
// rounded once to bf16 (round to nearest even, what ATen's conversion does). With bf16 x the GEMM is ATen's
// bf16 GEMM, as a dense bf16 model's (the fp32 GEMM took a 400-token prefill of SmolLM2 from 0.25 s, stock
// vLLM bf16, to 0.91 s): `bf16_tiles` says that decode writes bf16 tiles itself (the AVX-512 kernels), else
// ATen converts the fp32 tile. fp16 and fp32 x multiply the exact fp32 tile in fp32. Where y has the GEMM's
// dtype, each tile's product goes into y's columns directly (at::mm_out on the strided view), else through
// a copy.
// Measured (bench/prefill_q4.py, Llama-3.2-1B's projections at M = 400 bf16 rows, 50%, 1 thread on core 0):
// fp32 tiles converted by ATen and copied into y took 1.02-1.06x dense bf16 F.linear per projection; bf16
// tiles decoded directly and mm_out 0.99-1.01x; tiles of 1M weights instead of 0.5M 0.98-0.99x. Split (the
// decode or the GEMM skipped, gate_up 16384x2048): the tiles' GEMMs alone take what vLLM's oneDNN linear with
// its weight packed once takes (56.1 against 56.1 ms; F.linear 59.2, which reorders the whole weight per
// call), so what is left is the decode: 1.84 ms with a conversion per weight, 1.3-1.4 ms from the tables of
// the bf16 decode functions, 2-2.5% of the op. Not kept: the tile's memory kept between calls (no change).
template <typename Decode>
void tiled_gemm(const at::Tensor& x2, const std::optional<at::Tensor>& bias, int64_t rows, int64_t align,
                at::Tensor& y, bool bf16_tiles, const Decode& decode) {
  const bool bf16_gemm = x2.scalar_type() == at::kBFloat16;
  const bool direct = bf16_gemm && bf16_tiles;
  const int64_t m = x2.size(0), cols = x2.size(1);
  const int64_t tile_rows = std::min(std::max<int64_t>(16, kTileWeights / cols) / align * align,
                                     (rows + align - 1) / align * align);
  at::Tensor tile = at::empty({tile_rows, cols}, x2.options().dtype(direct ? at::kBFloat16 : at::kFloat));
  const at::Tensor xg = bf16_gemm ? x2 : x2.to(at::kFloat);
  std::optional<at::Tensor> bias_g;  // the bias in the GEMM's dtype (F.linear adds it in the output dtype)
  if (bias.has_value()) bias_g = bias->to(bf16_gemm ? at::kBFloat16 : at::kFloat).contiguous();
  const bool into_y = y.scalar_type() == xg.scalar_type();
  at::Tensor y2 = y.view({m, rows});
  for (int64_t first = 0; first < rows; first += tile_rows) {
    const int64_t last = std::min(rows, first + tile_rows);
    decode(first, last, tile.data_ptr(), direct);
    at::Tensor w = tile.narrow(0, 0, last - first);
    if (bf16_gemm && !direct) w = w.to(at::kBFloat16);
    at::Tensor out = y2.narrow(1, first, last - first);
    if (into_y) {
      if (bias_g.has_value()) {
        at::addmm_out(out, bias_g->narrow(0, first, last - first), xg, w.t());
      } else {
        at::mm_out(out, xg, w.t());
      }
    } else {
      out.copy_(bias_g.has_value() ? at::addmm(bias_g->narrow(0, first, last - first), xg, w.t())
                                   : at::mm(xg, w.t()));
    }
  }
}

}  // namespace
}  // namespace leap_sparse
