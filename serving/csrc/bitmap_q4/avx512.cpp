// AVX-512 kernels for the bitmap-q4 layout (F, BW, VL, VBMI for vpmultishiftqb, VBMI2 for vpexpandw,
// BF16 for vdpbf16ps). Only this file's functions are compiled for these instructions; the op calls them
// after checking the CPU's flags.
//
// One 32-column word of a weight row becomes 32 bf16 weights in five instructions: the word's code bytes
// (16 bytes cover 32 codes) zero-extended so that qword j holds bytes 2j and 2j+1 (codes 4j..4j+3);
// vpmultishiftqb puts code k's nibble in the low bits of 16-bit lane k; vpermw maps it to the bf16 level
// code - 7.5 (exact in bf16); vpexpandw moves the kept levels to their columns (zeros elsewhere); then
// vdpbf16ps multiplies them with 32 columns of x (bf16 pairs, fp32 sums) into the group's accumulators,
// and each group's end folds them into the row's sums with the group's fp32 scale (acc += s * group).
// fp16 and fp32 x are widened to fp32 by the op; their words' levels are widened too and multiplied with
// vfmadd (exact levels, fp32 products).
// The asymmetric grid (Q4Problem::zeros: a 4-bit zero point per row and group, level code - zero, which loses
// far less quality than code - 7.5) only changes the vpermw table: one of 16 constant tables (kZeroLevels,
// bf16 of code - zero, exact), chosen per row and group; pruned columns stay zero-masked by the expand. A
// template parameter (Z) keeps the symmetric kernels' code as it was (bit for bit the same results). The
// M <= 4 loop reads each group's table through a pointer that zero_tables writes per block of rows (16 groups
// per step); measured (the op, bf16 x, 50%, G = 64, 1 thread, 2 vCPUs shared with other jobs, interleaved,
// medians): M = 1 gate_up 16384x2048 (rotated through 128 MB) 1.04 against 0.85 ms, 3072x576 0.075 against
// 0.058 ms (1.23-1.29x); M = 400 (decoded tiles, table s * (c - zero) per group) 0.99-1.01x. Tried (3072x576,
// hot): tables loaded from constant addresses and no zero_tables 1.03-1.05x, so the cost is the per-block
// pass (about 14%) and the table load that waits on its pointer (about 10%); byte offsets instead of
// pointers, a double buffer (the next block's tables written a block ahead), blocks of 2 or 3 rows and the
// table as vpermw's memory operand were no faster.
// Blocks of R weight rows are walked word by word, each word decoded once and multiplied with up to 8
// rows of x; above 8 rows of x, blocks of 2 rows run chunks of up to 4 rows of x, the first keeping the
// decoded words in a buffer for the others, so every weight is read from memory once per call.
//
// bf16 x at M <= kLeanMaxM (what decoding serves) runs `lean_block`, the same operations in a shorter
// loop (see there); M = 5..8, fp16 and fp32 x run `block`.
//
// What bounds it (1 thread; Zen 5 at about 4.2 GHz by a dependent add chain; 2 vCPUs shared with other
// jobs, so figures move by 10%; timings from a stand-alone harness calling q4_gemm_rows_avx512, A/B
// interleaved, the best of 5, load average about 3). At M = 1 the kernel is compute-bound: about 0.67-0.70
// ns per word and weight row in L2 (256x2048, 50%, G = 64) and 0.69-0.76 from DRAM (2048x2048 and
// 2048x8192 rotated through 70-140 MB), against 0.74-0.77 and 0.75-0.83 for `block` (the kernel before
// `lean_block`): 17-19 GB/s of weights. 80% of the 35-39 GB/s that torch.sum reads on a quiet machine
// would need 0.43 ns per word at 50%.
// - Throughput, independent chains: vpexpandw/vpexpandb zmm 1 per cycle; vpmovzxwq, vpermw, vpermb,
//   vpshufb, vpmultishiftqb, vpshldvw, vpsrlvw, vdpbf16ps 2; vpternlogd 4. Mixed with expands,
//   vpmovzxwq, vpermw, vpermb and vpshufb add their cost to the expand's (they share its pipes: the
//   expand behaves as 2 uops on 2 shuffle pipes), vpmultishiftqb, vpshldvw and vdpbf16ps mostly do not.
// - Latency (cycles): vpexpandw 4.8 (merge) to 9.6 (zero-masking in place), vpermw 7.5 (index),
//   vpermb 5 (data), vpmovzxwq 5.6, vpmultishiftqb 4.6, vdpbf16ps 8 (accumulator), vfmadd231ps 7.5.
// - The word's five vector instructions alone (vpmovzxwq, vpmultishiftqb, vpermw, vpexpandw, vdpbf16ps;
//   8 words in flight, no loads, no scalar work) take about 0.6 ns per word: that is the floor of this
//   decode, and the kernel is within 15% of it. The rest is issue width: one instruction more per group
//   and row (an add of two chains, a subtraction) cost 3-10%, which is why `lean_block` keeps a word to
//   8 instructions (3 of them scalar: kmovd, popcnt, add).
// Tried (not kept), same harness:
// - Levels by arithmetic: vpmultishiftqb putting the nibble in bits 3..6 and one vpternlogd making
//   bf16(16 + code) in place of vpermw, the expand merging bf16(23.5) into pruned columns and 23.5 times
//   each group's sum of x (computed per call by the same vdpbf16ps sequence, so empty groups cancel
//   exactly) subtracted at the fold. Its vector mix alone is 25% cheaper, but the kernel took 0.81
//   against 0.70 ns per word (a pad copy per word, a subtraction per group); in `block` it was no faster
//   at M = 1 and 40% slower at M = 8.
// - Two words per step with one vpexpandb for 64 columns (vpermb and vpmultishiftqb driven by tables
//   indexed by the first word's popcount put code i in byte i, skipping the padding nibble; two
//   vpternlogd make bf16 levels of the even and odd columns, which multiply x de-interleaved once per
//   call; the 23.5 offset as above): 4 shuffle uops per 64 columns instead of 10, but 21-25 instructions
//   per pair and row; 0.74-0.81 against 0.70 ns per word at M = 1 (a 64-byte code load splits a cache
//   line every time: 0.80; a 32-byte one 0.74), and slower at M = 2..8.
// - At M = 1: two accumulator chains per row to hide vdpbf16ps's latency (0.695 against 0.673: the add
//   costs more than the latency), blocks of 3, 6 or 8 rows (0.70-0.73, 4 is best), the bitmap
//   prefetched as well or twice the prefetch distance (no gain), no code prefetch (1.2 ns per word from
//   DRAM), a fresh zero and a merge instead of the in-place zero-masking expand (same time). Kept: the
//   two halves of a word's codes as broadcast memory operands of vpmultishiftqb (3-4%; slower at M = 2..4).
// - `lean_block` at M = 5..8 (one weight row per block): 4-9% slower than `block`, so those keep it;
//   x as the memory operand of vdpbf16ps (fewer instructions): 40-100% slower at every M.
// Through the op (bench/cpu_kernels_q4.py, 256 MiB rotated, load average about 3, other jobs' memory
// traffic: torch.sum read 20-34 GB/s in the same runs) M = 1 took 0.82-1.1 ns per word for this kernel
// and for `block` alike: the harness's 10% did not show through that noise.
// Above M = 1 each word and row adds a vdpbf16ps per row of x and each group a multiply-add per row of x
// (G = 64: 1.5 M operations per word on the two FMA pipes), on top of the decode: from M = 4..8 the bf16
// bitmap op, which only expands, is about as fast or faster (bench/results/cpu_kernels_q4.md).
#include <immintrin.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>

#include "bitmap_q4/kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,avx512vbmi2,avx512bf16,bmi,bmi2,popcnt,fma,f16c")

#include "common/kernel_avx512.h"  // compiled for the target above

namespace leap_sparse {
namespace {

constexpr int kChunkMaxM = 8;  // rows of x per chunk
// Software prefetch distance, as in bitmap/avx512.cpp (where the hardware prefetcher alone left the
// kernel at half the bandwidth): about this many bytes of the three streams together, in whole blocks.
constexpr int64_t kPrefetchBytes = 8192;

// bf16 of code - 7.5 for code = index mod 16: vpermw reads five bits of each index, and bit 4 holds a
// bit of the neighbouring code, so the table repeats.
alignas(64) constexpr uint16_t kLevels[32] = {
    0xc0f0, 0xc0d0, 0xc0b0, 0xc090, 0xc060, 0xc020, 0xbfc0, 0xbf00,
    0x3f00, 0x3fc0, 0x4020, 0x4060, 0x4090, 0x40b0, 0x40d0, 0x40f0,
    0xc0f0, 0xc0d0, 0xc0b0, 0xc090, 0xc060, 0xc020, 0xbfc0, 0xbf00,
    0x3f00, 0x3fc0, 0x4020, 0x4060, 0x4090, 0x40b0, 0x40d0, 0x40f0};

// The asymmetric grid's kLevels: table[z] holds bf16 of code - z (an integer, exact), repeated likewise.
struct ZeroLevels {
  alignas(64) uint16_t table[16][32];
};

constexpr uint16_t bf16_of_integer(int v) {  // |v| < 16: at most 4 significant bits
  if (v == 0) return 0;
  const int a = v < 0 ? -v : v;
  const int e = a >= 8 ? 3 : a >= 4 ? 2 : a >= 2 ? 1 : 0;
  return static_cast<uint16_t>((v < 0 ? 0x8000 : 0) | (127 + e) << 7 | ((a << (7 - e)) & 0x7f));
}

constexpr ZeroLevels make_zero_levels() {
  ZeroLevels t{};
  for (int z = 0; z < 16; ++z)
    for (int i = 0; i < 32; ++i) t.table[z][i] = bf16_of_integer(i % 16 - z);
  return t;
}

alignas(64) constexpr ZeroLevels kZeroLevels = make_zero_levels();
static_assert(kZeroLevels.table[0][1] == 0x3f80 && kZeroLevels.table[15][0] == 0xc170);  // 1.0, -15.0

// The level table of row `zeros`' group g (the asymmetric grid).
inline __m512i levels_of(const uint8_t* zeros, int64_t g) {
  return _mm512_load_si512(kZeroLevels.table[zero_point(zeros, g)]);
}

// vpmultishiftqb control: the low byte of 16-bit lane i of each qword takes bits 4i..4i+7.
constexpr uint64_t kNibbleShifts = 0x000c000800040000ull;

struct Decoder {
  __m512i levels, shifts;
  // Explicit: GCC compiles an implicit constructor without this file's target options.
  Decoder() : levels(_mm512_load_si512(kLevels)), shifts(_mm512_set1_epi64(static_cast<long long>(kNibbleShifts))) {}

  // The word's 32 weights in bf16, without the scale: levels at the set bits, zeros elsewhere. The
  // expand merges into a freshly zeroed register, not {z}: see expand16 in bitmap/avx512.cpp (on Zen 5
  // the zero-masking form waits for its destination's previous value, chaining every expand of a row).
  // `table`: kLevels, or the group's kZeroLevels table.
  inline __m512i word(uint32_t mask, const uint8_t* codes, __m512i table) const {
    const __m512i pairs = _mm512_cvtepu16_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    __m512i packed = _mm512_permutexvar_epi16(_mm512_multishift_epi64_epi8(shifts, pairs), table);
    __m512i fresh;
    asm("vpxord %0, %0, %0" : "=v"(fresh));  // a zero idiom per expand, not a copy of one zero register
    asm("" : "+v"(packed));
    return _mm512_mask_expand_epi16(fresh, static_cast<__mmask32>(mask), packed);
  }
};

// bf16 lanes 0..15 / 16..31 as fp32.
inline __m512 low_ps(__m512i bf) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(bf)), 16));
}
inline __m512 high_ps(__m512i bf) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(bf, 1)), 16));
}

// A group's fp16 scale in every lane: vpbroadcastw + vcvtph2ps, two instructions where _cvtsh_ss and a
// broadcast took three (a stand-alone copy of the M = 1 loop measured 10% faster with it).
inline __m512 scale_of(const uint16_t* scales, int64_t g) {
  return _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(scales[g])));
}

// Prefetch distances (bytes) per stream for blocks of rows read at once: the same whole number of blocks
// ahead in each stream (codes, bitmap, scales), so that each row's prefetch lands in the same row of a
// later block (a distance that is not a whole number of blocks lands in a row a neighbour is reading now;
// bitmap/avx512.cpp measured half the bandwidth that way).
struct Distances {
  int64_t codes, bitmap, scales, zeros;
};

Distances block_distances(const Q4Problem& p, int64_t row_begin, int64_t row_end, int block_rows) {
  // Rows are about equally long (exactly so for Wanda's masks); the average over the range is near enough.
  const int64_t span = row_end - 1 - row_begin;
  const int64_t codes = span > 0 ? (p.row_offsets[row_end - 1] - p.row_offsets[row_begin]) * block_rows / span : 0;
  const int64_t bitmap = block_rows * p.cols / 8, scales = block_rows * p.groups * 2;
  const int64_t zeros = p.zeros != nullptr ? block_rows * p.zeros_stride : 0;
  const int64_t block = codes + bitmap + scales + zeros;
  const int64_t blocks = block > 0 ? (kPrefetchBytes + block - 1) / block : 1;
  return {blocks * codes, blocks * bitmap, blocks * scales, blocks * zeros};
}

// How a block gets its words' weights: decoded from the layout, decoded and kept in a buffer (the first
// chunk of x above kChunkMaxM rows), or loaded from that buffer (the later chunks: one load per word
// instead of the five decoding instructions).
enum class Source { Decode, DecodeKeep, Kept };

// Where each of a block's R weight rows reads: its codes (advancing word by word), bitmap, scales and (Z) zero
// points.
template <int R>
struct RowStreams {
  const uint8_t* c[R];
  const uint8_t* bits[R];
  const uint16_t* sc[R];
  const uint8_t* zr[R];
};

// A block's prefetches at group g's first word w: per row the codes a group (at most 16 bytes a word) span at
// most two lines for G <= 64; G = 128 prefetches again at its third word (in `block`). The bitmap, scales and
// zero points once every 16 words.
template <int R, bool Z>
LEAP_ALWAYS_INLINE void prefetch_group(const RowStreams<R>& rows, const Distances* ahead, int64_t w, int64_t g,
                                       int64_t gw) {
  for (int r = 0; r < R; ++r) {
    _mm_prefetch(reinterpret_cast<const char*>(rows.c[r]) + ahead->codes, _MM_HINT_T0);
    if ((w & 15) < gw) {
      _mm_prefetch(reinterpret_cast<const char*>(rows.bits[r] + 4 * w) + ahead->bitmap, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(rows.sc[r] + g) + ahead->scales, _MM_HINT_T0);
      if constexpr (Z) _mm_prefetch(reinterpret_cast<const char*>(rows.zr[r] + g / 2) + ahead->zeros, _MM_HINT_T0);
    }
  }
}

// Word w of every row of the block as bf16 weights e[r] (`table`: each row's level table for the word's group),
// from the layout (advancing the rows' code pointers; DecodeKeep also keeps them) or from the kept buffer.
template <int R, Source S>
LEAP_ALWAYS_INLINE void block_word(const Decoder& dec, RowStreams<R>& rows, const __m512i (&table)[R], __m512i* kept,
                                   int64_t words, int64_t w, __m512i (&e)[R]) {
  for (int r = 0; r < R; ++r) {
    if constexpr (S == Source::Kept) {
      e[r] = _mm512_load_si512(kept + r * words + w);
    } else {
      const uint32_t mask = mask_word(rows.bits[r], w);
      e[r] = dec.word(mask, rows.c[r], table[r]);
      rows.c[r] += code_bytes(mask);
      if constexpr (S == Source::DecodeKeep) _mm512_store_si512(kept + r * words + w, e[r]);
    }
  }
}

// part[r][m] += row r's word e[r] . row m's 32 columns of x at `x` (rows x_row bytes apart): vdpbf16ps for bf16 x,
// two fp32 multiply-adds (low columns first) for fp32.
template <DType D, int M, int R>
LEAP_ALWAYS_INLINE void dot_word(const char* x, int64_t x_row, const __m512i (&e)[R], __m512 (&part)[R][M]) {
  for (int m = 0; m < M; ++m) {
    if constexpr (D == DType::BF16) {
      const __m512i xv = _mm512_loadu_si512(x + m * x_row);
      for (int r = 0; r < R; ++r) part[r][m] = _mm512_dpbf16_ps(part[r][m], (__m512bh)e[r], (__m512bh)xv);
    } else {
      const __m512 lo = _mm512_loadu_ps(reinterpret_cast<const float*>(x + m * x_row));
      const __m512 hi = _mm512_loadu_ps(reinterpret_cast<const float*>(x + m * x_row) + 16);
      for (int r = 0; r < R; ++r)
        part[r][m] = _mm512_fmadd_ps(high_ps(e[r]), hi, _mm512_fmadd_ps(low_ps(e[r]), lo, part[r][m]));
    }
  }
}

// y[m0 + m][row .. row + R) = the sums of acc[.][m] plus the bias, in the output dtype D.
template <DType D, int M, int R>
LEAP_ALWAYS_INLINE void store_rows(const Q4Problem& p, int64_t row, int64_t m0, const __m512 (&acc)[R][M]) {
  const __mmask8 valid = static_cast<__mmask8>((1u << R) - 1);
  const __m128 bias = p.bias == nullptr ? _mm_setzero_ps() : _mm_maskz_loadu_ps(valid, p.bias + row);
  for (int m = 0; m < M; ++m) {
    __m512 total[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int r = 0; r < R; ++r) total[r] = acc[r][m];
    store4<D>(p.y, (m0 + m) * p.y_stride + row, _mm_add_ps(sum4(total[0], total[1], total[2], total[3]), bias), R);
  }
}

// Output rows row .. row + R (R <= 4) for rows m0 .. m0 + M of x; GW words per group (0: p.group_words,
// read at run time); Z: the asymmetric grid (p.zeros), which only Decode and DecodeKeep read. Each output is
// the same sequence of operations whatever R, the chunks or the split of rows between threads: results do
// not depend on them.
template <DType D, int M, int R, int GW, Source S, bool Z>
void block(const Q4Problem& p, const uint8_t* base, int64_t row, int64_t m0, const Distances* ahead,
           __m512i* kept) {
  const Decoder dec;
  RowStreams<R> rows;
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r) {
    rows.c[r] = base + p.row_offsets[row + r];
    rows.bits[r] = p.bitmap + (row + r) * (p.cols / 8);
    rows.sc[r] = p.scales + (row + r) * p.groups;
    if constexpr (Z) rows.zr[r] = p.zeros + (row + r) * p.zeros_stride;
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  }
  const int64_t gw = GW > 0 ? GW : p.group_words, words = p.cols / 32;
  // x walks word by word with a running pointer (bf16: every row's word w together, see Q4Problem::x;
  // fp32: rows x_stride apart), so no address needs a multiply in the loop.
  const char* x = static_cast<const char*>(p.x) + (D == DType::BF16 ? m0 * 64 : m0 * p.x_stride * 4);
  const int64_t x_step = D == DType::BF16 ? p.m * 64 : 128, x_row = D == DType::BF16 ? 64 : p.x_stride * 4;
  int64_t w = 0;
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512 part[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) part[r][m] = _mm512_setzero_ps();
    if (S != Source::Kept && ahead != nullptr) prefetch_group<R, Z>(rows, ahead, w, g, gw);
    __m512i table[R];
    for (int r = 0; r < R; ++r) {
      if constexpr (Z && S != Source::Kept) {
        table[r] = levels_of(rows.zr[r], g);
      } else {
        table[r] = dec.levels;
      }
    }
    for (int64_t j = 0; j < gw; ++j, ++w) {
      if (S != Source::Kept && ahead != nullptr && j > 0 && (j & 1) == 0) {
        for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(rows.c[r]) + ahead->codes, _MM_HINT_T0);
      }
      __m512i e[R];
      block_word<R, S>(dec, rows, table, kept, words, w, e);
      dot_word<D, M, R>(x, x_row, e, part);
      x += x_step;
    }
    for (int r = 0; r < R; ++r) {
      const __m512 s = scale_of(rows.sc[r], g);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(s, part[r][m], acc[r][m]);
    }
  }
  store_rows<D, M, R>(p, row, m0, acc);
}

// Weight rows per block for M rows of x: two accumulators (group and row) per weight row and row of x,
// at most about 20 of the 32 registers.
constexpr int block_rows(int m) { return m <= 2 ? 4 : m == 3 ? 3 : m <= 5 ? 2 : 1; }

// The group sizes compiled with a fixed number of words per group (the loop over a group's words
// unrolled); others read it at run time.
template <typename Fn>
inline void with_group_words(int64_t gw, Fn&& fn) {
  switch (gw) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 4: return fn(std::integral_constant<int, 4>{});
    default: return fn(std::integral_constant<int, 0>{});
  }
}

// All rows of x in one chunk: blocks of R weight rows, single rows at the end of the range.
template <DType D, int M, bool Z>
void rows_direct(const Q4Problem& p, const uint8_t* base, int64_t row_begin, int64_t row_end) {
  constexpr int R = block_rows(M);
  const Distances ahead = block_distances(p, row_begin, row_end, R);
  const Distances single = block_distances(p, row_begin, row_end, 1);
  with_group_words(p.group_words, [&](auto gw) {
    constexpr int GW = decltype(gw)::value;
    int64_t row = row_begin;
    for (; row + R <= row_end; row += R) block<D, M, R, GW, Source::Decode, Z>(p, base, row, 0, &ahead, nullptr);
    for (; row < row_end; ++row) block<D, M, 1, GW, Source::Decode, Z>(p, base, row, 0, &single, nullptr);
  });
}

template <DType D, bool Z, typename Ms>
struct Table;
template <DType D, bool Z, int... Ms>
struct Table<D, Z, std::integer_sequence<int, Ms...>> {
  using RowsFn = void (*)(const Q4Problem&, const uint8_t*, int64_t, int64_t);
  static constexpr RowsFn rows[] = {&rows_direct<D, Ms + 1, Z>...};
};

template <DType D, bool Z>
using Kernels = Table<D, Z, std::make_integer_sequence<int, kChunkMaxM>>;

// Above kChunkMaxM rows of x: blocks of kChunkRows weight rows, each running chunks of up to kWideChunkM
// rows of x; the first chunk decodes the block's words into a buffer (L1/L2) that the others read. Two
// weight rows per block halve the reads of x (which leaves L1 at 16 rows of 2048 columns) against one,
// and the decoding is done once per block whatever the chunk count.
constexpr int kChunkRows = 2;
constexpr int kWideChunkM = 4;

template <DType D, int R, int GW, bool Z>
void block_chunks(const Q4Problem& p, const uint8_t* base, int64_t row, int64_t chunk, const Distances* ahead,
                  __m512i* kept) {
  using Fn = void (*)(const Q4Problem&, const uint8_t*, int64_t, int64_t, const Distances*, __m512i*);
  static constexpr Fn first[] = {
      &block<D, 1, R, GW, Source::DecodeKeep, Z>, &block<D, 2, R, GW, Source::DecodeKeep, Z>,
      &block<D, 3, R, GW, Source::DecodeKeep, Z>, &block<D, 4, R, GW, Source::DecodeKeep, Z>};
  // The kept words are levels already, whatever the grid.
  static constexpr Fn later[] = {&block<D, 1, R, GW, Source::Kept, false>, &block<D, 2, R, GW, Source::Kept, false>,
                                 &block<D, 3, R, GW, Source::Kept, false>, &block<D, 4, R, GW, Source::Kept, false>};
  for (int64_t m0 = 0; m0 < p.m; m0 += chunk) {
    (m0 == 0 ? first : later)[smaller(chunk, p.m - m0) - 1](p, base, row, m0, ahead, kept);
  }
}

template <DType D, bool Z>
void rows_chunked(const Q4Problem& p, const uint8_t* base, int64_t row_begin, int64_t row_end) {
  const int64_t chunks = (p.m + kWideChunkM - 1) / kWideChunkM;
  const int64_t chunk = (p.m + chunks - 1) / chunks;  // as even as they can be
  const Distances ahead = block_distances(p, row_begin, row_end, kChunkRows);
  const Distances single = block_distances(p, row_begin, row_end, 1);
  auto* kept = static_cast<__m512i*>(std::aligned_alloc(64, kChunkRows * p.cols * 2));
  with_group_words(p.group_words, [&](auto gw) {
    constexpr int GW = decltype(gw)::value;
    int64_t row = row_begin;
    for (; row + kChunkRows <= row_end; row += kChunkRows) {
      block_chunks<D, kChunkRows, GW, Z>(p, base, row, chunk, &ahead, kept);
    }
    for (; row < row_end; ++row) block_chunks<D, 1, GW, Z>(p, base, row, chunk, &single, kept);
  });
  std::free(kept);
}

// ---- bf16 x, up to kLeanMaxM rows: the same decode in a shorter loop ----
//
// At these M the kernel is bound by the decode's shuffle-class instructions and by how many instructions
// each word and weight row issues (see the head of this file), so this loop keeps only the five vector
// instructions of a word and three scalar ones: the code bytes of a word come from a table (an add with
// a memory operand instead of add, shift and sign extension), the expand is zero-masking in place (its
// destination is its source, so the form adds no dependency and needs no zero idiom), the group's scale
// is an fp32 broadcast operand of the fold (the block's scales converted at its start, 16 per
// instruction, the next block's prefetched), one prefetch per group and row, and one pointer addresses
// the block's bitmap. Every output is the same sequence of operations as in `block` (a vdpbf16ps per word
// into the group's sum, one multiply-add per group with the same fp32 scale), so results are the same.
constexpr int kLeanMaxM = 4;

// vpmultishiftqb control for a qword holding codes 0..15 (or 16..31) of a word: the low byte of 16-bit
// lane k takes bits 4k.. of the codes, for lanes 0..15 from the first 8 code bytes, 16..31 the next 8.
alignas(64) constexpr uint64_t kWideShifts[8] = {0x000c000800040000ull, 0x001c001800140010ull, 0x002c002800240020ull,
                                                 0x003c003800340030ull, 0x000c000800040000ull, 0x001c001800140010ull,
                                                 0x002c002800240020ull, 0x003c003800340030ull};

// ceil(n / 2): the code bytes of a word with n kept weights.
alignas(64) constexpr int64_t kCodeBytes[33] = {0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7, 8, 8,
                                                9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15, 16, 16};

// Byte i of vpermb's result takes row i % R's zero point of group i / R, from 16 bytes per row (row r's at r * 16).
template <int R>
struct Interleave {
  alignas(64) uint8_t index[64];
};

template <int R>
constexpr Interleave<R> make_interleave() {
  Interleave<R> t{};
  for (int i = 0; i < 64; ++i) t.index[i] = static_cast<uint8_t>(i < 16 * R ? (i % R) * 16 + i / R : 0);
  return t;
}

template <int R>
alignas(64) constexpr Interleave<R> kInterleave = make_interleave<R>();

// The block's zero points (the asymmetric grid) as their tables in kZeroLevels, interleaved so that one pointer
// walks them: tables[g * R + r] = the table of row `row` + r's zero point of group g; 16 groups of every row per
// step.
template <int R>
inline void zero_tables(const Q4Problem& p, int64_t row, const uint16_t** tables) {
  const __m128i nibble = _mm_set1_epi8(0x0f);
  const __m512i first = _mm512_set1_epi64(reinterpret_cast<long long>(kZeroLevels.table[0]));
  const __m512i index = _mm512_load_si512(kInterleave<R>.index);
  for (int64_t g = 0; g < p.groups; g += 16) {
    const int64_t n = smaller(16, p.groups - g);
    const __mmask16 bytes = static_cast<__mmask16>((1u << ((n + 1) / 2)) - 1);
    __m512i rows = _mm512_setzero_si512();
    for (int r = 0; r < R; ++r) {
      const __m128i b = _mm_maskz_loadu_epi8(bytes, p.zeros + (row + r) * p.zeros_stride + g / 2);
      const __m128i z = _mm_unpacklo_epi8(_mm_and_si128(b, nibble), _mm_and_si128(_mm_srli_epi16(b, 4), nibble));
      rows = _mm512_inserti32x4(rows, z, r);
    }
    alignas(64) uint8_t zeros[64];  // [g][r], 16 R bytes
    _mm512_store_si512(zeros, _mm512_permutexvar_epi8(index, rows));
    const int64_t count = n * R;  // tables written
    for (int64_t k = 0; k < count; k += 8) {
      const __m512i z = _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(zeros + k)));
      _mm512_mask_storeu_epi64(tables + g * R + k, static_cast<__mmask8>((1u << smaller(count - k, 8)) - 1),
                               _mm512_add_epi64(first, _mm512_slli_epi64(z, 6)));
    }
  }
}

// Row `row` + r's part of a lean block's start: its scales as fp32 at scales32 + r * p.groups (16 per instruction),
// and the next block's scales and (Z) zero points prefetched, which it reads before its first word (3% from DRAM).
template <int R, bool Z>
LEAP_ALWAYS_INLINE void lean_row_start(const Q4Problem& p, int64_t row, int r, float* scales32,
                                       const Distances* ahead) {
  const uint16_t* sc = p.scales + (row + r) * p.groups;
  int64_t g = 0;
  for (; g + 16 <= p.groups; g += 16) {
    _mm512_storeu_ps(scales32 + r * p.groups + g,
                    _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + g))));
  }
  if (g < p.groups) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (p.groups - g)) - 1);
    _mm512_mask_storeu_ps(scales32 + r * p.groups + g, tail, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(tail, sc + g)));
  }
  if (ahead != nullptr && row + R + r < p.rows) {
    for (int64_t b = 0; b < p.groups * 2; b += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(sc + R * p.groups) + b, _MM_HINT_T0);
    }
  }
  if constexpr (Z) {
    const uint8_t* zr = p.zeros + (row + r) * p.zeros_stride;
    if (ahead != nullptr && row + R + r < p.rows) {
      for (int64_t b = 0; b < p.zeros_stride; b += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(zr + R * p.zeros_stride) + b, _MM_HINT_T0);
      }
    }
  }
}

// One row's word (its mask at `word`, its codes at `c`, advanced past them) as 32 bf16 weights, by `table`: the
// five vector instructions of the head of this section.
template <int M>
LEAP_ALWAYS_INLINE __m512i lean_word(const uint8_t* word, const uint8_t*& c, __m512i table, __m512i shifts,
                                     __m512i wide_shifts, __mmask64 upper) {
  uint32_t mask;
  std::memcpy(&mask, word, 4);
  __m512i nibbles;
  if constexpr (M == 1) {
    // Codes 0..15 and 16..31 each broadcast from memory into the vpmultishiftqb that selects them
    // (lanes 16..31 by a byte mask): no vpmovzxwq on the expand's pipes (3-4% at M = 1; slower at
    // M = 2..4, where the extra mask and control registers cost more).
    asm("vpmultishiftqb %1%{1to8%}, %2, %0"
        : "=v"(nibbles)
        : "m"(*reinterpret_cast<const int64_t*>(c)), "v"(wide_shifts));
    asm("vpmultishiftqb %1%{1to8%}, %2, %0%{%3%}"
        : "+v"(nibbles)
        : "m"(*reinterpret_cast<const int64_t*>(c + 8)), "v"(wide_shifts), "Yk"(upper));
  } else {
    const __m512i pairs = _mm512_cvtepu16_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
    nibbles = _mm512_multishift_epi64_epi8(shifts, pairs);
  }
  __m512i packed = _mm512_permutexvar_epi16(nibbles, table);
  asm("vpexpandw %0, %0%{%1%}%{z%}"
      : "+v"(packed)
      : "Yk"(_load_mask32(reinterpret_cast<__mmask32*>(const_cast<uint8_t*>(word)))));
  c += kCodeBytes[_mm_popcnt_u32(mask)];
  return packed;
}

template <int M, int R, int GW, bool Z>
void lean_block(const Q4Problem& p, const uint8_t* base, int64_t row, float* scales32, const uint16_t** tables,
                const Distances* ahead) {
  const __m512i levels = _mm512_load_si512(kLevels);
  const __m512i shifts = _mm512_set1_epi64(static_cast<long long>(kNibbleShifts));
  const __m512i wide_shifts = _mm512_load_si512(kWideShifts);
  const __mmask64 upper = 0xffffffff00000000ull;
  const int64_t gw = GW > 0 ? GW : p.group_words, words = p.cols / 32, row_bytes = p.cols / 8;
  const uint8_t* c[R];
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r) {
    c[r] = base + p.row_offsets[row + r];
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
    lean_row_start<R, Z>(p, row, r, scales32, ahead);
  }
  if constexpr (Z) zero_tables<R>(p, row, tables);
  const uint8_t* bits = p.bitmap + row * row_bytes;  // row r's word w at bits + r * row_bytes + 4 w
  const char* x = static_cast<const char*>(p.x);
  const float* s32 = scales32;
  const uint16_t* const* tz = tables;
  for (int64_t w = 0; w < words; w += gw, ++s32, tz += R) {
    __m512 part[R][M];
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) part[r][m] = _mm512_setzero_ps();
    __m512i table[R];
    for (int r = 0; r < R; ++r) {
      if constexpr (Z) {
        table[r] = _mm512_load_si512(tz[r]);
      } else {
        table[r] = levels;
      }
    }
    if (ahead != nullptr) {
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(c[r]) + ahead->codes, _MM_HINT_T0);
    }
    for (int64_t j = 0; j < gw; ++j) {
      __m512i e[R];
      for (int r = 0; r < R; ++r) {
        e[r] = lean_word<M>(bits + r * row_bytes + 4 * (w + j), c[r], table[r], shifts, wide_shifts, upper);
      }
      dot_word<DType::BF16, M, R>(x, 64, e, part);
      x += M * 64;
    }
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(s32[r * p.groups]);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(s, part[r][m], acc[r][m]);
    }
  }
  store_rows<DType::BF16, M, R>(p, row, 0, acc);
}

template <int M, bool Z>
void lean_rows(const Q4Problem& p, const uint8_t* base, int64_t row_begin, int64_t row_end) {
  constexpr int R = block_rows(M);
  const Distances ahead = block_distances(p, row_begin, row_end, R);
  const Distances single = block_distances(p, row_begin, row_end, 1);
  float* scales32 = static_cast<float*>(std::aligned_alloc(64, ((R * p.groups + 15) / 16 * 16 + 16) * 4));
  // 16 groups per step of zero_tables: whole steps of R * 16 pointers.
  const uint16_t** tables =
      Z ? static_cast<const uint16_t**>(std::aligned_alloc(64, (p.groups + 15) / 16 * R * 128)) : nullptr;
  with_group_words(p.group_words, [&](auto gw) {
    constexpr int GW = decltype(gw)::value;
    int64_t row = row_begin;
    for (; row + R <= row_end; row += R) lean_block<M, R, GW, Z>(p, base, row, scales32, tables, &ahead);
    for (; row < row_end; ++row) lean_block<M, 1, GW, Z>(p, base, row, scales32, tables, &single);
  });
  std::free(scales32);
  std::free(tables);
}

template <bool Z, int... Ms>
constexpr auto make_lean_kernels(std::integer_sequence<int, Ms...>) {
  using Fn = void (*)(const Q4Problem&, const uint8_t*, int64_t, int64_t);
  return std::array<Fn, sizeof...(Ms)>{&lean_rows<Ms + 1, Z>...};
}

template <DType D, bool Z>
void gemm_rows(const Q4Problem& p, Codes codes, int64_t row_begin, int64_t row_end) {
  const uint8_t* base = codes.base - codes.first;
  if (D == DType::BF16 && p.m <= kLeanMaxM) {
    static constexpr auto kernels = make_lean_kernels<Z>(std::make_integer_sequence<int, kLeanMaxM>{});
    return kernels[p.m - 1](p, base, row_begin, row_end);
  }
  if (p.m <= kChunkMaxM) return Kernels<D, Z>::rows[p.m - 1](p, base, row_begin, row_end);
  rows_chunked<D, Z>(p, base, row_begin, row_end);
}

template <DType D>
void gemm_rows(const Q4Problem& p, Codes codes, int64_t row_begin, int64_t row_end) {
  if (p.zeros != nullptr) return gemm_rows<D, true>(p, codes, row_begin, row_end);
  gemm_rows<D, false>(p, codes, row_begin, row_end);
}

// Rows of W in fp32 (q4_decode_rows_avx512).
template <bool Z>
void decode_rows(const Q4Problem& p, Codes codes, int64_t row_begin, int64_t row_end, float* out, int64_t out_stride) {
  const Decoder dec;
  const uint8_t* base = codes.base - codes.first;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const uint8_t* c = base + p.row_offsets[row];
    const uint8_t* bits = p.bitmap + row * (p.cols / 8);
    const uint16_t* sc = p.scales + row * p.groups;
    const uint8_t* zr = Z ? p.zeros + row * p.zeros_stride : nullptr;
    float* o = out + (row - row_begin) * out_stride;
    for (int64_t w = 0; w < p.cols / 32; ++w) {
      const uint32_t mask = mask_word(bits, w);
      const __m512i e = dec.word(mask, c, Z ? levels_of(zr, w / p.group_words) : dec.levels);
      c += code_bytes(mask);
      const __m512 s = scale_of(sc, w / p.group_words);
      _mm512_storeu_ps(o + 32 * w, _mm512_mul_ps(low_ps(e), s));
      _mm512_storeu_ps(o + 32 * w + 16, _mm512_mul_ps(high_ps(e), s));
    }
  }
}

// Prefill with bf16 x: the fp32 values above (scale * level, exact) rounded once to bf16 (round to nearest even,
// as ATen's conversion), so that the GEMM reads a bf16 tile without a separate conversion pass. Per row and
// group a 32-word table in place of kLevels: words c and c + 16 = bf16(s * (c - 7.5)) (or s * (c - zero), the
// asymmetric grid; the exact fp32 product, vcvtneps2bf16, which reads denormals as zero: none occur, the smallest
// nonzero weight is 2^-25, 2^-24 asymmetric); pruned weights +0, as 0 * s (the format refuses negative scales).
// Measured (the op with its GEMMs skipped, 50%, M = 400, 1 thread): gate_up 16384x2048 1.3-1.35 ms, as the pair
// layout's (q4_pairs_decode_blocks_bf16_avx512); with a zero-masking expand in place of the merge into a fresh
// zero, 1.57.
template <bool Z>
void decode_rows_bf16(const Q4Problem& p, Codes codes, int64_t row_begin, int64_t row_end, uint16_t* out,
                      int64_t out_stride) {
  const Decoder dec;
  const __m512 levels = _mm512_set_ps(7.5f, 6.5f, 5.5f, 4.5f, 3.5f, 2.5f, 1.5f, 0.5f, -0.5f, -1.5f, -2.5f, -3.5f,
                                      -4.5f, -5.5f, -6.5f, -7.5f);
  const __m512 codes16 = _mm512_add_ps(levels, _mm512_set1_ps(7.5f));  // 0..15
  const uint8_t* base = codes.base - codes.first;
  for (int64_t row = row_begin; row < row_end; ++row) {
    const uint8_t* c = base + p.row_offsets[row];
    const uint8_t* bits = p.bitmap + row * (p.cols / 8);
    const uint16_t* sc = p.scales + row * p.groups;
    const uint8_t* zr = Z ? p.zeros + row * p.zeros_stride : nullptr;
    uint16_t* o = out + (row - row_begin) * out_stride;
    for (int64_t g = 0, w = 0; g < p.groups; ++g) {
      const __m512 level =
          Z ? _mm512_sub_ps(codes16, _mm512_set1_ps(static_cast<float>(zero_point(zr, g)))) : levels;
      const __m256i values = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(scale_of(sc, g), level));
      const __m512i table = _mm512_inserti64x4(_mm512_castsi256_si512(values), values, 1);
      for (const int64_t end = w + p.group_words; w < end; ++w) {
        const uint32_t mask = mask_word(bits, w);
        const __m512i pairs = _mm512_cvtepu16_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
        const __m512i packed = _mm512_permutexvar_epi16(_mm512_multishift_epi64_epi8(dec.shifts, pairs), table);
        c += code_bytes(mask);
        __m512i fresh;
        asm("vpxord %0, %0, %0" : "=v"(fresh));  // as in Decoder::word: no chain through the expand's destination
        _mm512_storeu_si512(o + 32 * w, _mm512_mask_expand_epi16(fresh, static_cast<__mmask32>(mask), packed));
      }
    }
  }
}

}  // namespace

void q4_gemm_rows_avx512(const Q4Problem& p, Codes c, int64_t row_begin, int64_t row_end) {
  by_dtype(p.dtype, [&](auto d) { gemm_rows<decltype(d)::value>(p, c, row_begin, row_end); });
}

void q4_decode_rows_avx512(const Q4Problem& p, Codes c, int64_t row_begin, int64_t row_end, float* out,
                           int64_t out_stride) {
  if (p.zeros != nullptr) return decode_rows<true>(p, c, row_begin, row_end, out, out_stride);
  decode_rows<false>(p, c, row_begin, row_end, out, out_stride);
}

void q4_decode_rows_bf16_avx512(const Q4Problem& p, Codes c, int64_t row_begin, int64_t row_end, uint16_t* out,
                                int64_t out_stride) {
  if (p.zeros != nullptr) return decode_rows_bf16<true>(p, c, row_begin, row_end, out, out_stride);
  decode_rows_bf16<false>(p, c, row_begin, row_end, out, out_stride);
}

}  // namespace leap_sparse

#pragma GCC pop_options
