// AVX2 kernels for the bitmap-q4 layout (with FMA, F16C, POPCNT, BMI2), for CPUs without the AVX-512 set
// or when LEAP_SPARSE_CPU_ISA=avx2 asks for them. Products and sums in fp32 (x widened by the op).
//
// AVX2 has no expand: each byte of a word's mask (8 columns) takes the next 8 codes of the word (one
// unaligned 8-byte read from the code byte the byte's first kept weight is in, shifted by a nibble when
// it is a high one, pdep spreading 8 nibbles into 8 bytes), and a pshufb control from a table indexed by
// the mask byte moves them to the byte's set bits (zero elsewhere); code - 7.5 in fp32, masked to zero
// where the bit is clear. The asymmetric grid (Q4Problem::zeros, which loses far less quality) subtracts
// the group's zero point instead of 7.5: the same instructions, an offset set once per group (a template
// parameter keeps the symmetric code as it was). The structure follows bitmap/avx2.cpp: one weight row at
// a time, chunks of up to 4 rows of x, not tuned by timing (the machines here run the AVX-512 kernels).
#include <immintrin.h>

#include <cstring>
#include <utility>

#include "bitmap_q4/kernels.h"

namespace leap_sparse {
namespace {

// Built at compile time: no start-up code that a CPU without AVX2 could trip over.
struct SpreadTables {
  alignas(16) uint8_t spread[256][16];  // pshufb control: lane j < 8 takes the rank of bit j, or zero
  alignas(32) int32_t keep[256][8];     // all ones where bit j is set
};

constexpr SpreadTables make_tables() {
  SpreadTables t{};
  for (int mask = 0; mask < 256; ++mask) {
    int k = 0;
    for (int j = 0; j < 16; ++j) t.spread[mask][j] = 0x80;
    for (int j = 0; j < 8; ++j) {
      const bool set = (mask >> j) & 1;
      if (set) t.spread[mask][j] = static_cast<uint8_t>(k++);
      t.keep[mask][j] = set ? -1 : 0;
    }
  }
  return t;
}

constexpr SpreadTables kSpread = make_tables();

}  // namespace
}  // namespace leap_sparse

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,popcnt,bmi,bmi2")

#include "common/kernel_common.h"  // compiled for the target above

namespace leap_sparse {
namespace {

constexpr int kChunkMaxM = 4;  // rows of x per pass over a weight row (16 ymm registers)
constexpr int kPrefetchBytes = 4096;

// The word's 32 levels (code - offset, no scale: offset 7.5, or the group's zero point) as four fp32 vectors of
// 8 columns, zeros where pruned. Reads at most 20 bytes from `codes` (the 8 bytes from the byte of code 24);
// kCodePad covers it.
inline void decode_word(uint32_t mask, const uint8_t* codes, __m256 offset, __m256 (&out)[4]) {
  int k = 0;
  for (int j = 0; j < 4; ++j) {
    const uint32_t byte = (mask >> (8 * j)) & 0xffu;
    uint64_t nibbles;
    std::memcpy(&nibbles, codes + (k >> 1), 8);
    nibbles >>= 4 * (k & 1);
    const __m128i bytes = _mm_cvtsi64_si128(static_cast<long long>(_pdep_u64(nibbles, 0x0f0f0f0f0f0f0f0full)));
    const __m128i placed =
        _mm_shuffle_epi8(bytes, _mm_load_si128(reinterpret_cast<const __m128i*>(kSpread.spread[byte])));
    const __m256 level = _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(placed)), offset);
    out[j] = _mm256_and_ps(level, _mm256_load_ps(reinterpret_cast<const float*>(kSpread.keep[byte])));
    k += _mm_popcnt_u32(byte);
  }
}

// The offset that group g's codes lose: 7.5, or the group's zero point (Z: the asymmetric grid, p.zeros).
template <bool Z>
inline __m256 offset_of(const Q4Problem& p, int64_t row, int64_t g) {
  if constexpr (Z) return _mm256_set1_ps(static_cast<float>(zero_point(p.zeros + row * p.zeros_stride, g)));
  return _mm256_set1_ps(7.5f);
}

// Output row `row` for rows m0 .. m0 + M of x (fp32 rows of x_stride); group sums folded with the
// group's scale at its end, as the AVX-512 kernel does.
template <DType D, int M, bool Z>
void row_pass(const Q4Problem& p, const uint8_t* c, int64_t row, int64_t m0, bool prefetch) {
  const uint8_t* bits = p.bitmap + row * (p.cols / 8);
  const uint16_t* sc = p.scales + row * p.groups;
  const float* x = static_cast<const float*>(p.x) + m0 * p.x_stride;
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  int64_t w = 0;
  for (int64_t g = 0; g < p.groups; ++g) {
    __m256 part[M];
    for (int m = 0; m < M; ++m) part[m] = _mm256_setzero_ps();
    const __m256 offset = offset_of<Z>(p, row, g);
    for (int64_t j = 0; j < p.group_words; ++j, ++w) {
      if (prefetch) {
        if ((w & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(c) + kPrefetchBytes, _MM_HINT_T0);
        if ((w & 15) == 0) _mm_prefetch(reinterpret_cast<const char*>(bits + 4 * w) + kPrefetchBytes, _MM_HINT_T0);
      }
      const uint32_t mask = mask_word(bits, w);
      __m256 e[4];
      decode_word(mask, c, offset, e);
      c += code_bytes(mask);
      for (int m = 0; m < M; ++m) {
        const float* xw = x + m * p.x_stride + 32 * w;
        const __m256 a = _mm256_fmadd_ps(e[1], _mm256_loadu_ps(xw + 8), _mm256_mul_ps(e[0], _mm256_loadu_ps(xw)));
        const __m256 b =
            _mm256_fmadd_ps(e[3], _mm256_loadu_ps(xw + 24), _mm256_mul_ps(e[2], _mm256_loadu_ps(xw + 16)));
        part[m] = _mm256_add_ps(part[m], _mm256_add_ps(a, b));
      }
    }
    const __m256 s = _mm256_set1_ps(_cvtsh_ss(sc[g]));
    for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(s, part[m], acc[m]);
  }
  const float bias = p.bias != nullptr ? p.bias[row] : 0.0f;
  for (int m = 0; m < M; ++m) store<D>(p.y, (m0 + m) * p.y_stride + row, sum8(acc[m]) + bias);
}

template <DType D, bool Z, typename Ms>
struct Passes;
template <DType D, bool Z, int... Ms>
struct Passes<D, Z, std::integer_sequence<int, Ms...>> {
  using Fn = void (*)(const Q4Problem&, const uint8_t*, int64_t, int64_t, bool);
  static constexpr Fn table[] = {&row_pass<D, Ms + 1, Z>...};
};

template <DType D, bool Z>
void gemm_rows(const Q4Problem& p, Codes codes, int64_t row_begin, int64_t row_end) {
  const uint8_t* base = codes.base - codes.first;
  const int64_t chunks = (p.m + kChunkMaxM - 1) / kChunkMaxM;
  const int64_t chunk = (p.m + chunks - 1) / chunks;
  for (int64_t row = row_begin; row < row_end; ++row) {
    for (int64_t m0 = 0; m0 < p.m; m0 += chunk) {
      Passes<D, Z, std::make_integer_sequence<int, kChunkMaxM>>::table[smaller(chunk, p.m - m0) - 1](
          p, base + p.row_offsets[row], row, m0, m0 == 0);
    }
  }
}

template <DType D>
void gemm_rows(const Q4Problem& p, Codes codes, int64_t row_begin, int64_t row_end) {
  if (p.zeros != nullptr) return gemm_rows<D, true>(p, codes, row_begin, row_end);
  gemm_rows<D, false>(p, codes, row_begin, row_end);
}

template <bool Z>
void decode_rows(const Q4Problem& p, Codes codes, int64_t row_begin, int64_t row_end, float* out, int64_t out_stride) {
  const uint8_t* base = codes.base - codes.first;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const uint8_t* c = base + p.row_offsets[row];
    const uint8_t* bits = p.bitmap + row * (p.cols / 8);
    const uint16_t* sc = p.scales + row * p.groups;
    float* o = out + (row - row_begin) * out_stride;
    for (int64_t w = 0; w < p.cols / 32; ++w) {
      const uint32_t mask = mask_word(bits, w);
      __m256 e[4];
      decode_word(mask, c, offset_of<Z>(p, row, w / p.group_words), e);
      c += code_bytes(mask);
      const __m256 s = _mm256_set1_ps(_cvtsh_ss(sc[w / p.group_words]));
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(o + 32 * w + 8 * j, _mm256_mul_ps(e[j], s));
    }
  }
}

}  // namespace

void q4_gemm_rows_avx2(const Q4Problem& p, Codes c, int64_t row_begin, int64_t row_end) {
  by_dtype(p.dtype, [&](auto d) { gemm_rows<decltype(d)::value>(p, c, row_begin, row_end); });
}

void q4_decode_rows_avx2(const Q4Problem& p, Codes c, int64_t row_begin, int64_t row_end, float* out,
                         int64_t out_stride) {
  if (p.zeros != nullptr) return decode_rows<true>(p, c, row_begin, row_end, out, out_stride);
  decode_rows<false>(p, c, row_begin, row_end, out, out_stride);
}

}  // namespace leap_sparse

#pragma GCC pop_options
