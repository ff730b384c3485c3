// x W^T for an `int8-rows` weight (sparse_formats/int8_rows.py: int8 codes [rows, cols] in -127..127, one fp16
// scale per row; an 8-bit lm_head) with int8 x: the kernel of int8_rows/op.cpp's op, for decoding steps.
//
// x is quantized per row as a whole (scale max|x| / 127: quantize_x_avx512 with one group), and the kernel
// multiplies u = q + 128 (q with its top bit flipped) because vpdpbusd multiplies unsigned bytes by signed ones:
// sum u * w = sum q * w + 128 * the row's sum of codes, which the layer computes once at load (row_sums). Plain
// C++ like bitmap/kernels.h.
#pragma once

#include <cstdint>

#include "bitmap/kernels.h"

namespace leap_sparse {

// Rows of x the kernel takes (each pass over W serves them all); above, the op hands x to ATen.
constexpr int64_t kInt8RowsMaxM = 8;

struct Int8RowsProblem : Operands {  // dtype: bf16 or fp32 (x and y); cols: a multiple of 64
  const int8_t* weight;     // [rows, cols]
  const uint16_t* scales;   // fp16 [rows]
  const int32_t* row_sums;  // [rows], each row's sum of codes
  const uint8_t* x_values;  // q + 128 (AVX2: q) by 64 columns: columns 64 k .. 64 k + 63 of row i at (k * m + i) * 64
  const float* x_scales;    // [m]
};

// y[:, row_begin:row_end] for the p.m (<= kInt8RowsMaxM) rows of x; W read once.
void int8_rows_gemm_avx512(const Int8RowsProblem& p, int64_t row_begin, int64_t row_end);
// The same on AVX2 (int8_rows/avx2.cpp), from x_values = q (row_sums unused).
void int8_rows_gemm_avx2(const Int8RowsProblem& p, int64_t row_begin, int64_t row_end);

}  // namespace leap_sparse
