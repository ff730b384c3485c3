// AVX2 kernels for bitmap-q4 weights with int8 x (with FMA, F16C, POPCNT, BMI2): the decode path of
// `activations=int8` on CPUs without AVX-512 (AMD Zen 2 and 3, most Intel client parts), on the same pair layout
// as bitmap_q4_i8/avx512.cpp (bitmap_q4/kernels.h, Q4PairProblem), so that a server loads one layout whatever
// its CPU.
//
// Why: the bf16-x AVX2 kernel (bitmap_q4/avx2.cpp) widens every column to fp32, about two instructions per
// column: SmolLM2-135M's 120 decoder linears took 64 ms a decoding step on a Zen 3 EPYC, ten times what a
// dense bf16 model needs there. With int8 x, one vpmaddubsw multiplies 32 columns.
//
// AVX2 has no byte expand. Per row and pair (64 columns) the kept codes are moved to their columns 16 at a
// time: a lane's source is 16 bytes of the pair's shared code bytes read from its first kept weight (one
// unaligned load; popcounts of the mask's lower bits say where), and its vpshufb control is the sum of two
// table rows indexed by the lane's two mask bytes (the low byte's ranks, the high byte's ranks plus the low
// byte's count; a pruned column's control has its high bit set, so vpshufb writes 0 there and vpblendvb puts
// the fill byte in its place). Bytes u, as the AVX-512 decoder makes them: 2 * code where kept and 15 where
// pruned (symmetric grid: level u - 15 = 2 * (code - 7.5)), or code where kept and the row's zero point where
// pruned (asymmetric). vpmaddubsw multiplies u (unsigned, <= 30) with q (int8 x, |q| <= 127): pairs of products
// in int16 (at most 2 * 30 * 127, and two of them added per pair: no saturation), vpmaddwd with ones widens
// to 8 int32 lanes. Per group, the block's 4 rows at once: their lanes summed exactly (group_sums), completed with
// fill * (-(the group's sum of q)) (the pruned columns' u * q taken out again and, where kept, the offset's),
// and folded into one fp32 vector, lane per row, with one product: t * dot, t = 0.5 * s_w * s_x (symmetric) or
// s_w * s_x. Row by row this epilogue cost as much as the group's 64 columns; four at a time, the 1B shape's
// layers from DRAM run 1.27x faster (with every code line prefetched), near the read bandwidth.
//
// That expand costs about 13 instructions per row and 16 columns, kept or not, so on the asymmetric grid the
// layer holds the dense layout instead (bitmap_q4_pack_pairs' pruned_at_zero: each pruned column its group's
// zero point, the value 0; Q4Weight.pairs() chooses it where these kernels run): two loads and a shift and mask
// per row and 64 columns, 1.8x the code bytes at 50%. SmolLM2's gate_up (3072 x 576, 50%) at M = 1, one thread on
// a Zen 3 EPYC, a harness calling the kernel (hot): 3.3 ns per 32-column word and row sparse, 1.14 dense, the
// products bit for bit the same (the same exact integer dots).
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "bitmap_q4/kernels.h"

namespace leap_sparse {
namespace {

// vpshufb controls of one 16-column lane, indexed by one mask byte each (built at compile time: no start-up
// code that a CPU without AVX2 could trip over). low[b]: bytes 0-7 the rank of each set bit of b (0x80 where
// clear), bytes 8-15 popcount(b); high[b]: bytes 0-7 zero, bytes 8-15 b's ranks (0x80 where clear). The lane's
// control for mask bytes lo, hi is low[lo] + high[hi]: a cleared column's byte stays >= 0x80.
struct LaneTables {
  alignas(16) uint8_t low[256][16];
  alignas(16) uint8_t high[256][16];
};

constexpr LaneTables make_lane_tables() {
  LaneTables t{};
  for (int mask = 0; mask < 256; ++mask) {
    int k = 0;
    for (int j = 0; j < 8; ++j) {
      const bool set = (mask >> j) & 1;
      t.low[mask][j] = set ? static_cast<uint8_t>(k) : 0x80;
      t.high[mask][8 + j] = set ? static_cast<uint8_t>(k) : 0x80;
      t.high[mask][j] = 0;
      k += set;
    }
    for (int j = 8; j < 16; ++j) t.low[mask][j] = static_cast<uint8_t>(k);
  }
  return t;
}

constexpr LaneTables kLanes = make_lane_tables();

}  // namespace
}  // namespace leap_sparse

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,popcnt,bmi,bmi2")

#include "common/kernel_common.h"  // compiled for the target above

namespace leap_sparse {
namespace {

constexpr int64_t kPrefetchBytes = 1024;  // codes this far ahead of the pass being read

inline __m256i two_lanes(const void* low, const void* high) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(static_cast<const __m128i*>(low))),
                                 _mm_loadu_si128(static_cast<const __m128i*>(high)), 1);
}

// Where the two pairs of rows of a block's pass find their shared code bytes (as PairDecoder::starts in the
// AVX-512 file): the header's counts, or 64 bytes each in a dense layout; advances `codes` to the next pass.
inline void pass_starts(bool dense, const uint8_t*& codes, const uint8_t* at[2]) {
  if (dense) {
    at[0] = codes;
    at[1] = codes + 64;
    codes += 128;
  } else {
    at[0] = codes + kPairHeader;
    at[1] = codes + kPairHeader + codes[0];
    codes += kPairHeader + codes[1];
  }
}

// A row's nibble of each byte of v as u: the code (Asym) or twice the code; `high`: the high nibbles.
template <bool Asym>
__attribute__((always_inline)) inline __m256i row_nibbles(__m256i v, bool high) {
  if (Asym) return _mm256_and_si256(high ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0f));
  return _mm256_and_si256(high ? _mm256_srli_epi16(v, 3) : _mm256_slli_epi16(v, 1), _mm256_set1_epi8(0x1e));
}

// One row's 64 columns of a pair in a dense layout as u bytes in two registers: `src` the pair of rows' shared
// code bytes (column c in byte c), `high` whether the row's codes are the high nibbles.
template <bool Asym>
__attribute__((always_inline)) inline void dense_row(const uint8_t* src, bool high, __m256i w[2]) {
  w[0] = row_nibbles<Asym>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)), high);
  w[1] = row_nibbles<Asym>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32)), high);
}

// The same from a sparse layout (2 * code or code where kept, `fill` elsewhere): `src` the shared bytes of the
// kept codes, `mask_at` the row's 64-bit mask.
template <bool Asym>
__attribute__((always_inline)) inline void expand_row(const uint8_t* src, bool high, const uint64_t* mask_at,
                                                      __m256i fill, __m256i w[2]) {
  const uint64_t mask = *mask_at;
  const uint8_t* b = reinterpret_cast<const uint8_t*>(mask_at);
  const int64_t o1 = _mm_popcnt_u64(mask & 0xffff);
  const int64_t o2 = _mm_popcnt_u64(mask & 0xffffffff);
  const int64_t o3 = _mm_popcnt_u64(mask << 16);
  const __m256i s01 = row_nibbles<Asym>(two_lanes(src, src + o1), high);
  const __m256i s23 = row_nibbles<Asym>(two_lanes(src + o2, src + o3), high);
  const __m256i c01 = _mm256_add_epi8(two_lanes(kLanes.low[b[0]], kLanes.low[b[2]]),
                                      two_lanes(kLanes.high[b[1]], kLanes.high[b[3]]));
  const __m256i c23 = _mm256_add_epi8(two_lanes(kLanes.low[b[4]], kLanes.low[b[6]]),
                                      two_lanes(kLanes.high[b[5]], kLanes.high[b[7]]));
  w[0] = _mm256_blendv_epi8(_mm256_shuffle_epi8(s01, c01), fill, c01);
  w[1] = _mm256_blendv_epi8(_mm256_shuffle_epi8(s23, c23), fill, c23);
}

// Four rows' dots as [r0 r1 r2 r3] in each 128-bit half (to be added), exactly. Several passes a group: int32
// lanes, summed by three vphaddd. One pass: each row's int16 pairs of products, |lane| <= 2 * 2 * 30 * 127 =
// 15240, so a vphaddw of two rows stays exact (<= 30480 < 2^15) and a second one too where u <= 15
// (asymmetric: 2 * 2 * 2 * 15 * 127); one vpmaddwd then widens the four rows together instead of a vpmaddwd
// each.
template <int GroupPairs, bool Asym>
__attribute__((always_inline)) inline __m256i group_sums(__m256i d0, __m256i d1, __m256i d2, __m256i d3,
                                                         __m256i ones) {
  if constexpr (GroupPairs != 1) {
    return _mm256_hadd_epi32(_mm256_hadd_epi32(d0, d1), _mm256_hadd_epi32(d2, d3));
  } else if constexpr (Asym) {
    return _mm256_madd_epi16(_mm256_hadd_epi16(_mm256_hadd_epi16(d0, d1), _mm256_hadd_epi16(d2, d3)), ones);
  } else {
    return _mm256_hadd_epi32(_mm256_madd_epi16(_mm256_hadd_epi16(d0, d1), ones),
                             _mm256_madd_epi16(_mm256_hadd_epi16(d2, d3), ones));
  }
}

// Block b's rows (kPairRows) for rows m0 .. m0 + M of x: per group an exact int32 dot per row and row of x
// (8 lanes), completed with the fill's term and folded into fp32 lanes with one product. GroupPairs: the pairs
// a group spans when known at compile time (1: the default 64-column group), 0 to read it from p. Known, the
// pass loop disappears: no loop-carried accumulators to zero, add to and copy, no loop control; at M = 1 on a
// Zen 3 core that was ~25 of the ~90 instructions a group of 4 rows took (the products unchanged).
template <int M, bool Dense, bool Asym, int GroupPairs>
void block(const Q4PairProblem& p, int64_t b, int64_t m0) {
  constexpr int R = kPairRows;
  constexpr bool dense = Dense;
  const int64_t pairs = p.cols / 64, groups = p.groups, gp = GroupPairs ? GroupPairs : p.group_pairs;
  const int64_t row0 = b * R, real = std::min<int64_t>(R, p.rows - row0);
  const uint64_t* masks = dense ? nullptr : p.masks + b * pairs * R;
  const uint8_t* c = p.codes + p.block_offsets[b];
  const int8_t* xv_base = p.x_values + m0 * p.cols;
  const __m256i ones = _mm256_set1_epi16(1);
  static_assert(R == 4, "the epilogue folds a block's 4 rows into one 4-lane vector");
  __m128 acc[M];  // lane r: row r
  for (int m = 0; m < M; ++m) acc[m] = _mm_setzero_ps();
  for (int64_t g = 0, q = 0; g < groups; ++g) {
    const int64_t at = (b * groups + g) * R;
    __m256i fills[R];
    for (int r = 0; r < R; ++r) fills[r] = _mm256_set1_epi8(static_cast<char>(Asym ? p.zeros[at + r] : 15));
    __m256i dot[R][M];  // int32 lanes; with one pass a group, that pass's int16 pairs (see the epilogue)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) dot[r][m] = _mm256_setzero_si256();
    for (int64_t j = 0; j < gp; ++j, ++q) {
      _mm_prefetch(reinterpret_cast<const char*>(c) + kPrefetchBytes, _MM_HINT_T0);
      if constexpr (Dense) {  // a dense pass is two lines
        _mm_prefetch(reinterpret_cast<const char*>(c) + kPrefetchBytes + 64, _MM_HINT_T0);
      }
      __m256i xv[M][2];
      for (int m = 0; m < M; ++m) {
        xv[m][0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xv_base + m * p.cols + 64 * q));
        xv[m][1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xv_base + m * p.cols + 64 * q + 32));
      }
      const uint8_t* src[2];
      pass_starts(dense, c, src);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        __m256i w[2];
        if constexpr (Dense) {
          dense_row<Asym>(src[r / 2], r % 2, w);
        } else {
          expand_row<Asym>(src[r / 2], r % 2, masks + q * R + r, fills[r], w);
        }
        for (int m = 0; m < M; ++m) {
          const __m256i pairs16 = _mm256_add_epi16(_mm256_maddubs_epi16(w[0], xv[m][0]),
                                                   _mm256_maddubs_epi16(w[1], xv[m][1]));
          if constexpr (GroupPairs == 1) {
            dot[r][m] = pairs16;
          } else {
            dot[r][m] = _mm256_add_epi32(dot[r][m], _mm256_madd_epi16(pairs16, ones));
          }
        }
      }
    }
    // The 4 rows' dots at once: exact int32 sums (hadd), + fill * (-(the group's sum of q)) (exactly the kept
    // columns' level * q; |dot| < 2^31: 30 * 127 * cols), one product by t = s_w * s_x (halved: symmetric).
    const __m128i fill4 = Asym ? _mm_cvtepu8_epi32(_mm_cvtsi32_si128(*reinterpret_cast<const int32_t*>(p.zeros + at)))
                               : _mm_set1_epi32(15);
    const __m128 sw4 = _mm_mul_ps(_mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p.scales + at))),
                                  _mm_set1_ps(Asym ? 1.0f : 0.5f));
    for (int m = 0; m < M; ++m) {
      const __m256i h = group_sums<GroupPairs, Asym>(dot[0][m], dot[1][m], dot[2][m], dot[3][m], ones);
      const __m128i dots = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
      const int64_t xg = (m0 + m) * groups + g;
      const __m128i exact = _mm_add_epi32(dots, _mm_mullo_epi32(fill4, _mm_set1_epi32(p.x_starts[xg])));
      acc[m] = _mm_fmadd_ps(_mm_cvtepi32_ps(exact), _mm_mul_ps(sw4, _mm_set1_ps(p.x_scales[xg])), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    float lanes[R];
    _mm_storeu_ps(lanes, acc[m]);
    for (int r = 0; r < real; ++r) {
      const float value = lanes[r] + (p.bias == nullptr ? 0.0f : p.bias[row0 + r]);
      if (p.dtype == DType::BF16) {
        store<DType::BF16>(p.y, (m0 + m) * p.y_stride + row0 + r, value);
      } else {
        store<DType::F32>(p.y, (m0 + m) * p.y_stride + row0 + r, value);
      }
    }
  }
}

template <bool Dense, bool Asym, int GroupPairs>
void blocks_of(const Q4PairProblem& p, int64_t block_begin, int64_t block_end) {
  for (int64_t b = block_begin; b < block_end; ++b) {
    for (int64_t m0 = 0; m0 < p.m; m0 += kPairChunkM) {
      switch (std::min<int64_t>(kPairChunkM, p.m - m0)) {
        case 1: block<1, Dense, Asym, GroupPairs>(p, b, m0); break;
        case 2: block<2, Dense, Asym, GroupPairs>(p, b, m0); break;
        case 3: block<3, Dense, Asym, GroupPairs>(p, b, m0); break;
        default: block<4, Dense, Asym, GroupPairs>(p, b, m0); break;
      }
    }
  }
}

template <bool Dense, bool Asym>
void blocks_of(const Q4PairProblem& p, int64_t block_begin, int64_t block_end) {
  if (p.group_pairs == 1) return blocks_of<Dense, Asym, 1>(p, block_begin, block_end);
  blocks_of<Dense, Asym, 0>(p, block_begin, block_end);
}

template <bool Asym>
void blocks_of(const Q4PairProblem& p, int64_t block_begin, int64_t block_end) {
  if (p.masks == nullptr) return blocks_of<true, Asym>(p, block_begin, block_end);
  blocks_of<false, Asym>(p, block_begin, block_end);
}

// Every kept weight of the rows of blocks block_begin..block_end, as the value it stands for in fp32 (exact: an
// fp16 scale times a small integer or half-integer): emit(row, column, value) for the real rows, row counted from
// block_begin's first; pruned columns are not emitted.
template <typename Emit>
void for_each_kept(const Q4PairProblem& p, int64_t block_begin, int64_t block_end, const Emit& emit) {
  const bool dense = p.masks == nullptr;
  const int64_t pairs = p.cols / 64;
  for (int64_t b = block_begin; b < block_end; ++b) {
    const uint8_t* c = p.codes + p.block_offsets[b];
    const int64_t row0 = b * kPairRows, real = std::min<int64_t>(kPairRows, p.rows - row0);
    for (int64_t q = 0; q < pairs; ++q) {
      const uint8_t* src[2];
      pass_starts(dense, c, src);
      const int64_t at = (b * p.groups + q / p.group_pairs) * kPairRows;
      for (int r = 0; r < real; ++r) {
        const float s = _cvtsh_ss(p.scales[at + r]);
        const float offset = p.zeros != nullptr ? static_cast<float>(p.zeros[at + r]) : 7.5f;
        uint64_t mask = dense ? ~uint64_t{0} : p.masks[(b * pairs + q) * kPairRows + r];
        for (int k = 0; mask != 0; ++k, mask &= mask - 1) {
          const int code = (src[r / 2][k] >> (4 * (r % 2))) & 15;
          emit(row0 + r - kPairRows * block_begin, 64 * q + __builtin_ctzll(mask), s * (code - offset));
        }
      }
    }
  }
}

// 4-byte units of x, fp32 or bf16, as fp32 (8 at a time).
inline __m256 load8(DType dtype, const char* x) {
  if (dtype == DType::BF16) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  return _mm256_loadu_ps(reinterpret_cast<const float*>(x));
}

}  // namespace

void q4_pairs_gemm_blocks_avx2(const Q4PairProblem& p, int64_t block_begin, int64_t block_end) {
  if (p.zeros != nullptr) return blocks_of<true>(p, block_begin, block_end);
  blocks_of<false>(p, block_begin, block_end);
}

void q4_pairs_decode_blocks_avx2(const Q4PairProblem& p, int64_t block_begin, int64_t block_end, float* out,
                                 int64_t out_stride) {
  const int64_t rows = std::min(p.rows, kPairRows * block_end) - kPairRows * block_begin;
  for (int64_t r = 0; r < rows; ++r) std::memset(out + r * out_stride, 0, p.cols * sizeof(float));
  for_each_kept(p, block_begin, block_end,
                [&](int64_t row, int64_t col, float value) { out[row * out_stride + col] = value; });
}

void q4_pairs_decode_blocks_bf16_avx2(const Q4PairProblem& p, int64_t block_begin, int64_t block_end,
                                      uint16_t* out, int64_t out_stride) {
  const int64_t rows = std::min(p.rows, kPairRows * block_end) - kPairRows * block_begin;
  for (int64_t r = 0; r < rows; ++r) std::memset(out + r * out_stride, 0, p.cols * sizeof(uint16_t));
  for_each_kept(p, block_begin, block_end, [&](int64_t row, int64_t col, float value) {
    out[row * out_stride + col] = round_to_bf16(value);
  });
}

void quantize_x_avx2(DType dtype, const void* x, int64_t row_stride, int64_t m, int64_t cols, int64_t block,
                     Q8Rows out) {
  const int64_t elem = dtype == DType::BF16 ? 2 : 4;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < m; ++i) {
    const char* row = static_cast<const char*>(x) + i * row_stride * elem;
    for (int64_t b = 0; b < cols / block; ++b) {
      __m256 amax = _mm256_setzero_ps();
      for (int64_t c = b * block; c < (b + 1) * block; c += 8) {
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, load8(dtype, row + c * elem)));
      }
      __m128 top4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      top4 = _mm_max_ps(top4, _mm_movehl_ps(top4, top4));
      const float top = _mm_cvtss_f32(_mm_max_ss(top4, _mm_movehdup_ps(top4)));
      // As quantize_x_avx512: q = round(x * (127 / max|x|)), ties to even (the default rounding).
      const __m256 inverse = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
      out.scales[i * out.groups + b] = top / 127.0f;
      for (int64_t c = b * block; c < (b + 1) * block; c += 16) {
        const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(load8(dtype, row + c * elem), inverse));
        const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(load8(dtype, row + (c + 8) * elem), inverse));
        const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xd8);  // 16 in order
        const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out.values + i * cols + c), bytes);
      }
    }
  }
}

void q8_group_starts_avx2(const Q8Rows& q8, int64_t m, int64_t cols, int32_t* starts) {
  const int64_t block = cols / q8.groups;
  const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t g = 0; g < q8.groups; ++g) {
      __m256i sum = _mm256_setzero_si256();
      for (int64_t c = g * block; c < (g + 1) * block; c += 32) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8.values + i * cols + c));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, v), ones16));
      }
      starts[i * q8.groups + g] = -sum8_epi32(sum);
    }
  }
}

}  // namespace leap_sparse

#pragma GCC pop_options
