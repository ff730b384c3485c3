// AVX2 kernel for int8-rows weights with int8 x (int8_rows/kernels.h): an 8-bit lm_head's decoding steps on CPUs
// without AVX-512.
//
// Why: the path before on such CPUs, vLLM's oneDNN int8 GEMM, took 89 ms a call for SmolLM2's lm_head (49152 x
// 576, M = 1, 1 thread) on a Zen 3 EPYC, where a bf16 F.linear takes 7.4: a decoding step of 100 ms. Here, as in
// the AVX-512 kernel, each row of W is one stream. vpmaddubsw multiplies unsigned bytes by signed ones, and u = q +
// 128 times a code could saturate its int16 pair sums (2 * 255 * 127), so it multiplies |w| by q with w's sign
// (vpsignb; codes are -127..127): pair sums at most 2 * 127 * 127, exact; vpmaddwd widens them to int32. x comes
// as q itself (not u), interleaved by 64 columns as the AVX-512 kernel reads it, and the row sums are not used.
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "int8_rows/kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,popcnt,bmi,bmi2")

#include "common/kernel_common.h"  // compiled for the target above

namespace leap_sparse {
namespace {

constexpr int64_t kAhead = 1024;  // software prefetch of each row's codes this many bytes ahead

// Row r of W for the M rows of x: M exact int32 sums of w * q, then per output sum * (s_w * s_x) + bias in fp32.
template <int M>
void row(const Int8RowsProblem& p, int64_t r) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* x = reinterpret_cast<const int8_t*>(p.x_values);
  __m256i acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_si256();
  const int8_t* w = p.weight + r * p.cols;
  for (int64_t c = 0; c < p.cols; c += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(w + c) + kAhead, _MM_HINT_T0);
    for (int h = 0; h < 64; h += 32) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c + h));
      const __m256i magnitude = _mm256_abs_epi8(wv);
      for (int m = 0; m < M; ++m) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + c * M + 64 * m + h));
        const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(q, wv));
        acc[m] = _mm256_add_epi32(acc[m], _mm256_madd_epi16(pairs, ones));
      }
    }
  }
  const float sw = _cvtsh_ss(p.scales[r]);
  const float bias = p.bias == nullptr ? 0.0f : p.bias[r];
  for (int m = 0; m < M; ++m) {
    const float value = std::fma(static_cast<float>(sum8_epi32(acc[m])), sw * p.x_scales[m], bias);
    const int64_t at = m * p.y_stride + r;
    if (p.dtype == DType::BF16) {
      store<DType::BF16>(p.y, at, value);
    } else {
      store<DType::F32>(p.y, at, value);
    }
  }
}

template <int M>
void rows_range(const Int8RowsProblem& p, int64_t begin, int64_t end) {
  for (int64_t r = begin; r < end; ++r) row<M>(p, r);
}

}  // namespace

void int8_rows_gemm_avx2(const Int8RowsProblem& p, int64_t row_begin, int64_t row_end) {
  by_m<kInt8RowsMaxM>(p.m, [&](auto m) { rows_range<decltype(m)::value>(p, row_begin, row_end); });
}

}  // namespace leap_sparse

#pragma GCC pop_options
