// Sparse x W^T on the `bitmap-q4` layout (sparse_formats/bitmap_q4.py): the CPU kernels that the ISA
// translation units define for the op in bitmap_q4/op.cpp.
//
// The layout as stored: a row-major bitmap of cols/8 bytes per row (cols is a multiple of the group
// size, itself a multiple of 32, so every row is whole 32-column words: four bytes, read as a
// little-endian uint32, are the mask of columns 32w..32w+31); per row and word, ceil(popcount/2) bytes
// of 4-bit codes (the k-th kept weight of the word in byte k/2, low nibble for even k), so every word's
// codes start on a byte; one fp16 scale per row and group of G columns; int32 row offsets into the codes.
// A kept weight is scale * (code - 7.5) (the symmetric grid), or scale * (code - zero) where the layout
// has zero points (the asymmetric grid): one 4-bit zero per row and group, packed two to a byte (group g of
// row r in byte r * zeros_stride + g / 2, the low nibble for even g). The kernels read the tensors as they
// are, so tensor-parallel row slices (codes re-based by the first offset) need no repacking.
//
// Plain C++ like bitmap/kernels.h: each ISA file compiles its kernels with its own target options.
#pragma once

#include <cstdint>

#include "bitmap/kernels.h"

namespace leap_sparse {

// A word's codes are read from its first code byte with one 16-byte load (AVX-512) or 8-byte loads that
// reach 20 bytes (AVX2), whatever its count, so a load may reach up to 20 bytes past a row's last code. The op hands the kernels a zero-padded copy of the
// codes of the last rows (as bitmap_linear does with kValuePad); 64 keeps that copy a whole line.
constexpr int64_t kCodePad = 64;

struct Q4Problem : Operands {   // cols: a multiple of 32 (of G)
  const uint8_t* bitmap;       // [rows, cols / 8]
  const int32_t* row_offsets;  // [rows], byte of each row's first code
  const uint16_t* scales;      // fp16 [rows, groups]
  const uint8_t* zeros;        // 4-bit zero points [rows, zeros_stride], or nullptr: the symmetric grid
  int64_t zeros_stride;        // (groups + 1) / 2
  int64_t groups;              // cols / G
  int64_t group_words;         // G / 32
  // x as the op packs it: bf16 interleaved by word when x_is_bf16 (word w of row i at element
  // (w * m + i) * 32, as bitmap_linear's Problem::x), else fp32 rows of x_stride elements.
  const void* x;
  int64_t x_stride;
  bool x_is_bf16;
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

// ---- int8 x (the plugin's `activations=int8`; bitmap_q4_i8/avx512.cpp) ----
//
// The pair layout, made from the stored one once at load (bitmap_q4_pack_pairs in bitmap_q4_i8/op.cpp):
// rows in blocks of kPairRows (the last block padded with empty rows), each block's data in the order the
// kernel reads it, so that it streams from two sequential arrays with one pointer each:
// - masks: per block, pair (64 columns) and row of the block, the pair's 64-bit mask; none (a dense layout,
//   every pair's 32 code bytes, no expand) when every weight is kept (a 4-bit lm_head);
// - codes: per block and pair, a header of kPairHeader bytes (none in a dense layout): the code bytes of the
//   pair's rows 0 and 1, and those of all four rows (each at most 64 and 128); then per pair of rows (rows 0
//   and 1, then 2 and 3) the two rows' kept codes of the pair in the same bytes: the first row's k-th in the
//   low nibble of byte k, the second row's in the high nibble, as many bytes as the longer row has kept weights
//   (the shorter row's nibbles beyond its count 0; 64 bytes in a dense layout); block_offsets[b] is block b's
//   first code byte, and kPairPad zero bytes follow the last one;
// - scales: per block, group and row of the block, the row's fp16 scale (padded rows 0); the group size must
//   be a multiple of 64;
// - zeros (the asymmetric grid only): per block, group and row of the block, the row's zero point 0..15 as a
//   byte (padded rows 0), in the scales' order.
constexpr int kPairRows = 4;
constexpr int64_t kPairPad = 64;  // a pair of rows' codes are read with one 64-byte load
constexpr int64_t kPairHeader = 2;
constexpr int kPairChunkM = 4;    // rows of x multiplied per pass over a block
// Rows of x the int8 decoding kernel takes; above, the prefill kernel (q4_pairs_prefill_panels_avx512). Measured
// (qkv 3072 x 2048, 50%, 1 thread): with hot weights the prefill kernel is the faster from M = 6 (M = 8: 0.29-0.31
// against 0.39-0.40 ms), but with cold ones (rotated through 300 MB, as a model's layers are when served) it is the
// slower up to 8 (M = 8: 0.48 against 0.42-0.44 ms; M = 1: 0.38-0.39 against 0.10).
constexpr int64_t kPairMaxM = 8;

// x quantized per call, per row of x and weight group: x = scale * q, |q| <= 127.
struct Q8Rows {
  int8_t* values;  // [m, cols], q
  float* scales;   // [m, groups]
  int64_t groups;
};

struct Q4PairProblem : Operands {  // dtype: bf16 or fp32; cols: a multiple of G
  const uint64_t* masks;          // [blocks, cols / 64, kPairRows], or nullptr: the dense layout
  const uint8_t* codes;           // the pair layout's codes, kPairPad bytes after the last one
  const int64_t* block_offsets;   // [blocks]
  const uint16_t* scales;         // fp16 [blocks, groups, kPairRows]
  const uint8_t* zeros;           // [blocks, groups, kPairRows] zero points 0..15, or nullptr: the symmetric grid
  int64_t groups;
  int64_t group_pairs;  // G / 64
  const int8_t* x_values;  // Q8Rows of the m rows of x
  const float* x_scales;
  const int32_t* x_starts;  // decoding on the asymmetric grid: -(sum of q) per row of x and group, [m, groups]
};

// x [m, cols] of dtype (bf16 or fp32; rows row_stride elements apart) quantized in blocks of `block`
// columns (the weight's group size).
void quantize_x_avx512(DType dtype, const void* x, int64_t row_stride, int64_t m, int64_t cols, int64_t block,
                       Q8Rows out);
// y[:, rows of blocks block_begin..block_end] for the p.m rows of x.
void q4_pairs_gemm_blocks_avx512(const Q4PairProblem& p, int64_t block_begin, int64_t block_end);
// The rows of blocks block_begin..block_end (the last one's real rows only), dense in fp32 (exact), into
// out[(row - kPairRows * block_begin) * out_stride + c].
void q4_pairs_decode_blocks_avx512(const Q4PairProblem& p, int64_t block_begin, int64_t block_end, float* out,
                                   int64_t out_stride);

// The same on AVX2 (bitmap_q4_i8/avx2.cpp), for CPUs without AVX-512: quantize_x_avx512's q and scales; the
// decoding kernel, which needs p.x_starts = -(each group's sum of q) on either grid (q8_group_starts_avx2) and
// also multiplies int8 prefill (any p.m, kPairChunkM rows at a time: AVX2 has no prefill kernel); exact decoded
// rows in fp32 and bf16 for the tiles path.
void quantize_x_avx2(DType dtype, const void* x, int64_t row_stride, int64_t m, int64_t cols, int64_t block,
                     Q8Rows out);
void q8_group_starts_avx2(const Q8Rows& q8, int64_t m, int64_t cols, int32_t* starts);
void q4_pairs_gemm_blocks_avx2(const Q4PairProblem& p, int64_t block_begin, int64_t block_end);
void q4_pairs_decode_blocks_avx2(const Q4PairProblem& p, int64_t block_begin, int64_t block_end, float* out,
                                 int64_t out_stride);
void q4_pairs_decode_blocks_bf16_avx2(const Q4PairProblem& p, int64_t block_begin, int64_t block_end,
                                      uint16_t* out, int64_t out_stride);

// ---- prefill with int8 x (bitmap_q4_i8/avx512.cpp) ----
//
// Above kPairMaxM rows of x: x quantized once per call as for decoding (Q8Rows), W decoded panel by panel
// (kPrefillPanelRows rows) into a u8 layout for vpdpbusd (per 4-column quad and 16 rows one 64-byte register:
// lane i = the row's 4 bytes, level + 15) and multiplied by a register-blocked int8 kernel.
constexpr int64_t kPrefillPanelRows = 32;
// -15 * the sum of q over each group of x's rows: starts[i * groups + g], where each group's integer dot begins;
// asym (the asymmetric grid): -1 * that sum, which the kernel multiplies with each row's zero point.
void q8_group_starts_avx512(const Q8Rows& q8, int64_t m, int64_t cols, int32_t* starts, bool asym);
// y[:, rows of panels panel_begin..panel_end] for all p.m rows of x (p.x_values, p.x_scales set; `starts` as
// q8_group_starts_avx512 makes them).
void q4_pairs_prefill_panels_avx512(const Q4PairProblem& p, const int32_t* starts, int64_t panel_begin,
                                    int64_t panel_end);

// ---- bf16 tiles for prefill with bf16 x (at the ends of bitmap_q4/avx512.cpp and bitmap_q4_i8/avx512.cpp) ----
//
// As q4_decode_rows_avx512 and q4_pairs_decode_blocks_avx512, but each exact fp32 value rounded once to bf16
// (round to nearest even: bit for bit the fp32 tile converted by ATen), into bf16 out (uint16_t).
void q4_decode_rows_bf16_avx512(const Q4Problem& p, Codes c, int64_t row_begin, int64_t row_end, uint16_t* out,
                                int64_t out_stride);
void q4_pairs_decode_blocks_bf16_avx512(const Q4PairProblem& p, int64_t block_begin, int64_t block_end,
                                        uint16_t* out, int64_t out_stride);

}  // namespace leap_sparse
