// AVX-512 kernels (F, BW, VL, VBMI2 for vpexpandw, BF16 for vdpbf16ps). Only this file's functions are
// compiled for these instructions; the op calls them after checking the CPU's flags.
//
// bf16, every M up to kSparseMaxM: blocks of 3 or 4 weight rows are walked word by word, each word
// expanded in a register and multiplied with a chunk of up to 8 rows of x (x interleaved by word, so
// that one pointer reaches every row of the chunk); above 8 rows of x each block runs chunks of up to 6,
// the later ones re-expanding the block's words from cache, so every weight is read from memory once.
// fp16 and fp32 (two fp32 vectors per word) do the same for up to kFloatDirectMaxM rows of x; above,
// blocks of kTileRows weight rows are expanded into a dense fp32 tile and a register-blocked
// micro-kernel multiplies the tile with up to kMaxChunk rows of x at a time. Every constant below was
// chosen by timing the alternatives side by side on the Zen 5 machines this project runs on, with
// weights read from DRAM (bench/cpu_kernels.py).
#include <immintrin.h>

#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>

#include "bitmap/kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi2,avx512bf16,bmi,bmi2,popcnt,fma,f16c")

#include "common/kernel_avx512.h"  // compiled for the target above

namespace leap_sparse {
namespace {

// The direct path multiplies each expanded word with a chunk of rows of x held in accumulators: bf16
// takes one register per row of x and word, so a block of 4 weight rows takes chunks of up to 6 rows
// of x (24 accumulators) and a block of 3 rows chunks of up to 8. One row at a time leaves the
// multiply-adds of a row waiting for each other (a 6-cycle latency per word); 3 or 4 rows keep 18 to
// 32 independent sums. fp16 and fp32 take two fp32 registers per row of x and word: blocks of 4 rows
// with up to kFloatDirectMaxM rows of x, the tiles above.
// x is read from L2 once per block and chunk, so blocks of 4 rows (a quarter of x per weight row) beat
// two chunks of 8 in blocks of 3 above 8 rows of x: at M = 16, Llama-3-8B's layers (x of 128 KiB)
// measured 0.96-1.02x dense against 0.86-0.90x. At M = 8 one chunk in blocks of 3 measured 1.27-1.53x,
// two chunks of 4 in blocks of 4 1.16-1.32x.
constexpr int kChunkMaxM = 8;   // rows of x in one chunk (blocks of 3 weight rows above kWideChunkM)
constexpr int kWideChunkM = 6;  // rows of x per chunk, in blocks of 4 weight rows, above kChunkMaxM
constexpr int kFloatDirectMaxM = 3;
constexpr int kTileRows = 4;  // weight rows per (fp32) tile
constexpr int kMaxChunk = 6;  // rows of x per pass of the micro-kernel: 24 accumulators (4 to 8 measured alike)
// Per weight row of the tile: whole rows up to 8192 columns. Splitting rows into L1-sized pieces
// measured 10-25% slower at 8 and 16 rows of x (the partial sums go through memory between pieces).
constexpr int64_t kTileBytes = 32768;
// Software prefetch distance: the hardware prefetcher alone left the kernel at half the bandwidth;
// 8 KiB measured best (2-4 KiB short of bandwidth, 32 KiB no better).
constexpr int64_t kPrefetchBytes = 8192;

// The next popcount(word) 16-bit values of a row, placed at the word's set bits (zeros elsewhere).
//
// On Zen 5, vpexpandw and vexpandps with zero-masking ({z}) still wait for the previous value of their
// destination register. GCC gives every expand of a loop the same destination, so all expands of a row
// formed one serial chain, and the expand's latency, not its throughput, set the kernel's speed (1.3-1.5
// ns per 32-column word and row at M = 1). Merge-masking into a register that was just zeroed (vpxord of
// itself, which waits for nothing) breaks the chain. The empty asm hides that the register is zero, so
// that GCC neither turns the merge back into {z} nor folds the load into vpexpandw's memory form (also
// slower). With the chain gone, one 32-lane expand beats two 16-lane ones.
inline __m512i expand16(uint32_t word, const uint16_t* v) {
  __m512i packed = _mm512_loadu_si512(v);
  __m512i fresh = _mm512_setzero_si512();
  asm("" : "+v"(packed), "+v"(fresh));
  return _mm512_mask_expand_epi16(fresh, static_cast<__mmask32>(word), packed);
}

// The same for 16 fp32 values (vexpandps has the same false dependency).
inline __m512 expand_ps(uint32_t half_word, const float* v) {
  __m512 packed = _mm512_loadu_ps(v);
  __m512 fresh = _mm512_setzero_ps();
  asm("" : "+v"(packed), "+v"(fresh));
  return _mm512_mask_expand_ps(fresh, static_cast<__mmask16>(half_word), packed);
}

// One 32-column word of a weight row, expanded: bf16 stays packed in pairs for vdpbf16ps, fp16 and
// fp32 become two fp32 vectors of 16 columns.
template <DType D>
struct Expanded {
  __m512 lo, hi;
  __m512i pairs;
};

template <DType D>
inline Expanded<D> expand_word(uint32_t word, const typename Traits<D>::Value*& v) {
  Expanded<D> e;
  if constexpr (D == DType::BF16) {
    e.pairs = expand16(word, v);
    v += _mm_popcnt_u32(word);
  } else if constexpr (D == DType::F16) {
    const __m512i halves = expand16(word, v);
    v += _mm_popcnt_u32(word);
    e.lo = _mm512_cvtph_ps(_mm512_castsi512_si256(halves));
    e.hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(halves, 1));
  } else {
    const uint32_t low = word & 0xffffu, high = word >> 16;
    e.lo = expand_ps(low, v);
    v += _mm_popcnt_u32(low);
    e.hi = expand_ps(high, v);
    v += _mm_popcnt_u32(high);
  }
  return e;
}

// 32 columns of one row of x as the products take them: bf16 pairs, or two fp32 vectors.
template <DType D>
struct XWord {
  __m512 lo, hi;
  __m512i pairs;
};

template <DType D>
inline XWord<D> load_x(const char* x) {
  XWord<D> xv;
  if constexpr (D == DType::BF16) {
    xv.pairs = _mm512_loadu_si512(x);
  } else {
    xv.lo = _mm512_loadu_ps(reinterpret_cast<const float*>(x));
    xv.hi = _mm512_loadu_ps(reinterpret_cast<const float*>(x) + 16);
  }
  return xv;
}

// acc += the expanded word times 32 columns of one row of x.
template <DType D>
inline __m512 multiply_add(__m512 acc, const Expanded<D>& e, const XWord<D>& x) {
  if constexpr (D == DType::BF16) {
    return _mm512_dpbf16_ps(acc, (__m512bh)e.pairs, (__m512bh)x.pairs);
  } else {
    return _mm512_fmadd_ps(e.hi, x.hi, _mm512_fmadd_ps(e.lo, x.lo, acc));
  }
}

// ---------------------------------------------------------------- few rows of x

// One line of a row's values ahead (two for fp32) and its bitmap's line once every 16 words.
template <typename Value>
inline void prefetch_ahead(const Value* v, const uint8_t* bits, int64_t w, int64_t values_ahead,
                           int64_t bitmap_ahead) {
  const char* ahead = reinterpret_cast<const char*>(v) + values_ahead;
  _mm_prefetch(ahead, _MM_HINT_T0);
  if constexpr (sizeof(Value) == 4) _mm_prefetch(ahead + 64, _MM_HINT_T0);
  if ((w & 15) == 0) _mm_prefetch(reinterpret_cast<const char*>(bits + 4 * w) + bitmap_ahead, _MM_HINT_T0);
}

// Prefetch distances (bytes) for a block of rows read at once. The block's rows are consecutive, so each
// row's place of reading, moved by a whole number of blocks, is the same place in its row of a later
// block; a distance that is not such a multiple lands in a row that a neighbour is reading now (that
// prefetch is wasted, and the later block starts cold: half the bandwidth, measured).
struct Distances {
  int64_t values, bitmap;
};

inline int64_t blocks_ahead(int64_t block_bytes) {
  return block_bytes > 0 ? block_bytes * ((kPrefetchBytes + block_bytes - 1) / block_bytes) : kPrefetchBytes;
}

template <typename Value>
Distances block_distances(const Problem& p, int64_t row_begin, int64_t row_end, int block_rows) {
  // Rows are about equally long (exactly so for Wanda's masks); the average over the range is near enough.
  const int64_t span = row_end - 1 - row_begin;
  const int64_t block = span > 0 ? (p.row_offsets[row_end - 1] - p.row_offsets[row_begin]) * block_rows / span *
                                       static_cast<int64_t>(sizeof(Value))
                                 : 0;
  return {blocks_ahead(block), blocks_ahead(block_rows * p.bitmap_stride)};
}

// Where row m of x holds word w: bf16 x is interleaved by word (all rows' word w, then word w + 1), fp32
// x is row-major (see Problem::x).
template <DType D>
inline const char* x_at(const Problem& p, int64_t m, int64_t w) {
  const char* x = static_cast<const char*>(p.x);
  if constexpr (D == DType::BF16) return x + (w * p.m + m) * 64;
  return x + (m * p.x_stride + w * 32) * 4;
}

// Output rows row .. row + R (R <= 4) for rows m0 .. m0 + M of x, each a sum over its words in order,
// whatever R and the chunks are, so that the split of rows between threads leaves results unchanged.
// The first chunk of a block prefetches; later chunks find the block's words in cache.
template <DType D, int M, int R>
void block_direct(const Problem& p, const typename Traits<D>::Value* base, int64_t row, int64_t m0,
                  const Distances* ahead) {
  using Value = typename Traits<D>::Value;
  const Value* v[R];
  const uint8_t* bits[R];
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r) {
    v[r] = base + p.row_offsets[row + r];
    bits[r] = p.bitmap + (row + r) * p.bitmap_stride;
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  }
  const int64_t full = p.cols / 32, tail_bytes = p.bitmap_stride - 4 * full;
  // bf16 blocks of 3 weight rows (7 or 8 rows of x) walk x with a running pointer; the others compute
  // each address from the word index. Each form measured 7-12% faster than the other on its own path
  // (Llama-3-8B's layers, both builds in one run, either order), though the hot loops differ only in
  // the address arithmetic: why is not understood, so both are kept where they measured faster.
  constexpr bool kRunningX = D == DType::BF16 && R == 3;
  const char* x_run = static_cast<const char*>(p.x) + m0 * 64;
  const auto step = [&](int64_t w, int64_t bytes) __attribute__((always_inline)) {
    Expanded<D> e[R];
    for (int r = 0; r < R; ++r) e[r] = expand_word<D>(mask_word(bits[r], w, bytes), v[r]);
    for (int m = 0; m < M; ++m) {
      const XWord<D> xv = load_x<D>(kRunningX ? x_run + m * 64 : x_at<D>(p, m0 + m, w));
      for (int r = 0; r < R; ++r) acc[r][m] = multiply_add<D>(acc[r][m], e[r], xv);
    }
    if constexpr (kRunningX) x_run += p.m * 64;
  };
  if (ahead != nullptr) {
    for (int64_t w = 0; w < full; ++w) {
      for (int r = 0; r < R; ++r) prefetch_ahead(v[r], bits[r], w, ahead->values, ahead->bitmap);
      step(w, 4);
    }
  } else {
    for (int64_t w = 0; w < full; ++w) step(w, 4);
  }
  if (tail_bytes > 0) step(full, tail_bytes);
  const __mmask8 valid = static_cast<__mmask8>((1u << R) - 1);
  const __m128 bias = p.bias == nullptr ? _mm_setzero_ps() : _mm_maskz_loadu_ps(valid, p.bias + row);
  for (int m = 0; m < M; ++m) {
    __m512 total[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int r = 0; r < R; ++r) total[r] = acc[r][m];
    store4<D>(p.y, (m0 + m) * p.y_stride + row, _mm_add_ps(sum4(total[0], total[1], total[2], total[3]), bias), R);
  }
}

// All rows of x in one chunk: blocks of R weight rows (single rows at the end of the range), the block
// kernel inlined (a call per block cost 5-10% on short rows).
template <DType D, int M, int R>
void rows_direct(const Problem& p, const typename Traits<D>::Value* base, int64_t row_begin, int64_t row_end) {
  using Value = typename Traits<D>::Value;
  const Distances ahead = block_distances<Value>(p, row_begin, row_end, R);
  const Distances single = block_distances<Value>(p, row_begin, row_end, 1);
  int64_t row = row_begin;
  for (; row + R <= row_end; row += R) block_direct<D, M, R>(p, base, row, 0, &ahead);
  for (; row < row_end; ++row) block_direct<D, M, 1>(p, base, row, 0, &single);
}

// The kernels for blocks of R weight rows and First.. rows of x: rows[m - First] walks a range of rows,
// blocks[m - First] one block.
template <DType D, int R, int First, typename Ms>
struct DirectTable;
template <DType D, int R, int First, int... Ms>
struct DirectTable<D, R, First, std::integer_sequence<int, Ms...>> {
  using Fn = void (*)(const Problem&, const typename Traits<D>::Value*, int64_t, int64_t);
  static constexpr Fn rows[] = {&rows_direct<D, First + Ms, R>...};
  using BlockFn = void (*)(const Problem&, const typename Traits<D>::Value*, int64_t, int64_t, const Distances*);
  static constexpr BlockFn blocks[] = {&block_direct<D, First + Ms, R>...};
};

template <DType D, int R, int First, int Last>
using Direct = DirectTable<D, R, First, std::make_integer_sequence<int, Last - First + 1>>;

// bf16 above kChunkMaxM rows of x: blocks of 4 weight rows, each running every chunk of x (the first
// prefetches; the others find the block's words in cache).
template <DType D>
void rows_chunked(const Problem& p, const typename Traits<D>::Value* base, int64_t row_begin, int64_t row_end,
                  int64_t chunk) {
  using Value = typename Traits<D>::Value;
  const Distances ahead = block_distances<Value>(p, row_begin, row_end, 4);
  const Distances single = block_distances<Value>(p, row_begin, row_end, 1);
  const auto run = [&](const auto& blocks, int64_t row, const Distances* first) {
    for (int64_t m0 = 0; m0 < p.m; m0 += chunk) {
      blocks[smaller(chunk, p.m - m0) - 1](p, base, row, m0, m0 == 0 ? first : nullptr);
    }
  };
  int64_t row = row_begin;
  for (; row + 4 <= row_end; row += 4) run(Direct<D, 4, 1, kWideChunkM>::blocks, row, &ahead);
  for (; row < row_end; ++row) run(Direct<D, 1, 1, kWideChunkM>::blocks, row, &single);
}

// ---------------------------------------------------------------- fp16 and fp32, many rows of x

// The tile holds weight rows in fp32, `cols` columns each, in words of 32 columns; a zero-filled row
// stands in for rows past the end.
template <DType D>
inline void expand_into_tile(const uint8_t* bits, const typename Traits<D>::Value*& v, int64_t w_begin,
                             int64_t w_end, int64_t full, int64_t tail_bytes, float* out) {
  for (int64_t w = w_begin; w < w_end; ++w) {
    prefetch_ahead(v, bits, w, kPrefetchBytes, kPrefetchBytes);
    const Expanded<D> e = expand_word<D>(mask_word(bits, w, w < full ? 4 : tail_bytes), v);
    float* o = out + (w - w_begin) * 32;
    _mm512_store_ps(o, e.lo);
    _mm512_store_ps(o + 16, e.hi);
  }
}

// acc[r][m] += tile row r . x row m over `words` words (x already offset to the tile's first column).
// Where the next block of weight rows lies, for prefetching it while this block is multiplied (the
// multiply-adds would otherwise leave the memory idle): `lines` lines of values per word from `values`,
// and a line of bitmap every four words from `bitmap`; lines == 0: nothing to prefetch.
struct Ahead {
  const char* values;
  int64_t lines;
  const char* bitmap;
};

template <int MC>
inline void tile_multiply(__m512 (&acc)[kTileRows][MC], const float* tile, int64_t tile_stride, const float* x,
                          int64_t x_row, int64_t words, Ahead ahead) {
  for (int64_t w = 0; w < words; ++w) {
    if (ahead.lines > 0) {
      for (int64_t i = 0; i < ahead.lines; ++i) _mm_prefetch(ahead.values + 64 * i, _MM_HINT_T0);
      ahead.values += 64 * ahead.lines;
      if ((w & 3) == 0) {
        _mm_prefetch(ahead.bitmap, _MM_HINT_T0);
        ahead.bitmap += 64;
      }
    }
    for (int half = 0; half < 2; ++half) {
      __m512 wv[kTileRows];
      const int64_t column = w * 32 + half * 16;
      for (int r = 0; r < kTileRows; ++r) wv[r] = _mm512_load_ps(tile + r * tile_stride + column);
      for (int m = 0; m < MC; ++m) {
        const __m512 xv = _mm512_loadu_ps(x + m * x_row + column);
        for (int r = 0; r < kTileRows; ++r) acc[r][m] = _mm512_fmadd_ps(wv[r], xv, acc[r][m]);
      }
    }
  }
}

// The end of a pass of MC rows of x (from m0) over a tile of columns: partial sums carry over between
// column tiles in `partial` (kTileRows x M vectors), and the last tile writes y.
template <DType D, int MC>
inline void finish_pass(const Problem& p, __m512 (&acc)[kTileRows][MC], int64_t m0, bool last, __m512* partial,
                        int64_t row, int rows_valid) {
  if (!last) {
    for (int r = 0; r < kTileRows; ++r)
      for (int m = 0; m < MC; ++m) partial[r * p.m + m0 + m] = acc[r][m];
    return;
  }
  const __m128 bias = p.bias == nullptr     ? _mm_setzero_ps()
                      : rows_valid == kTileRows ? _mm_loadu_ps(p.bias + row)
                                                : _mm_maskz_loadu_ps((1u << rows_valid) - 1, p.bias + row);
  for (int m = 0; m < MC; ++m) {
    const __m128 sums = _mm_add_ps(sum4(acc[0][m], acc[1][m], acc[2][m], acc[3][m]), bias);
    store4<D>(p.y, (m0 + m) * p.y_stride + row, sums, rows_valid);
  }
}

template <DType D, int MC>
inline void start_pass(const Problem& p, __m512 (&acc)[kTileRows][MC], int64_t m0, bool first,
                       const __m512* partial) {
  for (int r = 0; r < kTileRows; ++r)
    for (int m = 0; m < MC; ++m) acc[r][m] = first ? _mm512_setzero_ps() : partial[r * p.m + m0 + m];
}

// A pass of MC rows of x (from m0) over a tile already expanded.
template <DType D, int MC>
void tile_pass(const Problem& p, const float* tile, int64_t tile_stride, int64_t words, int64_t column,
               int64_t m0, bool first, bool last, __m512* partial, int64_t row, int rows_valid, Ahead ahead) {
  const float* x = static_cast<const float*>(p.x) + m0 * p.x_stride + column;
  __m512 acc[kTileRows][MC];
  start_pass<D, MC>(p, acc, m0, first, partial);
  tile_multiply<MC>(acc, tile, tile_stride, x, p.x_stride, words, ahead);
  finish_pass<D, MC>(p, acc, m0, last, partial, row, rows_valid);
}

template <DType D>
using PassFn = void (*)(const Problem&, const float*, int64_t, int64_t, int64_t, int64_t, bool, bool,
                        __m512*, int64_t, int, Ahead);

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
  const int64_t tile_words = smaller(words, kTileBytes / (32 * sizeof(float)));
  const int64_t tile_stride = tile_words * 32;
  const int64_t row_bytes = tile_stride * sizeof(float);
  auto* tile = static_cast<float*>(std::aligned_alloc(64, kTileRows * row_bytes));
  alignas(64) __m512 partial[kTileRows * kSparseMaxM];
  for (int64_t row = row_begin; row < row_end; row += kTileRows) {
    const int rows_valid = static_cast<int>(smaller(kTileRows, row_end - row));
    const Value* v[kTileRows];
    for (int r = 0; r < rows_valid; ++r) v[r] = base + p.row_offsets[row + r];
    for (int r = rows_valid; r < kTileRows; ++r) std::memset(tile + r * tile_stride, 0, row_bytes);
    for (int64_t w0 = 0; w0 < words; w0 += tile_words) {
      const int64_t w1 = smaller(words, w0 + tile_words);
      for (int r = 0; r < rows_valid; ++r) {
        expand_into_tile<D>(p.bitmap + (row + r) * p.bitmap_stride, v[r], w0, w1, full, tail_bytes,
                            tile + r * tile_stride);
      }
      // The first pass prefetches the next block of rows (when rows fit the tile whole).
      Ahead ahead{nullptr, 0, nullptr};
      const int64_t next = row + kTileRows;
      if (tile_words == words && next < p.rows) {
        const int64_t after = smaller(next + kTileRows, p.rows - 1);
        const int64_t bytes = (p.row_offsets[after] - p.row_offsets[next]) * static_cast<int64_t>(sizeof(Value));
        ahead = {reinterpret_cast<const char*>(base + p.row_offsets[next]), (bytes + 64 * words - 1) / (64 * words),
                 reinterpret_cast<const char*>(p.bitmap + next * p.bitmap_stride)};
      }
      for (int64_t m0 = 0; m0 < p.m; m0 += kMaxChunk) {
        const int chunk = static_cast<int>(smaller(kMaxChunk, p.m - m0));
        Passes<D, std::make_integer_sequence<int, kMaxChunk>>::table[chunk - 1](
            p, tile, tile_stride, w1 - w0, w0 * 32, m0, w0 == 0, w1 == words, partial, row, rows_valid,
            m0 == 0 ? ahead : Ahead{nullptr, 0, nullptr});
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
  if constexpr (D == DType::BF16) {
    if (p.m <= kWideChunkM) return Direct<D, 4, 1, kWideChunkM>::rows[p.m - 1](p, base, row_begin, row_end);
    if (p.m <= kChunkMaxM) {
      return Direct<D, 3, kWideChunkM + 1, kChunkMaxM>::rows[p.m - kWideChunkM - 1](p, base, row_begin, row_end);
    }
    // Chunks of at most kWideChunkM rows of x, as even as they can be.
    const int64_t chunks = (p.m + kWideChunkM - 1) / kWideChunkM;
    rows_chunked<D>(p, base, row_begin, row_end, (p.m + chunks - 1) / chunks);
  } else {
    if (p.m <= kFloatDirectMaxM) return Direct<D, 4, 1, kFloatDirectMaxM>::rows[p.m - 1](p, base, row_begin, row_end);
    rows_tiled<D>(p, base, row_begin, row_end);
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
      if constexpr (D == DType::F32) {
        const uint32_t low = word & 0xffffu, high = word >> 16;
        _mm512_storeu_ps(o + 32 * w, expand_ps(low, v));
        v += _mm_popcnt_u32(low);
        _mm512_storeu_ps(o + 32 * w + 16, expand_ps(high, v));
        v += _mm_popcnt_u32(high);
      } else {
        _mm512_storeu_si512(o + 32 * w, expand16(word, v));
        v += _mm_popcnt_u32(word);
      }
    }
    for (int64_t c = 32 * words; c < out_stride; ++c) o[c] = 0;
  }
}

}  // namespace

void gemm_rows_avx512(const Problem& p, Values v, int64_t row_begin, int64_t row_end) {
  by_dtype(p.dtype, [&](auto d) { gemm_rows<decltype(d)::value>(p, v, row_begin, row_end); });
}

void decode_rows_avx512(const Problem& p, Values v, int64_t row_begin, int64_t row_end, void* out,
                        int64_t out_stride) {
  if (p.dtype == DType::F32) return decode_rows<DType::F32>(p, v, row_begin, row_end, out, out_stride);
  decode_rows<DType::BF16>(p, v, row_begin, row_end, out, out_stride);  // fp16 values too: 16-bit moves
}

}  // namespace leap_sparse

#pragma GCC pop_options
