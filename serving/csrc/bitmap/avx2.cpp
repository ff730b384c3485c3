// AVX2 kernels (with FMA, F16C, POPCNT) for CPUs without AVX-512 VBMI2/BF16, or when
// LEAP_SPARSE_CPU_ISA=avx2 asks for them. AVX2 has no expand instruction: each byte of the mask (8
// columns) indexes a table of byte shuffles (16-bit values, pshufb zeroes the dropped lanes) or of lane
// permutations and lane masks (fp32 values). The products are taken in fp32.
#include <immintrin.h>

#include <cstdlib>
#include <cstring>
#include <utility>

#include "bitmap/kernels.h"

namespace leap_sparse {
namespace {

// Built at compile time: no start-up code that a CPU without AVX2 could trip over.
struct ExpandTables {
  alignas(16) uint8_t shuffle16[256][16];  // pshufb control: lane j takes the k-th 16-bit value or zero
  alignas(32) int32_t permute32[256][8];   // vpermps index: lane j takes the k-th fp32 value
  alignas(32) int32_t keep32[256][8];      // all ones where bit j is set
};

constexpr ExpandTables make_tables() {
  ExpandTables t{};
  for (int mask = 0; mask < 256; ++mask) {
    int k = 0;
    for (int j = 0; j < 8; ++j) {
      const bool set = (mask >> j) & 1;
      t.shuffle16[mask][2 * j] = set ? static_cast<uint8_t>(2 * k) : 0x80;
      t.shuffle16[mask][2 * j + 1] = set ? static_cast<uint8_t>(2 * k + 1) : 0x80;
      t.permute32[mask][j] = set ? k : 0;
      t.keep32[mask][j] = set ? -1 : 0;
      k += set ? 1 : 0;
    }
  }
  return t;
}

constexpr ExpandTables kTables = make_tables();

}  // namespace
}  // namespace leap_sparse

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,popcnt,bmi,bmi2")

#include "common/kernel_common.h"  // compiled for the target above

namespace leap_sparse {
namespace {

// The same structure as the AVX-512 kernels, sized for 16 ymm registers; not tuned by timing (the
// machines here run the AVX-512 kernels; this path is what the tests force with LEAP_SPARSE_CPU_ISA).
constexpr int kDirectMaxM = 2;         // rows of x up to which rows are multiplied directly
constexpr int kTileRows = 2;           // weight rows per tile (16 ymm registers: 2 x 4 accumulators)
constexpr int kMaxChunk = 4;           // rows of x per pass of the micro-kernel
constexpr int64_t kTileBytes = 32768;  // per weight row of the (fp32) tile: whole rows up to 8192 columns
constexpr int kPrefetchBytes = 4096;

// The next popcount(byte) values of a row at the byte's set bits, as 8 fp32 lanes (zeros elsewhere).
template <DType D>
inline __m256 expand8(uint32_t byte, const typename Traits<D>::Value* v) {
  if constexpr (D == DType::F32) {
    const __m256 packed = _mm256_loadu_ps(v);
    const __m256i index = _mm256_load_si256(reinterpret_cast<const __m256i*>(kTables.permute32[byte]));
    const __m256 keep = _mm256_load_ps(reinterpret_cast<const float*>(kTables.keep32[byte]));
    return _mm256_and_ps(_mm256_permutevar8x32_ps(packed, index), keep);
  } else {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
    const __m128i control = _mm_load_si128(reinterpret_cast<const __m128i*>(kTables.shuffle16[byte]));
    const __m128i halves = _mm_shuffle_epi8(packed, control);
    if constexpr (D == DType::F16) {
      return _mm256_cvtph_ps(halves);
    } else {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
    }
  }
}

// One 32-column word of a weight row as four fp32 vectors of 8 columns.
template <DType D>
inline void expand_word(uint32_t word, const typename Traits<D>::Value*& v, __m256 (&out)[4]) {
  for (int j = 0; j < 4; ++j) {
    const uint32_t byte = (word >> (8 * j)) & 0xffu;
    out[j] = expand8<D>(byte, v);
    v += _mm_popcnt_u32(byte);
  }
}

template <typename Value>
inline void prefetch_ahead(const Value* v, const uint8_t* bits, int64_t w) {
  const char* ahead = reinterpret_cast<const char*>(v) + kPrefetchBytes;
  _mm_prefetch(ahead, _MM_HINT_T0);
  if constexpr (sizeof(Value) == 4) _mm_prefetch(ahead + 64, _MM_HINT_T0);
  if ((w & 15) == 0) _mm_prefetch(reinterpret_cast<const char*>(bits + 4 * w) + kPrefetchBytes, _MM_HINT_T0);
}

// ---------------------------------------------------------------- few rows of x

// Output row `row` for all M rows of x (fp32). The four 8-column parts of a word go to A accumulators
// in turn, so that consecutive multiply-adds do not wait for each other.
template <DType D, int M, int A>
void row_direct(const Problem& p, const typename Traits<D>::Value* v, int64_t row) {
  const float* x = static_cast<const float*>(p.x);
  const uint8_t* bits = p.bitmap + row * p.bitmap_stride;
  __m256 acc[A][M];
  for (int a = 0; a < A; ++a)
    for (int m = 0; m < M; ++m) acc[a][m] = _mm256_setzero_ps();
  const int64_t full = p.cols / 32, tail_bytes = p.bitmap_stride - 4 * full;
  const int64_t words = full + (tail_bytes > 0 ? 1 : 0);
  for (int64_t w = 0; w < words; ++w) {
    prefetch_ahead(v, bits, w);
    __m256 e[4];
    expand_word<D>(mask_word(bits, w, w < full ? 4 : tail_bytes), v, e);
    for (int j = 0; j < 4; ++j)
      for (int m = 0; m < M; ++m)
        acc[j % A][m] = _mm256_fmadd_ps(e[j], _mm256_loadu_ps(x + m * p.x_stride + 32 * w + 8 * j),
                                        acc[j % A][m]);
  }
  const float b = p.bias != nullptr ? p.bias[row] : 0.0f;
  for (int m = 0; m < M; ++m) {
    __m256 sum = acc[0][m];
    for (int a = 1; a < A; ++a) sum = _mm256_add_ps(sum, acc[a][m]);
    store<D>(p.y, m * p.y_stride + row, sum8(sum) + b);
  }
}

template <DType D, int M>
void rows_direct(const Problem& p, const typename Traits<D>::Value* base, int64_t row_begin,
                 int64_t row_end) {
  constexpr int A = M == 1 ? 4 : (M == 2 ? 2 : 1);
  for (int64_t row = row_begin; row < row_end; ++row) row_direct<D, M, A>(p, base + p.row_offsets[row], row);
}

// ---------------------------------------------------------------- many rows of x

// acc[r][m] += tile row r . x row m over `words` words of fp32 (x already offset to the tile's first column).
template <int MC>
inline void tile_multiply(__m256 (&acc)[kTileRows][MC], const float* tile, int64_t tile_stride,
                          const float* x, int64_t x_stride, int64_t words) {
  for (int64_t c = 0; c < words * 32; c += 8) {
    __m256 wv[kTileRows];
    for (int r = 0; r < kTileRows; ++r) wv[r] = _mm256_load_ps(tile + r * tile_stride + c);
    for (int m = 0; m < MC; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * x_stride + c);
      for (int r = 0; r < kTileRows; ++r) acc[r][m] = _mm256_fmadd_ps(wv[r], xv, acc[r][m]);
    }
  }
}

// One pass of MC rows of x (from m0) over a tile of columns; partial sums carry over between column
// tiles in `partial` (kTileRows x m vectors), and the last tile writes y.
template <DType D, int MC>
void tile_pass(const Problem& p, const float* tile, int64_t tile_stride, int64_t words, int64_t column,
               int64_t m0, bool first, bool last, __m256* partial, int64_t row, int rows_valid) {
  const float* x = static_cast<const float*>(p.x) + m0 * p.x_stride + column;
  __m256 acc[kTileRows][MC];
  for (int r = 0; r < kTileRows; ++r)
    for (int m = 0; m < MC; ++m) acc[r][m] = first ? _mm256_setzero_ps() : partial[r * p.m + m0 + m];
  tile_multiply<MC>(acc, tile, tile_stride, x, p.x_stride, words);
  for (int r = 0; r < kTileRows; ++r) {
    for (int m = 0; m < MC; ++m) {
      if (!last) {
        partial[r * p.m + m0 + m] = acc[r][m];
      } else if (r < rows_valid) {
        const float b = p.bias != nullptr ? p.bias[row + r] : 0.0f;
        store<D>(p.y, (m0 + m) * p.y_stride + row + r, sum8(acc[r][m]) + b);
      }
    }
  }
}

template <DType D>
using PassFn = void (*)(const Problem&, const float*, int64_t, int64_t, int64_t, int64_t, bool, bool, __m256*,
                        int64_t, int);

template <DType D, typename Ms>
struct Passes;
template <DType D, int... Ms>
struct Passes<D, std::integer_sequence<int, Ms...>> {
  static constexpr PassFn<D> table[] = {&tile_pass<D, Ms + 1>...};
};

template <DType D>
void rows_tiled(const Problem& p, const typename Traits<D>::Value* base, int64_t row_begin, int64_t row_end) {
  using Value = typename Traits<D>::Value;
  const int64_t full = p.cols / 32, tail_bytes = p.bitmap_stride - 4 * full;
  const int64_t words = full + (tail_bytes > 0 ? 1 : 0);
  const int64_t tile_words = smaller(words, kTileBytes / (32 * 4));
  const int64_t tile_stride = tile_words * 32;
  auto* tile = static_cast<float*>(std::aligned_alloc(64, kTileRows * tile_stride * sizeof(float)));
  alignas(32) __m256 partial[kTileRows * kSparseMaxM];
  for (int64_t row = row_begin; row < row_end; row += kTileRows) {
    const int rows_valid = static_cast<int>(smaller(kTileRows, row_end - row));
    const Value* v[kTileRows];
    for (int r = 0; r < rows_valid; ++r) v[r] = base + p.row_offsets[row + r];
    for (int r = rows_valid; r < kTileRows; ++r) std::memset(tile + r * tile_stride, 0, tile_stride * 4);
    for (int64_t w0 = 0; w0 < words; w0 += tile_words) {
      const int64_t w1 = smaller(words, w0 + tile_words);
      for (int r = 0; r < rows_valid; ++r) {
        const uint8_t* bits = p.bitmap + (row + r) * p.bitmap_stride;
        for (int64_t w = w0; w < w1; ++w) {
          prefetch_ahead(v[r], bits, w);
          __m256 e[4];
          expand_word<D>(mask_word(bits, w, w < full ? 4 : tail_bytes), v[r], e);
          for (int j = 0; j < 4; ++j) _mm256_store_ps(tile + r * tile_stride + (w - w0) * 32 + 8 * j, e[j]);
        }
      }
      for (int64_t m0 = 0; m0 < p.m; m0 += kMaxChunk) {
        const int chunk = static_cast<int>(smaller(kMaxChunk, p.m - m0));
        Passes<D, std::make_integer_sequence<int, kMaxChunk>>::table[chunk - 1](
            p, tile, tile_stride, w1 - w0, w0 * 32, m0, w0 == 0, w1 == words, partial, row, rows_valid);
      }
    }
  }
  std::free(tile);
}

template <DType D>
void gemm_rows(const Problem& p, Values values, int64_t row_begin, int64_t row_end) {
  using Value = typename Traits<D>::Value;
  const Value* base = static_cast<const Value*>(values.base) - values.first;
  if (p.cols == 0) {
    for (int64_t row = row_begin; row < row_end; ++row)
      for (int64_t m = 0; m < p.m; ++m) store<D>(p.y, m * p.y_stride + row, p.bias ? p.bias[row] : 0.0f);
    return;
  }
  switch (p.m <= kDirectMaxM ? p.m : 0) {
    case 1: return rows_direct<D, 1>(p, base, row_begin, row_end);
    case 2: return rows_direct<D, 2>(p, base, row_begin, row_end);
    default: return rows_tiled<D>(p, base, row_begin, row_end);
  }
}

template <DType D>
void decode_rows(const Problem& p, Values values, int64_t row_begin, int64_t row_end, void* out,
                 int64_t out_stride) {
  using Value = typename Traits<D>::Value;
  const Value* base = static_cast<const Value*>(values.base) - values.first;
  const int64_t full = p.cols / 32, tail_bytes = p.bitmap_stride - 4 * full;
  const int64_t words = full + (tail_bytes > 0 ? 1 : 0);
  for (int64_t row = row_begin; row < row_end; ++row) {
    const Value* v = base + p.row_offsets[row];
    const uint8_t* bits = p.bitmap + row * p.bitmap_stride;
    Value* o = static_cast<Value*>(out) + (row - row_begin) * out_stride;
    for (int64_t w = 0; w < words; ++w) {
      const uint32_t word = mask_word(bits, w, w < full ? 4 : tail_bytes);
      for (int j = 0; j < 4; ++j) {
        const uint32_t byte = (word >> (8 * j)) & 0xffu;
        Value* dst = o + 32 * w + 8 * j;
        if constexpr (D == DType::F32) {
          _mm256_storeu_ps(dst, expand8<D>(byte, v));
        } else {
          const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
          const __m128i control = _mm_load_si128(reinterpret_cast<const __m128i*>(kTables.shuffle16[byte]));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm_shuffle_epi8(packed, control));
        }
        v += _mm_popcnt_u32(byte);
      }
    }
    for (int64_t c = 32 * words; c < out_stride; ++c) o[c] = 0;
  }
}

}  // namespace

void gemm_rows_avx2(const Problem& p, Values v, int64_t row_begin, int64_t row_end) {
  by_dtype(p.dtype, [&](auto d) { gemm_rows<decltype(d)::value>(p, v, row_begin, row_end); });
}

void decode_rows_avx2(const Problem& p, Values v, int64_t row_begin, int64_t row_end, void* out,
                      int64_t out_stride) {
  if (p.dtype == DType::F32) return decode_rows<DType::F32>(p, v, row_begin, row_end, out, out_stride);
  decode_rows<DType::BF16>(p, v, row_begin, row_end, out, out_stride);  // fp16 values too: 16-bit moves
}

// x [m, cols] (rows x_row_stride elements apart, in dtype) widened to fp32 rows of out_stride, zero past
// cols: the AVX2 kernels and the AVX-512 fp16/fp32 kernels multiply in fp32.
void widen_x_avx2(DType dtype, const void* x, int64_t x_row_stride, int64_t m, int64_t cols, float* out,
                  int64_t out_stride) {
  for (int64_t i = 0; i < m; ++i) {
    float* o = out + i * out_stride;
    int64_t c = 0;
    if (dtype == DType::F32) {
      std::memcpy(o, static_cast<const float*>(x) + i * x_row_stride, cols * sizeof(float));
      c = cols;
    } else {
      const uint16_t* src = static_cast<const uint16_t*>(x) + i * x_row_stride;
      for (; c + 8 <= cols; c += 8) {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c));
        const __m256 f = dtype == DType::F16
                             ? _mm256_cvtph_ps(h)
                             : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
        _mm256_storeu_ps(o + c, f);
      }
      for (; c < cols; ++c) {
        const uint16_t h = src[c];
        o[c] = dtype == DType::F16 ? _cvtsh_ss(h) : [&] {
          const uint32_t u = static_cast<uint32_t>(h) << 16;
          float f;
          std::memcpy(&f, &u, 4);
          return f;
        }();
      }
    }
    for (; c < out_stride; ++c) o[c] = 0.0f;
  }
}

}  // namespace leap_sparse

#pragma GCC pop_options
