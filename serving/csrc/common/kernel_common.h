// Helpers that the kernel files of both layouts share (bitmap/avx512.cpp, bitmap/avx2.cpp,
// bitmap_q4/avx512.cpp, bitmap_q4/avx2.cpp, bitmap_q4_i8/avx2.cpp, int8_rows/avx2.cpp): include it after <immintrin.h>, inside the file's
// `#pragma GCC target` region, so that every function here is compiled for that file's instructions.
// They use nothing beyond AVX2, FMA, F16C and POPCNT, which both targets enable, and sit in an anonymous
// namespace: each file keeps its own copy, compiled for its own target (one shared copy, compiled for
// AVX-512, could otherwise be the one that an AVX2-only CPU calls).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "common/types.h"

namespace leap_sparse {
namespace {

inline int64_t smaller(int64_t a, int64_t b) { return a < b ? a : b; }

// The mask of 32-column word w of a bitmap row: `bytes` (< 4 for the last word of a row whose columns
// end inside it) read, the rest zero.
inline uint32_t mask_word(const uint8_t* row, int64_t w, int64_t bytes) {
  uint32_t word = 0;
  std::memcpy(&word, row + 4 * w, bytes);
  return word;
}

// The same for a row of whole words (the bitmap-q4 layout).
inline uint32_t mask_word(const uint8_t* row, int64_t w) {
  uint32_t word;
  std::memcpy(&word, row + 4 * w, 4);
  return word;
}

// Bytes of 4-bit codes of a word of the bitmap-q4 layout: ceil(popcount / 2).
inline int code_bytes(uint32_t mask) { return (_mm_popcnt_u32(mask) + 1) >> 1; }

// Group g's zero point of a row of the bitmap-q4 layout's zeros (the asymmetric grid): the low nibble of byte
// g / 2 for even g, the high one for odd g.
inline int zero_point(const uint8_t* zeros, int64_t g) { return (zeros[g >> 1] >> ((g & 1) * 4)) & 15; }

inline uint16_t round_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

// y[index] = value in the output dtype.
template <DType D>
inline void store(void* y, int64_t index, float value) {
  if constexpr (D == DType::F32) {
    static_cast<float*>(y)[index] = value;
  } else if constexpr (D == DType::BF16) {
    static_cast<uint16_t*>(y)[index] = round_to_bf16(value);
  } else {
    static_cast<uint16_t*>(y)[index] =
        static_cast<uint16_t>(_cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// The sum of the 8 lanes.
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The sum of the 8 int32 lanes.
inline int32_t sum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// The element type of a dtype's values (bf16 and fp16 as their bits).
template <DType D>
struct Traits {
  using Value = uint16_t;
};
template <>
struct Traits<DType::F32> {
  using Value = float;
};

// f(std::integral_constant<DType, D>{}) for the run-time `dtype`: a kernel's entry point instantiates its
// template once per dtype in one line, `by_dtype(p.dtype, [&](auto d) { kernel<decltype(d)::value>(...); })`.
template <typename F>
inline void by_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::BF16: return f(std::integral_constant<DType, DType::BF16>{});
    case DType::F16: return f(std::integral_constant<DType, DType::F16>{});
    case DType::F32: return f(std::integral_constant<DType, DType::F32>{});
  }
}

template <typename F, int... Ms>
inline void by_m(int64_t m, F&& f, std::integer_sequence<int, Ms...>) {
  static_cast<void>(((m == Ms + 1 && (f(std::integral_constant<int, Ms + 1>{}), true)) || ...));
}

// f(std::integral_constant<int, m>{}) for the run-time row count m in 1..N of x: a kernel unrolled over
// its rows of x, instantiated for each count in one line.
template <int N, typename F>
inline void by_m(int64_t m, F&& f) {
  by_m(m, std::forward<F>(f), std::make_integer_sequence<int, N>{});
}

}  // namespace
}  // namespace leap_sparse
