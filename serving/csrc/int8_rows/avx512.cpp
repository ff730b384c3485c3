// AVX-512 VNNI kernel for int8-rows weights with int8 x (int8_rows/kernels.h): an 8-bit lm_head's decoding steps.
//
// Why: vLLM's oneDNN int8 GEMM (OneDNNInt8, the path before) took 3.1-4.5 ms per call for the 1B shape's lm_head
// (49152 x 2048, M = 1, 1 thread on core 0, four copies rotated so that each call reads from DRAM), 22-32 GB/s,
// where a plain read of memory runs at 32-38; a decode step of that model is ~21 ms. Here each row of W is one
// stream: per 64 columns one load and one vpdpbusd per row of x (x interleaved by 64 columns, so that the rows of
// x a step reads lie together), M int32 sums in registers, reduced four rows of x at a time.
// Measured (bench/lm_head_int8.py: this op and OneDNNInt8 alternated call by call, 60 calls, medians, 4 copies,
// 1 thread on core 0; bench/results/lm_head_int8.md): 49152 x 2048, M = 1: 2.82 against 3.67 ms (35.7 GB/s);
// M = 2-4: 0.77x; M = 8: 0.90x. 49152 x 576 (SmolLM2): M = 1-4 0.78-0.79x, M = 8 1.12x.
// Not kept: 8 rows of W side by side at M = 1 (8 streams 2 KiB apart; 4.28 against oneDNN's 3.51 ms), 2 rows
// for M = 5..8 (6.2-6.8 ms), x rows 2048 columns apart instead of interleaved (M = 8: 6.3-6.4 ms: its 8 rows
// fell in the same L1 sets).
#include <immintrin.h>

#include <algorithm>

#include "int8_rows/kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,avx512bf16,f16c,fma")

#include "common/kernel_avx512.h"  // compiled for the target above

namespace leap_sparse {
namespace {

// Software prefetch of each row's codes this many bytes ahead.
constexpr int64_t kAhead = 1024;

// The four exact sums of four int32 accumulators.
inline __m128i sum4_epi32(__m512i a, __m512i b, __m512i c, __m512i d) {
  const auto half = [](__m512i v) {
    const __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  };
  return _mm_hadd_epi32(_mm_hadd_epi32(half(a), half(b)), _mm_hadd_epi32(half(c), half(d)));
}

// Row r of W for the M rows of x: M int32 sums of u * w over the columns, one stream through the row (rows
// side by side, 2-8 streams 2 KiB apart, ran at half the speed), then per output (sum - 128 * row sum) * (s_w *
// s_x) + bias in fp32, four rows of x at a time.
template <int M>
void row(const Int8RowsProblem& p, int64_t r) {
  __m512i acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_si512();
  const int8_t* w = p.weight + r * p.cols;
  for (int64_t c = 0; c < p.cols; c += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(w + c) + kAhead, _MM_HINT_T0);
    const __m512i wv = _mm512_loadu_si512(w + c);
    for (int m = 0; m < M; ++m) acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_loadu_si512(p.x_values + (c * M + 64 * m)), wv);
  }
  const __m128i offset = _mm_set1_epi32(p.row_sums[r] * 128);
  const __m128 sw = _mm_set1_ps(_cvtsh_ss(p.scales[r]));
  const __m128 bias = _mm_set1_ps(p.bias == nullptr ? 0.0f : p.bias[r]);
  for (int m0 = 0; m0 < M; m0 += 4) {
    const int n = std::min(4, M - m0);
    const auto at = [&](int i) { return m0 + i < M ? acc[std::min(m0 + i, M - 1)] : _mm512_setzero_si512(); };
    const __m128i exact = _mm_sub_epi32(sum4_epi32(at(0), at(1), at(2), at(3)), offset);
    const __m128 sx = _mm_maskz_loadu_ps(static_cast<__mmask8>((1u << n) - 1), p.x_scales + m0);
    alignas(16) float y[4];
    _mm_store_ps(y, _mm_fmadd_ps(_mm_cvtepi32_ps(exact), _mm_mul_ps(sw, sx), bias));
    for (int i = 0; i < n; ++i) {
      const int64_t at_y = (m0 + i) * p.y_stride + r;
      if (p.dtype == DType::BF16) {
        static_cast<uint16_t*>(p.y)[at_y] = _mm_extract_epi16((__m128i)_mm_cvtneps_pbh(_mm_set_ss(y[i])), 0);
      } else {
        static_cast<float*>(p.y)[at_y] = y[i];
      }
    }
  }
}

template <int M>
void rows_range(const Int8RowsProblem& p, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) row<M>(p, r);
}

}  // namespace

void int8_rows_gemm_avx512(const Int8RowsProblem& p, int64_t row_begin, int64_t row_end) {
  by_m<kInt8RowsMaxM>(p.m, [&](auto m) { rows_range<decltype(m)::value>(p, row_begin, row_end); });
}

}  // namespace leap_sparse

#pragma GCC pop_options
