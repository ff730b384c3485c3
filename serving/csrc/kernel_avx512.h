// Helpers that the AVX-512 kernel files of both layouts share (bitmap_avx512.cpp, bitmap_q4_avx512.cpp):
// include it inside the file's `#pragma GCC target` region (AVX-512 F, BW, DQ, VL and BF16 at least),
// as kernel_common.h, which it includes.
#pragma once

#include "kernel_common.h"

namespace leap_sparse {
namespace {

// The four sums of four accumulators, for four consecutive outputs: short rows leave few multiply-adds
// per sum, where four separate horizontal sums took a large share of the time.
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const auto half = [](__m512 v) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  };
  return _mm_hadd_ps(_mm_hadd_ps(half(a), half(b)), _mm_hadd_ps(half(c), half(d)));
}

// y[index .. index + count) = the first `count` of four sums, in the output dtype.
template <DType D>
inline void store4(void* y, int64_t index, __m128 sums, int count) {
  const __mmask8 keep = static_cast<__mmask8>((1u << count) - 1);
  if constexpr (D == DType::F32) {
    _mm_mask_storeu_ps(static_cast<float*>(y) + index, keep, sums);
  } else if constexpr (D == DType::BF16) {
    _mm_mask_storeu_epi16(static_cast<uint16_t*>(y) + index, keep, (__m128i)_mm_cvtneps_pbh(sums));
  } else {
    _mm_mask_storeu_epi16(static_cast<uint16_t*>(y) + index, keep,
                          _mm_cvtps_ph(sums, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// The end of a block of R (<= 4) output rows from `row` for rows m0 .. m0 + M of x: acc[r][m] summed,
// plus the bias, into y (rows y_stride apart).
template <DType D, int M, int R>
__attribute__((always_inline)) inline void store_block(void* y, int64_t y_stride, const float* bias_of_rows,
                                                       int64_t row, int64_t m0, const __m512 (&acc)[R][M]) {
  const __mmask8 valid = static_cast<__mmask8>((1u << R) - 1);
  const __m128 bias = bias_of_rows == nullptr ? _mm_setzero_ps() : _mm_maskz_loadu_ps(valid, bias_of_rows + row);
  for (int m = 0; m < M; ++m) {
    __m512 total[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int r = 0; r < R; ++r) total[r] = acc[r][m];
    store4<D>(y, (m0 + m) * y_stride + row, _mm_add_ps(sum4(total[0], total[1], total[2], total[3]), bias), R);
  }
}

}  // namespace
}  // namespace leap_sparse
