// Sparse x W^T on the `bitmap-q4` layout (sparse_formats/bitmap_q4.py): the CPU kernels that the ISA
// translation units define for the op in bitmap_q4_linear.cpp.
//
// The layout as stored: a row-major bitmap of cols/8 bytes per row (cols is a multiple of the group
// size, itself a multiple of 32, so every row is whole 32-column words: four bytes, read as a
// little-endian uint32, are the mask of columns 32w..32w+31); per row and word, ceil(popcount/2) bytes
// of 4-bit codes (the k-th kept weight of the word in byte k/2, low nibble for even k), so every word's
// codes start on a byte; one fp16 scale per row and group of G columns; int32 row offsets into the codes.
// A kept weight is scale * (code - 7.5). The kernels read the tensors as they are, so tensor-parallel
// row slices (codes re-based by the first offset) need no repacking.
//
// Plain C++ like bitmap_kernels.h: each ISA file compiles its kernels with its own target options.
#pragma once

#include <cstdint>

#include "bitmap_kernels.h"

namespace leap_sparse {

// A word's codes are read from its first code byte with one 16-byte load (AVX-512) or 8-byte loads that
// reach 20 bytes (AVX2), whatever its count, so a load may reach up to 20 bytes past a row's last code. The op hands the kernels a zero-padded copy of the
// codes of the last rows (as bitmap_linear does with kValuePad); 64 keeps that copy a whole line.
constexpr int64_t kCodePad = 64;

struct Q4Problem {
  DType dtype;                 // of x and y
  const uint8_t* bitmap;       // [rows, cols / 8]
  const int32_t* row_offsets;  // [rows], byte of each row's first code
  const uint16_t* scales;      // fp16 [rows, groups]
  int64_t groups;              // cols / G
  int64_t group_words;         // G / 32
  int64_t rows;
  int64_t cols;  // a multiple of 32 (of G)
  // x as the op packs it: bf16 interleaved by word when x_is_bf16 (word w of row i at element
  // (w * m + i) * 32, as bitmap_linear's Problem::x), else fp32 rows of x_stride elements.
  const void* x;
  int64_t x_stride;
  bool x_is_bf16;
  int64_t m;
  const float* bias;  // [rows] in fp32, or nullptr
  void* y;            // [m, y_stride] of dtype
  int64_t y_stride;
};

// Where a range of rows finds its codes: row r's first code is byte row_offsets[r] - first of base, and
// at least kCodePad readable bytes follow the range's last code.
struct Codes {
  const uint8_t* base;
  int64_t first;
};

// y[:, row_begin:row_end] for all m (<= kSparseMaxM) rows of x; each weight row's words are read from
// memory once per call.
void q4_gemm_rows_avx512(const Q4Problem& p, Codes c, int64_t row_begin, int64_t row_end);
void q4_gemm_rows_avx2(const Q4Problem& p, Codes c, int64_t row_begin, int64_t row_end);

// Rows row_begin..row_end of W, dense in fp32 (exact: an fp16 scale times a half-integer below 8 needs
// at most 15 significant bits), into out[(r - row_begin) * out_stride + c].
void q4_decode_rows_avx512(const Q4Problem& p, Codes c, int64_t row_begin, int64_t row_end, float* out,
                           int64_t out_stride);
void q4_decode_rows_avx2(const Q4Problem& p, Codes c, int64_t row_begin, int64_t row_end, float* out,
                         int64_t out_stride);

}  // namespace leap_sparse
