// Sparse x W^T on the `bitmap` serving layout: the CPU kernels that the ISA translation units define.
//
// The layout is the one on disk (sparse_formats/bitmap.py): a row-major bitmap of ceil(cols/8) bytes
// per row, little-endian bits, so four bytes read as a little-endian uint32 are the mask of 32
// consecutive columns (bit i = column 32w + i); the kept values row-major; int64 row offsets. The
// kernels read it as it is, so tensor-parallel slicing and `leapctl validate` see the same tensors.
//
// This header is plain C++ (no torch, no intrinsics): each ISA file compiles its kernels with its own
// target options, and the op (bitmap/op.cpp) picks one at run time from the CPU's flags.
#pragma once

#include <cstdint>

#include "common/types.h"

namespace leap_sparse {

// A vector load of values may read up to this many elements past a row's last value. The op gives
// the kernels a zero-padded copy of the values of the last rows, whose loads would leave `values`.
constexpr int64_t kValuePad = 64;

// The kernels take at most this many rows of x; the op decodes tiles for a dense GEMM above it. At 32
// rows of x the bf16 kernel measured 0.81-0.92x dense against 0.64-0.75x for decoded tiles, at 48 both
// 0.74-0.81x, at 64 the decoded tiles were ahead (0.78-0.82x against 0.52-0.80x).
constexpr int64_t kSparseMaxM = 40;

struct Problem : Operands {    // dtype: also of the values
  const uint8_t* bitmap;       // [rows, bitmap_stride]
  int64_t bitmap_stride;       // ceil(cols / 8)
  const int64_t* row_offsets;  // [rows], index of each row's first value
  // x as the op packs it, zeros past cols up to a whole 32-column word. fp32: m rows of x_stride
  // elements (a multiple of 32). bf16 when x_is_bf16 (the AVX-512 kernel multiplies bf16 pairs):
  // interleaved by word, word w of row i at element (w * m + i) * 32, so one pointer walks a word of
  // every row; x_stride is then unused.
  const void* x;
  int64_t x_stride;
  bool x_is_bf16;
};

// Where a range of rows finds its values: row r's first value is element row_offsets[r] - first of
// base, and at least kValuePad readable elements follow the range's last value.
struct Values {
  const void* base;
  int64_t first;
};

// y[:, row_begin:row_end] for all m rows of x. Each block of rows reads its bitmap words and values
// from memory once and multiplies the expanded values with up to 8 (AVX-512) or 4 (AVX2) rows of x at a
// time.
void gemm_rows_avx512(const Problem& p, Values v, int64_t row_begin, int64_t row_end);
void gemm_rows_avx2(const Problem& p, Values v, int64_t row_begin, int64_t row_end);

// Rows row_begin..row_end of W, dense, into out[(r - row_begin) * out_stride + c] in p.dtype;
// out_stride is a multiple of 32 and columns from cols to out_stride are written as zeros.
void decode_rows_avx512(const Problem& p, Values v, int64_t row_begin, int64_t row_end, void* out,
                        int64_t out_stride);
void decode_rows_avx2(const Problem& p, Values v, int64_t row_begin, int64_t row_end, void* out,
                      int64_t out_stride);

// x [m, cols] (rows x_row_stride elements apart, in dtype) as fp32 rows of out_stride, zeros past cols
// (needs AVX2 and F16C, which every CPU with either kernel has).
void widen_x_avx2(DType dtype, const void* x, int64_t x_row_stride, int64_t m, int64_t cols, float* out,
                  int64_t out_stride);

}  // namespace leap_sparse
