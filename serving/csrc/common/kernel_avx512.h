// Helpers that the AVX-512 kernel files of both layouts share (bitmap/avx512.cpp, bitmap_q4/avx512.cpp):
// include it inside the file's `#pragma GCC target` region (AVX-512 F, BW, DQ, VL and BF16 at least),
// as common/kernel_common.h, which it includes.
#pragma once

#include "common/kernel_common.h"

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

}  // namespace
}  // namespace leap_sparse
