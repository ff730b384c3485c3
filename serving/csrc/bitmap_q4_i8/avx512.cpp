// AVX-512 kernels for bitmap-q4 weights with int8 x (F, BW, VL, VBMI2, VNNI, GFNI; BF16 for bf16 y): the decode path of
// `activations=int8` (bitmap_q4/kernels.h, Q4PairProblem).
//
// Why: at M = 1 the bf16 kernel (bitmap_q4/avx512.cpp) spends five vector instructions on every 32
// columns, and on this Zen 5 every instruction of those loops costs about a third of a cycle (the loops
// issue 3-4 per cycle): its 0.7 ns per word is the instruction count, not the bandwidth. With int8 x
// (as llama.cpp's Q4_0 x Q8_0 dot does) one instruction covers 64 columns where bf16 covers 32.
//
// A pair of words (64 columns, one group at G = 64) of two rows becomes their 2 x 64 weights in five
// instructions, from the pair layout (q4_pack_pairs; bitmap_q4/kernels.h): per block and pair a 2-byte
// header, then per two rows their kept codes in the same bytes (the first row's k-th in byte k's low nibble,
// the second row's in its high nibble): one 64-byte load, per row a gf2p8affineqb that moves its nibble to
// bits 1-4 and clears the rest (2 * code), and vpexpandb that puts the kept ones at their columns, merged into
// a register of 15s: u = level + 15, unsigned (levels 2 * code - 15 where kept, 0 elsewhere). x is quantized
// per call to int8 q, with one fp32 scale per 64 columns, so vpdpbusd multiplies u with q; each sum starts from
// -15 * the sum of q over its lane's 4 columns (made per pair from q with one vpdpbusd and a negation), so that
// lane l ends at exactly sum over its kept columns of level * q. Each pair's int32 sums are folded into the
// row's fp32 sums with 0.5 * weight scale * x scale, from a table the block makes at its start. Results: sum
// over groups of (0.5 * s_w * s_x) * (exact integer dot), in fp32.
//
// Measured (stand-alone harness calling q4_pairs_gemm_blocks_avx512, 1 thread, 512 x 2048 in L2, 50%, M = 1,
// other jobs on the second core): 0.53-0.54 ns per 32-column word and row, against 0.68-0.71 for the bf16
// kernel's lean path. The block's fold table, first made with scalar code, cost 0.15 ns of that (hence the
// scales stored per block). The loop is about 13 instructions per row and pair; a micro-benchmark of its
// vector instructions alone gives 0.38 ns per word, of which the decode as it was then (two vpermb, vpmultishiftqb,
// vpexpandb: the expand alone 1.2 cycles) is 0.27. Not kept: a 32-byte code load or a 256-bit broadcast
// instead of the 64-byte one (no change), popcnt without GCC's dependency-breaking xor and two pairs per
// loop iteration (no change).
//
// Measured end to end (bench/decode_sweep.py's layers of the Llama-3.2-1B shape, mag50 q4 head4 export, huge
// pages, int8 x, 1 thread on core 1; runs interleaved with the previous kernel, medians of 6): the unsigned
// weights above, in place of |x| with the weights negated where x < 0 (a masked vpsubb per row and pair), and
// the dense layout's branch chosen at compile time took a step from 21.5 to 20.8 ms cold, 17.4 to 16.4 hot.
// The integer dots per lane are the same, so the results are bit for bit those of the previous kernel. Not
// kept: the starts as a table made by quantize_x (64 bytes per pair: hot as fast, cold 21.4-22.1 ms,
// down_proj's 8192 columns slowest, the x it reads per block twice as large).
// Then prefetching the next block's scales at a block's start (the block's table waits for its scales before
// its first pair, a miss per block when cold) took the step from 21.3 to 17.9 ms cold (interleaved, medians of
// 4-5; every projection, lm_head included), hot unchanged (16.5). Not kept beside it: the scales two blocks
// ahead, or one and two (17.7-18.0 ms, the same), prefetching block_offsets (18.1), masks 1 KiB ahead (17.7
// with the scales, 21.1 without: no change), codes 2 or 6 KiB ahead instead of 4 (before the scales: 21.7,
// 21.5 against 21.3).
// Then the decode above in place of vpermb (byte k <- code byte k / 2, from a 64-byte load), vpmultishiftqb
// to the low nibble and vpermb to 2 * code from a table: cold 19.1 to 17.3 ms, hot 18.0 to 16.0 (interleaved,
// medians of 6, with a busier second core than above: the same kernel measured 17.9 and 16.5 there). Of its
// two halves, vpmovzxdq alone (with the vpermb table) gave 18.5 and 16.5 and the vpandd alone (after the
// vpermb spread) 18.3 and 17.1 against 18.8 and 17.7 (medians of 5). Not kept: the levels' xor with 15 after
// a zero-masking expand, in place of the merge into 15s (a register copy, which Zen 5 eliminates): hot 17.1
// against 16.5.
// Then, not kept (interleaved, medians of 5-6, cold / hot against the kernel as it is, 17.1-18.2 / 16.0-16.3):
// the x scales halved and spread over their groups' R lanes once per call instead of in every block's table
// (hot 3.7% faster, cold 1.6%: down_proj's 128 groups slower cold); masks prefetched 2 KiB ahead to L1 or 4
// KiB ahead to L2 (cold 1.3% faster, within the noise); codes prefetched 3 or 5 KiB ahead (17.4, 17.3 against
// 17.1).
// All of it against the kernel before (the reference command, decode_sweep.py EXPORT --pages huge --activations
// int8 --sweeps 8, interleaved, 6 runs each): cold 24.6-25.2 ms (median 24.8) to 17.7-18.4 (18.1), hot
// 19.0-20.0 (19.6) to 15.8-16.2 (15.9).
// Then M = 1 with two blocks per pass (block_pair_m1: the x load, the starts, the prefetch and the loop shared by
// 8 rows; the x scales spread once per call; each row folded in block<1>'s order, so bit for bit the same) and
// its prefetch one pass ahead: the reference command, main and this kernel alternating, 6 runs each, the second
// core quiet: mag50 cold 16.63-17.11 ms (median 16.95) to 15.46-16.15 (15.76), hot 15.72 to 14.41; mag60 cold
// 16.64-17.10 (16.75) to 15.41-16.08 (15.65), hot 15.65 to 14.44. A stand-alone harness (L2-resident 512 x 2048,
// 40% kept) gave 0.44 to 0.42 ns per word and row. Not kept: the two blocks' codes prefetched 4 KiB ahead of each
// block's pointer (and their masks 1-4 KiB ahead): cold 5-30% slower than the one-block kernel (two interleaved
// streams in the same pages: the hardware prefetcher no longer covers them); a walk 4 KiB beyond the pass's start
// was 5% faster on 2048-column layers but slower on down_proj, whose block is larger than that. With the second
// core busy, decode_sweep's cold figures ranged 16.6-31 ms in one run set: only quiet or interleaved runs count.
// Then two rows' codes in the same bytes (the layout above; before, each row's codes lay contiguous and were
// decoded by vpmovzxdq from a 32-byte load, vpmultishiftqb to bits 1-4 and vpandd: three instructions per row, two
// of them on the shuffle port, where now one gf2p8affineqb and half a load) and the code pointers advanced by the
// pass's header instead of popcnt and a table per row; bit for bit the same results (compared output by output
// with main's op: M = 1-20, sparse, empty and dense layouts, G = 64-192, bf16 and fp32 x, 1 and 2 threads). The
// layout holds 4.6% more bytes at 50% (the 1B shape's layers 453 to 474 MB; 5.1% at 60%): the longer row's count
// per two rows, and the headers (a third of it). The reference command, main and this kernel alternating, 8 runs
// each, the second core busy with another job: mag50 cold 15.39-16.87 ms (median 15.75) to 14.26-15.35 (14.62),
// hot 14.46 to 12.32; mag60 cold 15.05-16.52 (15.93) to 13.57-14.40 (13.73), hot 14.27 to 12.13. By step (6 runs
// each against the step before): the shared bytes with max(popcnt) of the two rows as the advance, mag50 hot 14.48
// to 12.68, cold 16.1 to 14.8; then the headers and block_pair_m1's pointers advancing (GCC had spilled its
// scalars to vector registers), hot 12.71 to 12.39 (mag50) and 12.48 to 12.34 (mag60), cold the same. The op alone
// at M = 1, 2, 4, 8 (16384 x 2048 at 50%, L3-resident, hot): 13-16% faster. A stand-alone harness (L2-resident
// 512 x 2048, 50%, 8 rows a pass) gave 0.39-0.41 to 0.33 ns per word and row, 0.31 with headers. Cold at 50% now
// moves about 32 GB/s, where a plain streaming read on this core measured 38 (84%; the other core busy).
// Not kept: the second row's u as its high nibble masked in place (16 * code, 120 where pruned, the start and the
// scale scaled by 8 to match: the same results, one vpandd where gf2p8affineqb) 0.36 against 0.33 ns in the
// harness; both rows by vpaddb + vpandd and vpandd, without GFNI, 0.36; three blocks per pass (12 rows; in-process
// alternation, 30 sweeps): hot 1-3% faster, cold 1.5-3% slower; 3 or 4 prefetched lines per pass instead of 2,
// or 0 or 4 KiB beyond the next pass's position instead of 1 KiB: within 2%, inside the noise of those runs.
//
// Prefill (above kPairMaxM rows of x, q4_pairs_prefill_panels_avx512), in place of exact bf16 tiles and ATen's
// GEMM (x as it is; still there as bitmap_q4_i8_prefill("tiles")): x quantized once per call as above, W decoded
// panel by panel (32 rows, 8 blocks) into a layout for vpdpbusd, per 4-column quad and 16 rows one 64-byte
// register (lane i: the quad's 4 bytes of row i, level + 15; per pair and 16 rows the pair decoder's 16 registers,
// a 16 x 16 transpose of dwords and 16 stores), and each panel multiplied with every 6 rows of x in turn: per
// group of 64 columns 12 int32 sums (6 rows of x x 2 registers of 16 rows) take 16 vpdpbusd each, x's quad
// broadcast, starting from -15 * the group's sum of q (made once per row of x and group), then are folded into 12
// fp32 sums with (0.5 s_w) * s_x. The decoding kernel's terms, each group's dot whole instead of per 4 columns:
// the same formula, another order of the fp32 sums.
// Why: a vpdpbusd does 64 multiply-adds, a vdpbf16ps 32, and on this Zen 5 core both issue at the same rate (a
// loop of 12 independent ones, taskset -c 0: 8.5 and 7.8-7.9 G/s with the other core quiet, 3.8-4.2 each with it
// busy: 545 against 250 GMAC/s); oneDNN's bf16 GEMM on gate_up (16384 x 2048, M = 400) runs at about 96% of that
// bf16 peak, so only integer dots could go further.
// Measured (bench/prefill_q4.py --repeats 9, M = 400 bf16 rows, Llama-3.2-1B's layer, 1 thread on core 0, every
// op interleaved call by call, medians; ratios of the layer's four projections summed), q4-i8 to the tiles / to
// vLLM's oneDNN linear with its weight packed once / to dense F.linear: other core quiet, 50%: 59.7 ms against
// 104.4 (0.572x) / 101.4 (0.589x) / 105.6 (0.565x); an earlier run with it busy, 50%: 121.9 against 214.1 (0.569x)
// / 204.8 (0.595x) / 209.9 (0.581x), 60% 0.586x / 0.608x / 0.574x, the dense lm_head (49152 x 2048) 0.626x /
// 0.652x / 0.620x. SmolLM2-135M's layer (576 columns, --repeats 15): 0.584x / 0.627x / 0.600x. gate_up: 13.4 G
// multiply-adds in 32.7 ms (quiet), about 75% of the vpdpbusd peak. Per group and call the loop issues 192
// vpdpbusd, 32 weight loads, 96 broadcasts of x and 36 fold instructions; the panel's decode is about 6% of the
// time (perf, gate_up).
// Variants, all measured against the tiles in one process (interleaved, medians of 5-9, layer sums, 1 thread):
// - 4 rows of x x 3 registers (48-row panels): 0.571-0.624x; 6 x 2 (kept): 0.542-0.597x; both with the quad loop
//   over the group run by a loop: GCC then rotated the int32 sums through about two dozen register copies per
//   iteration (0.743-0.748x); `#pragma GCC unroll 16` removed them.
// - Not kept: the K loop blocked by 512 columns (the panel's columns in L1, the fp32 sums through memory):
//   4 x 3 0.580-0.795x, 6 x 2 0.610-0.633x (no gain: the panel streams from L2 fast enough); x's quad as
//   vpdpbusd's broadcast memory operand (inline asm, no broadcast instructions): 0.674-0.735x (GCC schedules
//   around the asm worse).
// - The panel's decode, first with its scale table made by one scalar fp16 conversion per row and group and no
//   prefetch: 11% of the time (perf, gate_up); the table 16 conversions at a time and each block's codes and masks
//   prefetched 512 bytes ahead: 6% (layer 0.577 -> 0.542x, one run each).
// By M (same command, --tokens M, 50%, medians of 7): see docs/kernels.md.
// The panel decoder on the shared-byte pair layout (merged after both): `bench/prefill_q4.py --repeats 5
// --sparsities 0.5 --ops dense onednn q4-i8 q4-i8t`, the other core quiet: layer 60.9 ms, 0.594x oneDNN, 0.574x
// the tiles, 0.571x dense.
//
// The asymmetric grid (Q4PairProblem::zeros: a kept weight is s * (code - zero), a zero point 0..15 per row and
// group), because it loses far less quality than s * (code - 7.5): every kernel here has it as an `Asym` template
// variant, so the symmetric instantiations are the instructions they were (their disassembly compared function by
// function with the kernel before). Its decoder makes u = code (other gf2p8affineqb matrices) merged into the row's
// zero point broadcast where pruned (in place of 15s), so each group's integer dot is the kept columns' code * q
// plus zero * the pruned columns' q; the decoding kernels add zero * (-(the group's sum of q)) per row and group in
// fp32, outside the pair loop (add_zero_term, from the block's table, the zero points and quantize_x's group sums),
// which leaves the kept columns' (code - zero) * q. The first version started each lane's dot from -zero * q's sum
// over its 4 columns instead (one more vpdpbusd per row, pair and row of x; exact integer dots, a weight at its zero
// level exactly 0); this one rounds lanes of u * q and the term relative to s (u + zero) |q| (the tests' bound for
// it), so a row whose weights are all 0 gives ~1e-7 of its scale rather than 0. Measured (bench/decode_sweep.py on
// the 1B shape's mag60 asym export, huge pages, int8 x, core 0; main's kernel, this one and the symmetric grid
// alternating by process, 4 runs each, the machine busy: cold figures 12.7-15.2 ms for all three, useless): hot
// 12.03-12.43 ms (median 12.18) to 11.83-12.18 (12.0), lower in each of the 4 pairs; symmetric 11.30-11.55;
// SmolLM2's layers (mag50, --sweeps 12, quiet) 2.27-2.30 to 1.88-1.91, symmetric 1.75-1.81. Without the term
// (wrong results, an experiment) the 1B layers ran 11.22-11.33 hot: the term's work at block starts is the rest. Not
// kept: the zero points from a table of dwords made per block (a dword broadcast is a load alone, a byte's also a
// shuffle): cold 18.1-20.0 against 13.8-15.5 symmetric, down_proj's 128 groups worst (the table's L1 space).
// Prefill: each group's dot starts at -zero * the group's sum of q (a
// vpmulld per register and row of x and group); tiles: s * (code - zero), exact, bf16 tables indexed by the code.
// Measured (a throwaway harness: the op at M = 1, bf16 x, each shape's layout cloned to ~250 MB and rotated so
// that it comes from DRAM, 50%, 1 thread on core 1, sym and asym alternated sweep by sweep, medians of 9, three
// processes; the machine's load 7-9 on its 2 cores, so absolute times are high and the ratios noisy), asym / sym:
// Llama-3.2-1B shapes, G = 64: qkv 1.04-1.06, o 1.04-1.19, gate_up 1.03-1.06, down 0.99-1.05 (sym gate_up
// 0.67-0.68 ms under that load, 0.41 in a quieter run, where asym was 1.02-1.07 on every 1B shape); G = 128: qkv
// 1.10-1.14, o 1.11-1.17, gate_up 1.12-1.17, down 1.08-1.10. SmolLM2-135M shapes (G = 64; 576 columns are no
// multiple of 128, so G = 128 only for down): within the noise (0.84-1.30 per run; medians of 21 in one run: qkv
// 1.15, o 1.14, gate_up 1.20, down 1.15, G = 128 down 1.13). Prefill (M = 400 bf16 rows, 1B layer, hot, 11
// calls alternated, medians): G = 64 59.6 -> 62.6 ms (1.05; each projection 1.04-1.06), G = 128 55.6 -> 57.6
// (1.035).
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "bitmap_q4/kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi2,avx512vnni,avx512bf16,gfni,bmi,bmi2,popcnt,fma,f16c")

#include "common/kernel_avx512.h"  // compiled for the target above

namespace leap_sparse {
namespace {

// gf2p8affineqb's matrices (one qword, repeated): output bit i of a byte is the parity of the input bits that
// matrix byte 7 - i selects. kLowNibble makes 2 * the low nibble (bits 0-3 to 1-4), kHighNibble 2 * the high
// nibble (bits 4-7 to 1-4); every other bit 0. The asymmetric grid's kLowCode and kHighCode make the code itself
// (bits 0-3).
constexpr int64_t kLowNibble = 0x0001020408000000, kHighNibble = 0x0010204080000000;
constexpr int64_t kLowCode = 0x0102040800000000, kHighCode = 0x1020408000000000;

// Asym: the asymmetric grid's decoder (u = code where kept, the row's zero point elsewhere; rows() with the two
// rows' zero points broadcast as the merge sources).
template <bool Asym>
struct PairDecoder {
  __m512i low, high, fifteen;
  PairDecoder()
      : low(_mm512_set1_epi64(Asym ? kLowCode : kLowNibble)), high(_mm512_set1_epi64(Asym ? kHighCode : kHighNibble)),
        fifteen(_mm512_set1_epi8(15)) {}

  // Where the two pairs of rows of a block's pass (pair) find their codes, from the pass's first code byte
  // `codes` (its header's counts, or 64 bytes each in a dense layout); advances `codes` to the next pass.
  template <bool Dense>
  static inline void starts(const uint8_t*& codes, const uint8_t* at[2]) {
    if constexpr (Dense) {
      at[0] = codes;
      at[1] = codes + 64;
      codes += 128;
    } else {
      const int64_t first = codes[0], both = codes[1];
      at[0] = codes + kPairHeader;
      at[1] = codes + kPairHeader + first;
      codes += kPairHeader + both;
    }
  }

  // Rows 2 rp and 2 rp + 1 of a block at pair q (masks: the block's, unused for a dense layout), from their
  // shared code bytes at `codes` (the first row's codes in the low nibbles, the second's in the high ones; see
  // bitmap_q4/kernels.h), as u8 15 more than the level (2 * code where kept, 15 elsewhere): one 64-byte load,
  // one gf2p8affineqb per row for 2 * code and vpexpandb to the kept columns, merged into 15s (a dense layout:
  // no expand).
  template <bool Dense>
  inline void rows(const uint8_t* codes, const uint64_t* masks, int64_t q, int rp, __m512i w[2]) const {
    rows<Dense>(codes, masks, q, rp, w, fifteen, fifteen);
  }
  // The same with the pruned columns' bytes from `base0` and `base1` (the asymmetric grid: each row's zero point).
  template <bool Dense>
  inline void rows(const uint8_t* codes, const uint64_t* masks, int64_t q, int rp, __m512i w[2], __m512i base0,
                   __m512i base1) const {
    const __m512i v = _mm512_loadu_si512(codes);
    const __m512i a = _mm512_gf2p8affine_epi64_epi8(v, low, 0), b = _mm512_gf2p8affine_epi64_epi8(v, high, 0);
    if constexpr (Dense) {
      w[0] = a;
      w[1] = b;
    } else {
      const uint64_t* m = masks + q * kPairRows + 2 * rp;
      w[0] = _mm512_mask_expand_epi8(base0, _load_mask64(reinterpret_cast<__mmask64*>(const_cast<uint64_t*>(m))), a);
      w[1] = _mm512_mask_expand_epi8(base1, _load_mask64(reinterpret_cast<__mmask64*>(const_cast<uint64_t*>(m + 1))), b);
    }
  }
};

// Rows 2 rp and 2 rp + 1's zero points (`z`: the block's at the current group) broadcast to every byte.
inline void zero_points(const uint8_t* z, int rp, __m512i out[2]) {
  out[0] = _mm512_set1_epi8(static_cast<char>(z[2 * rp]));
  out[1] = _mm512_set1_epi8(static_cast<char>(z[2 * rp + 1]));
}

// The same from a table of one zero point per 4 bytes (block_pair_m1's, at `z`).
inline void zero_points_at(const float* z, int rp, __m512i out[2]) {
  const uint8_t* at = reinterpret_cast<const uint8_t*>(z);
  out[0] = _mm512_set1_epi8(static_cast<char>(at[8 * rp]));
  out[1] = _mm512_set1_epi8(static_cast<char>(at[8 * rp + 4]));
}

// The zero points of 4 groups x kPairRows rows (`valid` lanes; 0 elsewhere) as int32, in the blocks' tables' lanes.
inline __m512i zero_points_epi32(__mmask16 valid, const uint8_t* z) {
  return _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(valid, z));
}

// The asymmetric grid's zero points' term, in fp32 per row and group outside the pair loop: the decoder puts each
// row's zero point at its pruned columns, so a group's integer dot is the kept columns' code * q plus zero * the
// pruned columns' q, and adding zero * (-(the group's sum of q)) leaves the kept columns' (code - zero) * q. `table`
// (here s_w s_x), `zero` and `start` (-(sum of q); zero * start exact in fp32: |sum| <= 127 G) per lane.
inline __m512 add_zero_term(__m512 term, __m512 table, __m512 zero, __m512 start) {
  return _mm512_fmadd_ps(table, _mm512_mul_ps(zero, start), term);
}

// A block's four row sums plus (Asym) its zero points' term, whose lanes hold 4 groups x 4 rows (row r in lane
// 4 k + r).
template <bool Asym>
inline __m128 with_zero_term(__m128 sums, __m512 term) {
  if constexpr (!Asym) return sums;
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(term), _mm512_extractf32x8_ps(term, 1));
  return _mm_add_ps(sums, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

// Software prefetch of the codes this many bytes ahead (one line per pair of the block's 4 rows). Measured on
// every layer of the 1B shape in model order (bench/decode_sweep.py, cold): 0 or 1024 bytes 27.9-28.0 ms,
// 2048 26.0, 4096 25.2, 8192 25.5, 16384 25.7; a second, L2 prefetch further ahead 26.7-28.6; prefetching
// the masks (a quarter of the bytes) made no difference, so the hardware's stream prefetch has them.
constexpr int64_t kPrefetchBytes = 4096;
// The same for two blocks at a time (block_pair_m1): codes and masks this far beyond the next pass's.
// Measured (model-shaped harness, cold, 40% kept): 0, 512, 1024 or 2048 bytes beyond the next pass's position
// the same within noise (17.7-18.0 ms against the one-block kernel's 18.9-19.6); a walk at a fixed 4 KiB
// from the pass's start was slower than the one-block kernel where a block's codes pass 4 KiB (down_proj).
constexpr int64_t kPairPrefetchBytes = 1024, kPairMaskPrefetchBytes = 0;

// The bias of a block's rows row0 .. row0 + real (0 without one).
inline __m128 block_bias(const Q4PairProblem& p, int64_t row0, int64_t real) {
  return p.bias == nullptr ? _mm_setzero_ps()
                           : _mm_maskz_loadu_ps(static_cast<__mmask8>((1u << real) - 1), p.bias + row0);
}

// y[at .. at + real) = a block's four row sums (acc0..acc3 summed) plus (Asym) its zero points' term and `bias`, in
// y's dtype.
template <bool Asym>
LEAP_ALWAYS_INLINE void store_block(const Q4PairProblem& p, int64_t at, int64_t real, __m512 acc0, __m512 acc1,
                                    __m512 acc2, __m512 acc3, __m512 zero_term, __m128 bias) {
  const __m128 sums = _mm_add_ps(with_zero_term<Asym>(sum4(acc0, acc1, acc2, acc3), zero_term), bias);
  if (p.dtype == DType::BF16) {
    store4<DType::BF16>(p.y, at, sums, static_cast<int>(real));
  } else {
    store4<DType::F32>(p.y, at, sums, static_cast<int>(real));
  }
}

// Block `b`'s table for rows m0 .. m0 + M of x: scales[m * groups * R + g * R + r] = 0.5 * s_w[r, g] * s_x[m, g]
// (x is quantized per weight group), 16 at a time from the block's scales as the layout stores them ([groups, R]
// fp16; padded rows 0), each x scale spread over its group's R lanes; Asym: s_w * s_x, and the zero points' term per
// row of x in zero_term[m], lanes as the table's (add_zero_term). First the next block's scales are prefetched,
// which its table needs before its first pair: a miss there stalls the block.
template <int M, bool Asym>
LEAP_ALWAYS_INLINE void block_table(const Q4PairProblem& p, int64_t b, int64_t m0, float* scales,
                                    __m512 (&zero_term)[M]) {
  constexpr int R = kPairRows;
  const int64_t groups = p.groups;
  const uint16_t* sw = p.scales + b * groups * R;
  for (int64_t i = 0; i < groups * R * 2; i += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(sw + groups * R) + i, _MM_HINT_T0);
  }
  const __m512i spread_x = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  for (int m = 0; m < M; ++m) zero_term[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g += 4) {
    const __mmask16 valid = groups - g >= 4 ? 0xffff : static_cast<__mmask16>((1u << (R * (groups - g))) - 1);
    const __mmask8 x_valid = groups - g >= 4 ? 0xf : static_cast<__mmask8>((1u << (groups - g)) - 1);
    const __m512 half_w = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, sw + g * R));
    const __m512 w = Asym ? half_w : _mm512_mul_ps(_mm512_set1_ps(0.5f), half_w);
    const __m512 zero =
        Asym ? _mm512_cvtepi32_ps(zero_points_epi32(valid, p.zeros + (b * groups + g) * R)) : _mm512_setzero_ps();
    for (int m = 0; m < M; ++m) {
      const __m128 four = _mm_maskz_loadu_ps(x_valid, p.x_scales + (m0 + m) * groups + g);
      const __m512 x = _mm512_permutexvar_ps(spread_x, _mm512_castps128_ps512(four));
      const __m512 table = _mm512_mul_ps(w, x);
      _mm512_mask_storeu_ps(scales + m * groups * R + g * R, valid, table);
      if constexpr (Asym) {
        const __m128i sums = _mm_maskz_loadu_epi32(x_valid, p.x_starts + (m0 + m) * groups + g);
        const __m512 start = _mm512_cvtepi32_ps(_mm512_permutexvar_epi32(spread_x, _mm512_castsi128_si512(sums)));
        zero_term[m] = add_zero_term(zero_term[m], table, zero, start);
      }
    }
  }
}

// Pair q's 64 bytes of each row of x (`xv_base`: row m at m * cols) and each lane's start: -15 * the sums of q over
// its 4 columns (a table of them made by quantize_x was slower: L1 space); Asym: 0 (the zero points' term is
// zero_term's).
template <int M, bool Asym>
LEAP_ALWAYS_INLINE void pair_x(const PairDecoder<Asym>& dec, const int8_t* xv_base, int64_t cols, int64_t q,
                               __m512i (&xv)[M], __m512i (&start)[M]) {
  for (int m = 0; m < M; ++m) {
    xv[m] = _mm512_loadu_si512(xv_base + m * cols + 64 * q);
    start[m] = Asym ? _mm512_setzero_si512()
                    : _mm512_sub_epi32(_mm512_setzero_si512(),
                                       _mm512_dpbusd_epi32(_mm512_setzero_si512(), dec.fifteen, xv[m]));
  }
}

// A block's rows at pair q (their codes at at[rp], 2 rows each; `z`: the zero points of the pair's group) times the
// M rows of x, folded into acc[r][m] with the table's s[m * stride + r] (stride: groups * R).
template <int M, bool Dense, bool Asym>
LEAP_ALWAYS_INLINE void block_pair(const PairDecoder<Asym>& dec, const uint8_t* const (&at)[2], const uint64_t* masks,
                                   int64_t q, const uint8_t* z, const __m512i (&xv)[M], const __m512i (&start)[M],
                                   const float* s, int64_t stride, __m512 (&acc)[kPairRows][M]) {
  for (int rp = 0; rp < kPairRows / 2; ++rp) {
    __m512i w[2], zero[2];
    if constexpr (Asym) {
      zero_points(z, rp, zero);
      dec.template rows<Dense>(at[rp], masks, q, rp, w, zero[0], zero[1]);
    } else {
      dec.template rows<Dense>(at[rp], masks, q, rp, w);
    }
    for (int h = 0; h < 2; ++h) {
      const int r = 2 * rp + h;
      for (int m = 0; m < M; ++m) {
        // Lane l: -15 * (q's sum over its 4 columns) + sum (level + 15) * q = the kept columns' level * q.
        // Asym: sum u * q = the kept columns' code * q + zero * the pruned columns' q.
        const __m512i sum = _mm512_dpbusd_epi32(start[m], w[h], xv[m]);
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(s[m * stride + r]), acc[r][m]);
      }
    }
  }
}

// Block `b`'s rows for rows m0 .. m0 + M of x. GP: pairs per group (0: p.group_pairs, read at run time).
// `scales` has room for kPairRows * M * groups floats. Asym: the asymmetric grid (p.zeros): each lane's dot starts
// from -zero * q's sum over its 4 columns (the row's zero point; one more vpdpbusd per row and row of x) and adds
// u * q (u = code, or zero where pruned), so that it ends at exactly the kept columns' (code - zero) * q, folded
// with s_w * s_x.
template <int M, int GP, bool Dense, bool Asym>
void block(const Q4PairProblem& p, int64_t b, int64_t m0, float* scales) {
  constexpr int R = kPairRows;
  const PairDecoder<Asym> dec;
  const int64_t pairs = p.cols / 64, groups = p.groups, gp = GP > 0 ? GP : p.group_pairs;
  const int64_t row0 = b * R, real = std::min<int64_t>(R, p.rows - row0);
  __m512 zero_term[M];
  block_table<M, Asym>(p, b, m0, scales, zero_term);
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  const uint64_t* masks = Dense ? nullptr : p.masks + b * pairs * R;
  const uint8_t* c = p.codes + p.block_offsets[b];
  const int8_t* xv_base = p.x_values + m0 * p.cols;
  const float* s = scales;
  const uint8_t* z = Asym ? p.zeros + b * groups * R : nullptr;  // the zero points of the pair's group
  for (int64_t q = 0, j = 0; q < pairs; ++q) {
    _mm_prefetch(reinterpret_cast<const char*>(c) + kPrefetchBytes, _MM_HINT_T0);
    __m512i xv[M], start[M];
    pair_x<M, Asym>(dec, xv_base, p.cols, q, xv, start);
    const uint8_t* at[2];
    PairDecoder<Asym>::template starts<Dense>(c, at);
    block_pair<M, Dense, Asym>(dec, at, masks, q, z, xv, start, s, groups * R, acc);
    if (++j == gp) {
      j = 0;
      s += R;
      if constexpr (Asym) z += R;
    }
  }
  const __m128 bias = block_bias(p, row0, real);
  for (int m = 0; m < M; ++m) {
    store_block<Asym>(p, (m0 + m) * p.y_stride + row0, real, acc[0][m], acc[1][m], acc[2][m], acc[3][m], zero_term[m],
                      bias);
  }
}

// block_pair_m1's tables of blocks b and b + 1, one after the other (their scales are too): 0.5 * s_w * s_x as
// block() makes them, from `spread` (the x scales spread over their groups' R lanes); Asym: each block's zero
// points' term, also as block() makes it, and (ZeroCopy) the two blocks' zero points, one per 4 bytes, zoff floats
// after the tables. First the next two blocks' scales are prefetched.
template <bool Asym, bool ZeroCopy>
LEAP_ALWAYS_INLINE void pair_m1_tables(const Q4PairProblem& p, int64_t b, float* scales, const float* spread,
                                       const float* spread_starts, int64_t zoff, __m512 (&zero_term)[2]) {
  constexpr int R = kPairRows;
  const int64_t groups = p.groups;
  const uint16_t* sw = p.scales + b * groups * R;
  for (int64_t i = 0; i < 2 * groups * R * 2; i += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(sw + 2 * groups * R) + i, _MM_HINT_T0);
  }
  zero_term[0] = _mm512_setzero_ps();
  zero_term[1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < groups * R; i += 16) {
    const __mmask16 valid = groups * R - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (groups * R - i)) - 1);
    const __m512 x = _mm512_load_ps(spread + i);
    for (int h = 0; h < 2; ++h) {
      const int64_t at = h * groups * R + i;
      const __m512 half_w = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, sw + at));
      const __m512 w = Asym ? half_w : _mm512_mul_ps(_mm512_set1_ps(0.5f), half_w);
      const __m512 table = _mm512_mul_ps(w, x);
      _mm512_mask_storeu_ps(scales + at, valid, table);
      if constexpr (Asym) {
        const __m512i zero = zero_points_epi32(valid, p.zeros + b * groups * R + at);
        if constexpr (ZeroCopy) _mm512_mask_storeu_epi32(scales + zoff + at, valid, zero);
        zero_term[h] = add_zero_term(zero_term[h], table, _mm512_cvtepi32_ps(zero), _mm512_load_ps(spread_starts + i));
      }
    }
  }
}

// The prefetches of a block_pair_m1 pass: the next pass's codes at `ahead` (two lines; four in a dense layout)
// and, in a sparse one, its masks.
template <bool Dense>
LEAP_ALWAYS_INLINE void pair_m1_prefetch(const char* ahead, const uint64_t*& masks_ahead) {
  _mm_prefetch(ahead, _MM_HINT_T0);
  _mm_prefetch(ahead + 64, _MM_HINT_T0);
  if constexpr (Dense) {
    _mm_prefetch(ahead + 128, _MM_HINT_T0);
    _mm_prefetch(ahead + 192, _MM_HINT_T0);
  } else {
    _mm_prefetch(reinterpret_cast<const char*>(masks_ahead) + kPairMaskPrefetchBytes, _MM_HINT_T0);
    masks_ahead += 2 * kPairRows;
  }
}

// One block's rows in a block_pair_m1 pass: its codes from `c` (advanced to its next pass), its masks at `masks`,
// its table at `s` and (Asym) its zero points at `z` (ZeroCopy: at s + zoff, one per 4 bytes), times x (its starts
// `start`), folded into acc[r] in block<1>'s order.
template <bool Dense, bool Asym, bool ZeroCopy>
LEAP_ALWAYS_INLINE void pair_m1_block(const PairDecoder<Asym>& dec, const uint8_t*& c, const uint64_t* masks,
                                      const float* s, const uint8_t* z, int64_t zoff, __m512i x, __m512i start,
                                      __m512 (&acc)[kPairRows]) {
  const uint8_t* at[2];
  PairDecoder<Asym>::template starts<Dense>(c, at);
  for (int rp = 0; rp < kPairRows / 2; ++rp) {
    __m512i w[2], zero[2];
    if constexpr (Asym) {
      if constexpr (ZeroCopy) {
        zero_points_at(s + zoff, rp, zero);
      } else {
        zero_points(z, rp, zero);
      }
      dec.template rows<Dense>(at[rp], masks, 0, rp, w, zero[0], zero[1]);
    } else {
      dec.template rows<Dense>(at[rp], masks, 0, rp, w);
    }
    for (int h = 0; h < 2; ++h) {
      const int r = 2 * rp + h;
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, w[h], x)), _mm512_set1_ps(s[r]), acc[r]);
    }
  }
}

// M = 1: blocks b and b + 1 in one pass over the pairs (8 rows: the x load, the starts, the prefetch and the
// loop's bookkeeping shared). Each row's sums are made and folded in the order block() folds them, so the
// results are bit for bit block<1>'s. `scales` has room for 2 * kPairRows * groups floats (Asym: 4 *); `spread`
// holds the x scales spread over their groups' R lanes (x_spread below).
template <int GP, bool Dense, bool Asym>
void block_pair_m1(const Q4PairProblem& p, int64_t b, float* scales, const float* spread, const float* spread_starts) {
  constexpr int R = kPairRows;
  const PairDecoder<Asym> dec;
  const int64_t pairs = p.cols / 64, groups = p.groups, gp = GP > 0 ? GP : p.group_pairs;
  // Asym: the zero points of the pair's group, from the layout (z0, z1: two more pointers advancing with s0, s1),
  // or with groups read at run time (GP = 0), where those pointers made GCC spill the loop's scalars to mask
  // registers, from a copy of the two blocks' (as contiguous as their scales) one per 4 bytes after the tables,
  // at a fixed distance from each row's scale, stored by pair_m1_tables, which reads them anyway.
  // Measured (1B shapes, cold, processes alternated, asym / sym): the copy at G = 64 1.13-1.21 against the
  // pointers' 1.03-1.08; at G = 128 1.05-1.17 against 1.11-1.22. Not kept: the 8 rows' zero points broadcast
  // once per group into registers held across its pairs (half the broadcasts at G = 128): slower (1B shape
  // mag60, G = 128, decode_sweep hot, 4 runs alternating, the other core busy: 12.30-12.51 ms against
  // 11.16-11.54), 8 more live registers in a loop that holds 8 accumulators.
  constexpr bool kZeroCopy = Asym && GP == 0;
  const uint8_t* z0 = Asym && !kZeroCopy ? p.zeros + b * groups * R : nullptr;
  const uint8_t* z1 = Asym && !kZeroCopy ? z0 + groups * R : nullptr;
  const int64_t zoff = 2 * groups * R;
  __m512 zero_term[2];
  pair_m1_tables<Asym, kZeroCopy>(p, b, scales, spread, spread_starts, zoff, zero_term);
  __m512 acc[2][R];
  for (int h = 0; h < 2; ++h)
    for (int r = 0; r < R; ++r) acc[h][r] = _mm512_setzero_ps();
  // Pointers that advance with the pass (the loop's bookkeeping is a fair share of its instructions).
  const uint64_t* masks0 = Dense ? nullptr : p.masks + b * pairs * R;
  const uint64_t* masks1 = Dense ? nullptr : masks0 + pairs * R;
  const uint64_t* masks_ahead = Dense ? nullptr : masks1 + pairs * R;
  const uint8_t* c0 = p.codes + p.block_offsets[b];
  const uint8_t* c1 = p.codes + p.block_offsets[b + 1];
  // The two blocks' codes (and masks) are each other's neighbours: one walk over the next pass's codes (as long
  // as this pass's, about) and masks, as fast as this pass reads its own: the codes' at c1's start + (c1's start
  // - c0's start) + both blocks' progress, = c0 + c1 + this.
  const uintptr_t ahead_base = reinterpret_cast<uintptr_t>(c1) - 2 * reinterpret_cast<uintptr_t>(c0) + kPairPrefetchBytes;
  const int8_t* xv = p.x_values;
  const float* s0 = scales;
  const float* s1 = scales + groups * R;
  for (int64_t q = 0, j = 0; q < pairs; ++q) {
    pair_m1_prefetch<Dense>(reinterpret_cast<const char*>(ahead_base + reinterpret_cast<uintptr_t>(c0) +
                                                          reinterpret_cast<uintptr_t>(c1)),
                            masks_ahead);
    const __m512i x = _mm512_loadu_si512(xv);
    xv += 64;
    // Each row's start as block() makes it.
    const __m512i start =
        Asym ? _mm512_setzero_si512()
             : _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), dec.fifteen, x));
    pair_m1_block<Dense, Asym, kZeroCopy>(dec, c0, masks0, s0, z0, zoff, x, start, acc[0]);
    pair_m1_block<Dense, Asym, kZeroCopy>(dec, c1, masks1, s1, z1, zoff, x, start, acc[1]);
    if constexpr (!Dense) {
      masks0 += R;
      masks1 += R;
    }
    if (++j == gp) {
      j = 0;
      s0 += R;
      s1 += R;
      if constexpr (Asym && !kZeroCopy) {
        z0 += R;
        z1 += R;
      }
    }
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t row0 = (b + h) * R, real = std::min<int64_t>(R, p.rows - row0);
    store_block<Asym>(p, row0, real, acc[h][0], acc[h][1], acc[h][2], acc[h][3], zero_term[h],
                      block_bias(p, row0, real));
  }
}

template <int GP, bool Dense, bool Asym>
void blocks(const Q4PairProblem& p, int64_t block_begin, int64_t block_end) {
  using Fn = void (*)(const Q4PairProblem&, int64_t, int64_t, float*);
  static constexpr Fn kChunks[kPairChunkM] = {&block<1, GP, Dense, Asym>, &block<2, GP, Dense, Asym>,
                                              &block<3, GP, Dense, Asym>, &block<4, GP, Dense, Asym>};
  float* scales = static_cast<float*>(std::aligned_alloc(64, ((kPairRows * kPairChunkM * p.groups + 15) / 16 + 1) * 64));
  if (p.m == 1) {
    // s_x and (Asym) -(sum of q) spread over each group's R lanes, once per call, padded with 0 to whole registers.
    const int64_t n = kPairRows * p.groups, padded = (n + 15) / 16 * 16;
    float* spread = static_cast<float*>(std::aligned_alloc(64, 2 * padded * sizeof(float)));
    float* spread_starts = spread + padded;
    for (int64_t i = 0; i < padded; ++i) {
      spread[i] = i < n ? p.x_scales[i / kPairRows] : 0.0f;
      spread_starts[i] = Asym && i < n ? static_cast<float>(p.x_starts[i / kPairRows]) : 0.0f;
    }
    int64_t b = block_begin;
    for (; b + 1 < block_end; b += 2) block_pair_m1<GP, Dense, Asym>(p, b, scales, spread, spread_starts);
    if (b < block_end) block<1, GP, Dense, Asym>(p, b, 0, scales);
    std::free(spread);
    std::free(scales);
    return;
  }
  for (int64_t b = block_begin; b < block_end; ++b) {
    // Above kPairChunkM rows of x, the block's later chunks decode it again from L1/L2.
    for (int64_t m0 = 0; m0 < p.m; m0 += kPairChunkM) kChunks[std::min<int64_t>(kPairChunkM, p.m - m0) - 1](p, b, m0, scales);
  }
  std::free(scales);
}

// 64 values of x (bf16 or fp32) as fp32, in four registers.
inline void load64(DType dtype, const void* x, __m512 out[4]) {
  for (int i = 0; i < 4; ++i) {
    if (dtype == DType::BF16) {
      const __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(x) + i);
      out[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      out[i] = _mm512_loadu_ps(static_cast<const float*>(x) + 16 * i);
    }
  }
}

// Bytes 16 I .. 16 I + 15 of w as fp32.
template <int I>
inline __m512 quarter(__m512i w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(w, I)));
}

}  // namespace

namespace {

// G = 64 (the default) and 128 with their groups' pairs counted at compile time; other group sizes read it at run
// time. Measured at G = 128 (the 1B shape's mag60 layers on the asymmetric grid, decode_sweep.py, core 0, 3 runs
// alternating with G = 64): the run-time path 13.05-13.19 ms hot, 16.25-16.51 cold; unrolled 11.30-11.45 hot,
// 12.84-12.97 cold, against G = 64's 11.76-11.82 and 13.53-15.40.
template <bool Asym>
void blocks_of(const Q4PairProblem& p, int64_t block_begin, int64_t block_end) {
  const bool dense = p.masks == nullptr;
  switch (p.group_pairs) {
    case 1:
      return dense ? blocks<1, true, Asym>(p, block_begin, block_end) : blocks<1, false, Asym>(p, block_begin, block_end);
    case 2:
      return dense ? blocks<2, true, Asym>(p, block_begin, block_end) : blocks<2, false, Asym>(p, block_begin, block_end);
    default:
      return dense ? blocks<0, true, Asym>(p, block_begin, block_end) : blocks<0, false, Asym>(p, block_begin, block_end);
  }
}

}  // namespace

void q4_pairs_gemm_blocks_avx512(const Q4PairProblem& p, int64_t block_begin, int64_t block_end) {
  if (p.zeros != nullptr) return blocks_of<true>(p, block_begin, block_end);
  blocks_of<false>(p, block_begin, block_end);
}

void quantize_x_avx512(DType dtype, const void* x, int64_t row_stride, int64_t m, int64_t cols, int64_t block,
                       Q8Rows out) {
  const int64_t elem = dtype == DType::BF16 ? 2 : 4, pairs = cols / 64, block_pairs = block / 64;
  for (int64_t i = 0; i < m; ++i) {
    const char* row = static_cast<const char*>(x) + i * row_stride * elem;
    for (int64_t b = 0; b < cols / block; ++b) {
      __m512 amax = _mm512_setzero_ps();
      for (int64_t q = b * block_pairs; q < (b + 1) * block_pairs; ++q) {
        __m512 v[4];
        load64(dtype, row + q * 64 * elem, v);
        for (int j = 0; j < 4; ++j) amax = _mm512_max_ps(amax, _mm512_abs_ps(v[j]));
      }
      const float top = _mm512_reduce_max_ps(amax);
      // x = s * q with |q| <= 127: q = round(x * (127 / max|x|)), ties to even (the default rounding).
      const __m512 inverse = _mm512_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
      out.scales[i * out.groups + b] = top / 127.0f;
      for (int64_t q = b * block_pairs; q < (b + 1) * block_pairs; ++q) {
        __m512 v[4];
        load64(dtype, row + q * 64 * elem, v);
        __m512i all = _mm512_setzero_si512();
        for (int j = 0; j < 4; ++j) {
          const __m128i bytes = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v[j], inverse)));
          all = _mm512_mask_broadcast_i32x4(all, static_cast<__mmask16>(0xf << (4 * j)), bytes);
        }
        _mm512_storeu_si512(out.values + i * cols + 64 * q, all);
      }
    }
  }
}

namespace {

// Every row of every pair of blocks block_begin..block_end, in the layout's order, as the pair decoder gives its
// 64 weights (u = 2 * code where kept, 15 elsewhere; Asym: code where kept, the row's zero point elsewhere):
// emit(row, q, r, b, u) for row r of block b (row, counted from block_begin's first row) and pair q. The padding
// rows of a last block are decoded (their codes are read in turn) but not emitted.
template <bool Asym, typename Emit>
void for_each_pair_row(const Q4PairProblem& p, int64_t block_begin, int64_t block_end, const Emit& emit) {
  const PairDecoder<Asym> dec;
  const int64_t pairs = p.cols / 64;
  for (int64_t b = block_begin; b < block_end; ++b) {
    const uint64_t* masks = p.masks == nullptr ? nullptr : p.masks + b * pairs * kPairRows;
    const uint8_t* c = p.codes + p.block_offsets[b];
    const int64_t row0 = b * kPairRows, real = std::min<int64_t>(kPairRows, p.rows - row0);
    for (int64_t q = 0; q < pairs; ++q) {
      const uint8_t* at[2];
      if (masks == nullptr) {
        PairDecoder<Asym>::template starts<true>(c, at);
      } else {
        PairDecoder<Asym>::template starts<false>(c, at);
      }
      for (int rp = 0; rp < kPairRows / 2; ++rp) {
        __m512i u[2], zero[2] = {dec.fifteen, dec.fifteen};
        if constexpr (Asym) zero_points(p.zeros + (b * p.groups + q / p.group_pairs) * kPairRows, rp, zero);
        if (masks == nullptr) {
          dec.template rows<true>(at[rp], masks, q, rp, u, zero[0], zero[1]);
        } else {
          dec.template rows<false>(at[rp], masks, q, rp, u, zero[0], zero[1]);
        }
        for (int h = 0; h < 2; ++h) {
          const int r = 2 * rp + h;
          if (r < real) emit(row0 + r - kPairRows * block_begin, q, r, b, u[h]);
        }
      }
    }
  }
}

}  // namespace

namespace {

template <bool Asym>
void decode_blocks(const Q4PairProblem& p, int64_t block_begin, int64_t block_end, float* out, int64_t out_stride) {
  const __m512i fifteen = _mm512_set1_epi8(15);
  for_each_pair_row<Asym>(p, block_begin, block_end, [&](int64_t row, int64_t q, int r, int64_t b, __m512i u) {
    const int64_t at = (b * p.groups + q / p.group_pairs) * kPairRows + r;
    // The levels, 0 where pruned: 2 * code - 15, or (Asym) code - zero.
    const __m512i w = _mm512_sub_epi8(u, Asym ? _mm512_set1_epi8(static_cast<char>(p.zeros[at])) : fifteen);
    // s * (code - 7.5) = (0.5 s) * (2 code - 15), s * (code - zero): exact in fp32 (an fp16 times a small integer).
    const __m512 s = _mm512_set1_ps((Asym ? 1.0f : 0.5f) * _cvtsh_ss(p.scales[at]));
    float* dst = out + row * out_stride + 64 * q;
    _mm512_storeu_ps(dst, _mm512_mul_ps(s, quarter<0>(w)));
    _mm512_storeu_ps(dst + 16, _mm512_mul_ps(s, quarter<1>(w)));
    _mm512_storeu_ps(dst + 32, _mm512_mul_ps(s, quarter<2>(w)));
    _mm512_storeu_ps(dst + 48, _mm512_mul_ps(s, quarter<3>(w)));
  });
}

}  // namespace

void q4_pairs_decode_blocks_avx512(const Q4PairProblem& p, int64_t block_begin, int64_t block_end, float* out,
                                   int64_t out_stride) {
  if (p.zeros != nullptr) return decode_blocks<true>(p, block_begin, block_end, out, out_stride);
  decode_blocks<false>(p, block_begin, block_end, out, out_stride);
}

// Prefill with bf16 x: q4_pairs_decode_blocks_avx512's exact fp32 values rounded once to bf16 (round to nearest
// even as ATen's conversion), so that the GEMM reads a bf16 tile without a separate conversion pass. Per row and
// pair a 32-word table: word 2c = bf16(s * (c - 7.5)) (the exact fp32 product, vcvtneps2bf16; it reads
// denormals as zero and none occur), odd words +0 (a pruned weight: 0 * s, the format refuses negative s); the pair
// decoder's bytes (2 * code where kept, 15 elsewhere) widened to words index it with vpermw. Measured (the op with
// its GEMMs skipped, Llama-3.2-1B's shapes, 50%, M = 400, 1 thread) against converting each weight's fp32
// product (per row and pair 4 x widen, convert, multiply, then 2 x vcvtne2ps2bf16): gate_up 16384x2048 1.84 to
// 1.39 ms, down 2048x8192 1.06 to 0.76, o 2048x2048 0.28 to 0.20.
// Asym: word c = bf16(s * (c - zero)) for the 16 codes, indexed by u (the code, or the zero point where pruned: 0).
namespace {

template <bool Asym>
void decode_blocks_bf16(const Q4PairProblem& p, int64_t block_begin, int64_t block_end, uint16_t* out,
                        int64_t out_stride) {
  const __m512 levels = Asym ? _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)
                             : _mm512_set_ps(7.5f, 6.5f, 5.5f, 4.5f, 3.5f, 2.5f, 1.5f, 0.5f, -0.5f, -1.5f, -2.5f,
                                             -3.5f, -4.5f, -5.5f, -6.5f, -7.5f);
  for_each_pair_row<Asym>(p, block_begin, block_end, [&](int64_t row, int64_t q, int r, int64_t b, __m512i u) {
    const int64_t at = (b * p.groups + q / p.group_pairs) * kPairRows + r;
    const __m512 s = _mm512_cvtph_ps(_mm256_set1_epi16(static_cast<short>(p.scales[at])));
    __m512i table;
    if constexpr (Asym) {
      const __m512 level = _mm512_sub_ps(levels, _mm512_set1_ps(static_cast<float>(p.zeros[at])));
      table = _mm512_zextsi256_si512((__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s, level)));
    } else {
      table = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s, levels)));
    }
    uint16_t* dst = out + row * out_stride + 64 * q;
    const __m512i lo = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(u));
    const __m512i hi = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(u, 1));
    _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(lo, table));
    _mm512_storeu_si512(dst + 32, _mm512_permutexvar_epi16(hi, table));
  });
}

}  // namespace

void q4_pairs_decode_blocks_bf16_avx512(const Q4PairProblem& p, int64_t block_begin, int64_t block_end,
                                        uint16_t* out, int64_t out_stride) {
  if (p.zeros != nullptr) return decode_blocks_bf16<true>(p, block_begin, block_end, out, out_stride);
  decode_blocks_bf16<false>(p, block_begin, block_end, out, out_stride);
}


// ---- prefill with int8 x ----

void q8_group_starts_avx512(const Q8Rows& q8, int64_t m, int64_t cols, int32_t* starts, bool asym) {
  const __m512i fifteen = _mm512_set1_epi8(asym ? 1 : 15);
  const int64_t block = cols / q8.groups;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t g = 0; g < q8.groups; ++g) {
      __m512i sum = _mm512_setzero_si512();
      for (int64_t c = g * block; c < (g + 1) * block; c += 64) {
        sum = _mm512_dpbusd_epi32(sum, fifteen, _mm512_loadu_si512(q8.values + i * cols + c));
      }
      starts[i * q8.groups + g] = -_mm512_reduce_add_epi32(sum);
    }
  }
}

namespace {

// out[j] = dword j of each of r[0..15] (lane i from r[i]): a 16 x 16 transpose of dwords.
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // u[4a + c], 128-bit lane L: rows 4a .. 4a + 3 at dword 4L + c.
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88),
                  w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
    r[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(v0, w0, 0xdd);
    r[4 + c] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, w1, 0xdd);
  }
}

constexpr int kPanelNB = kPrefillPanelRows / 16;  // registers of 16 rows per panel
// Software prefetch of each block's codes and masks this many bytes ahead while a panel is decoded.
constexpr int64_t kPanelPrefetch = 512;

// Panel `panel`'s rows (16 NB of them) into w: for 4-column quad t of a row and register nb of the panel (rows
// 16 nb .. 16 nb + 15), 64 bytes at w + (t * NB + nb) * 64, lane i the 4 bytes of row 16 nb + i (level + 15, as
// the pair decoder gives them); rows past the last block 15s. sw[(g * NB + nb) * 16 + i]: 0.5 * the row's scale
// of group g (0 for padded rows). Asym: lanes of code where kept, the zero point elsewhere (rows past the last block
// 0s), sw s_w without the 0.5, and sz[(g * NB + nb) * 16 + i] the row's zero point (0 for padded rows).
template <int NB, bool Dense, bool Asym>
void decode_panel(const Q4PairProblem& p, int64_t panel, uint8_t* w, float* sw, int32_t* sz) {
  constexpr int BPP = 16 * NB / kPairRows;
  const PairDecoder<Asym> dec;
  const int64_t blocks = (p.rows + kPairRows - 1) / kPairRows, b0 = panel * BPP;
  const int n = static_cast<int>(std::min<int64_t>(BPP, blocks - b0));
  const int64_t pairs = p.cols / 64, groups = p.groups;
  const uint8_t* c[BPP];
  const uint64_t* masks[BPP];
  for (int i = 0; i < n; ++i) {
    c[i] = p.codes + p.block_offsets[b0 + i];
    masks[i] = Dense ? nullptr : p.masks + (b0 + i) * pairs * kPairRows;
  }
  for (int64_t q = 0; q < pairs; ++q) {
    if constexpr (kPanelPrefetch > 0) {
      for (int i = 0; i < n; ++i) {
        _mm_prefetch(reinterpret_cast<const char*>(c[i]) + kPanelPrefetch, _MM_HINT_T0);
        if constexpr (!Dense) _mm_prefetch(reinterpret_cast<const char*>(masks[i] + q * kPairRows) + kPanelPrefetch, _MM_HINT_T0);
      }
    }
    for (int nb = 0; nb < NB; ++nb) {
      __m512i r[16];
      for (int i = 0; i < 4; ++i) {
        const int blk = 4 * nb + i;
        if (blk >= n) {
          for (int rr = 0; rr < kPairRows; ++rr) r[4 * i + rr] = Asym ? _mm512_setzero_si512() : dec.fifteen;
          continue;
        }
        const uint8_t* at[2];
        PairDecoder<Asym>::template starts<Dense>(c[blk], at);
        for (int rp = 0; rp < kPairRows / 2; ++rp) {
          if constexpr (Asym) {
            __m512i zero[2];
            zero_points(p.zeros + ((b0 + blk) * groups + q / p.group_pairs) * kPairRows, rp, zero);
            dec.template rows<Dense>(at[rp], masks[blk], q, rp, &r[4 * i + 2 * rp], zero[0], zero[1]);
          } else {
            dec.template rows<Dense>(at[rp], masks[blk], q, rp, &r[4 * i + 2 * rp]);
          }
        }
      }
      transpose16(r);
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(w + ((16 * q + j) * NB + nb) * 64, r[j]);
    }
  }
  // Block blk's scales of groups g .. g + 3 are 16 consecutive fp16 ([groups, 4] per block).
  const __m512 half = _mm512_set1_ps(0.5f);
  for (int blk = 0; blk < BPP; ++blk) {
    const uint16_t* from = p.scales + (b0 + blk) * groups * kPairRows;
    for (int64_t g = 0; g < groups; g += 4) {
      const __mmask16 valid = groups - g >= 4 ? 0xffff : static_cast<__mmask16>((1u << (4 * (groups - g))) - 1);
      const __m512 scale = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(valid, from + g * kPairRows));
      const __m512 v = blk < n ? (Asym ? scale : _mm512_mul_ps(half, scale)) : _mm512_setzero_ps();
      float* to = sw + g * 16 * NB + kPairRows * blk;
      _mm_storeu_ps(to, _mm512_castps512_ps128(v));
      if (g + 1 < groups) _mm_storeu_ps(to + 16 * NB, _mm512_extractf32x4_ps(v, 1));
      if (g + 2 < groups) _mm_storeu_ps(to + 32 * NB, _mm512_extractf32x4_ps(v, 2));
      if (g + 3 < groups) _mm_storeu_ps(to + 48 * NB, _mm512_extractf32x4_ps(v, 3));
      if constexpr (Asym) {
        const __m512i z = blk < n ? _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(
                                        valid, p.zeros + (b0 + blk) * groups * kPairRows + g * kPairRows))
                                  : _mm512_setzero_si512();
        int32_t* zto = sz + g * 16 * NB + kPairRows * blk;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(zto), _mm512_castsi512_si128(z));
        if (g + 1 < groups) _mm_storeu_si128(reinterpret_cast<__m128i*>(zto + 16 * NB), _mm512_extracti32x4_epi32(z, 1));
        if (g + 2 < groups) _mm_storeu_si128(reinterpret_cast<__m128i*>(zto + 32 * NB), _mm512_extracti32x4_epi32(z, 2));
        if (g + 3 < groups) _mm_storeu_si128(reinterpret_cast<__m128i*>(zto + 48 * NB), _mm512_extracti32x4_epi32(z, 3));
      }
    }
  }
}

// y[m0 .. m0 + MR, row0 .. row0 + 16 NB) from a decoded panel: per group, each (x row, register) pair's integer
// dot over the group's quads starts at -15 * the group's sum of q and adds (level + 15) * q with vpdpbusd (x's 4
// bytes of the quad broadcast), then is folded into the fp32 sum with (0.5 s_w) * s_x, as the decoding kernel
// folds its terms. GQ: quads per group (0: read at run time); the quad loop is unrolled (without it GCC rotated
// the accumulators through register copies, two dozen per iteration: 0.61 against 0.58 of the tiles' time).
// Asym: each dot starts at -(the group's sum of q) * the row's zero point (`starts` then hold -sum q; the lanes
// of code or zero point, sw without the 0.5), so that it ends at the kept columns' (code - zero) * q.
template <int NB, int MR, int GQ, bool Asym>
void prefill_micro(const Q4PairProblem& p, const int32_t* starts, const uint8_t* w, const float* sw,
                   const int32_t* sz, int64_t m0, int64_t row0) {
  const int64_t cols = p.cols, groups = p.groups, gq = GQ > 0 ? GQ : 16 * p.group_pairs;
  const int8_t* x = p.x_values + m0 * cols;
  __m512 acc[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int nb = 0; nb < NB; ++nb) acc[m][nb] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dot[MR][NB];
    for (int m = 0; m < MR; ++m) {
      const __m512i s = _mm512_set1_epi32(starts[(m0 + m) * groups + g]);
      for (int nb = 0; nb < NB; ++nb) {
        dot[m][nb] = Asym ? _mm512_mullo_epi32(s, _mm512_loadu_si512(sz + (g * NB + nb) * 16)) : s;
      }
    }
    const uint8_t* wg = w + g * gq * NB * 64;
    const int8_t* xg = x + g * gq * 4;
#pragma GCC unroll 16
    for (int64_t t = 0; t < gq; ++t) {
      __m512i wv[NB];
      for (int nb = 0; nb < NB; ++nb) wv[nb] = _mm512_loadu_si512(wg + (t * NB + nb) * 64);
      for (int m = 0; m < MR; ++m) {
        int32_t quad;
        std::memcpy(&quad, xg + m * cols + 4 * t, 4);
        const __m512i xb = _mm512_set1_epi32(quad);
        for (int nb = 0; nb < NB; ++nb) dot[m][nb] = _mm512_dpbusd_epi32(dot[m][nb], wv[nb], xb);
      }
    }
    for (int nb = 0; nb < NB; ++nb) {
      const __m512 s = _mm512_loadu_ps(sw + (g * NB + nb) * 16);
      for (int m = 0; m < MR; ++m) {
        const __m512 scale = _mm512_mul_ps(s, _mm512_set1_ps(p.x_scales[(m0 + m) * groups + g]));
        acc[m][nb] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][nb]), scale, acc[m][nb]);
      }
    }
  }
  for (int nb = 0; nb < NB; ++nb) {
    const int64_t first = row0 + 16 * nb;
    if (first >= p.rows) break;
    const __mmask16 keep = p.rows - first >= 16 ? 0xffff : static_cast<__mmask16>((1u << (p.rows - first)) - 1);
    const __m512 bias = p.bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(keep, p.bias + first);
    for (int m = 0; m < MR; ++m) {
      const __m512 v = _mm512_add_ps(acc[m][nb], bias);
      const int64_t at = (m0 + m) * p.y_stride + first;
      if (p.dtype == DType::BF16) {
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.y) + at, keep, (__m256i)_mm512_cvtneps_pbh(v));
      } else {
        _mm512_mask_storeu_ps(static_cast<float*>(p.y) + at, keep, v);
      }
    }
  }
}

constexpr int kPrefillMR = 6;  // rows of x per micro-kernel call: 12 int32 and 12 fp32 accumulators
static_assert(kPrefillPanelRows == 16 * kPanelNB);

// Panels panel_begin..panel_end: each decoded once (into buffers of this thread), then multiplied with every
// kPrefillMR rows of x in turn.
template <int GQ, bool Dense, bool Asym>
void prefill_panels(const Q4PairProblem& p, const int32_t* starts, int64_t panel_begin, int64_t panel_end) {
  constexpr int NB = kPanelNB, MR = kPrefillMR;
  using Fn = void (*)(const Q4PairProblem&, const int32_t*, const uint8_t*, const float*, const int32_t*, int64_t,
                      int64_t);
  static constexpr Fn kTails[MR - 1] = {&prefill_micro<NB, 1, GQ, Asym>, &prefill_micro<NB, 2, GQ, Asym>,
                                        &prefill_micro<NB, 3, GQ, Asym>, &prefill_micro<NB, 4, GQ, Asym>,
                                        &prefill_micro<NB, 5, GQ, Asym>};
  uint8_t* w = static_cast<uint8_t*>(std::aligned_alloc(64, kPrefillPanelRows * p.cols));
  float* sw = static_cast<float*>(std::aligned_alloc(64, p.groups * kPrefillPanelRows * 4));
  int32_t* sz = Asym ? static_cast<int32_t*>(std::aligned_alloc(64, p.groups * kPrefillPanelRows * 4)) : nullptr;
  constexpr int64_t BPP = kPrefillPanelRows / kPairRows;
  const int64_t blocks = (p.rows + kPairRows - 1) / kPairRows, calls = (p.m + MR - 1) / MR;
  for (int64_t panel = panel_begin; panel < panel_end; ++panel) {
    decode_panel<NB, Dense, Asym>(p, panel, w, sw, sz);
    const int64_t row0 = panel * kPrefillPanelRows;
    // The next panel's codes and masks (each a contiguous range: its blocks follow each other), fetched into L2
    // a share at a time between this panel's micro-kernel calls (the last block's codes: a line past its start;
    // a prefetch past the tensor's end is harmless). Cold weights (qkv 3072 x 2048 rotated through 300 MB, 1
    // thread, processes alternated, 3 each): M = 9 0.47-0.48 -> 0.43-0.44 ms, 16 0.57-0.58 -> 0.52, 64 1.25-1.28
    // -> 1.13-1.15, 400 6.05-6.32 -> 5.97-6.05.
    const char *code_at = nullptr, *mask_at = nullptr;
    int64_t code_step = 0, mask_step = 0;
    if (panel + 1 < panel_end) {
      const int64_t b = (panel + 1) * BPP, e = std::min(blocks, b + BPP);
      code_at = reinterpret_cast<const char*>(p.codes + p.block_offsets[b]);
      const int64_t code_bytes = (e < blocks ? p.block_offsets[e] : p.block_offsets[blocks - 1] + 64) -
                                 p.block_offsets[b];
      code_step = (code_bytes / 64 + calls) / calls;
      if (!Dense) {
        mask_at = reinterpret_cast<const char*>(p.masks + b * (p.cols / 64) * kPairRows);
        mask_step = ((e - b) * (p.cols / 64) * kPairRows * 8 / 64 + calls) / calls;
      }
    }
    const auto fetch = [&]() {
      for (int64_t i = 0; i < code_step; ++i, code_at += 64) _mm_prefetch(code_at, _MM_HINT_T1);
      for (int64_t i = 0; i < mask_step; ++i, mask_at += 64) _mm_prefetch(mask_at, _MM_HINT_T1);
    };
    int64_t m0 = 0;
    for (; m0 + MR <= p.m; m0 += MR) {
      fetch();
      prefill_micro<NB, MR, GQ, Asym>(p, starts, w, sw, sz, m0, row0);
    }
    if (m0 < p.m) {
      fetch();
      kTails[p.m - m0 - 1](p, starts, w, sw, sz, m0, row0);
    }
  }
  std::free(sz);
  std::free(sw);
  std::free(w);
}

}  // namespace

void q4_pairs_prefill_panels_avx512(const Q4PairProblem& p, const int32_t* starts, int64_t panel_begin,
                                    int64_t panel_end) {
  const bool dense = p.masks == nullptr;
  if (p.zeros != nullptr) {
    if (p.group_pairs == 1) return dense ? prefill_panels<16, true, true>(p, starts, panel_begin, panel_end)
                                         : prefill_panels<16, false, true>(p, starts, panel_begin, panel_end);
    return dense ? prefill_panels<0, true, true>(p, starts, panel_begin, panel_end)
                 : prefill_panels<0, false, true>(p, starts, panel_begin, panel_end);
  }
  if (p.group_pairs == 1) return dense ? prefill_panels<16, true, false>(p, starts, panel_begin, panel_end)
                                       : prefill_panels<16, false, false>(p, starts, panel_begin, panel_end);
  dense ? prefill_panels<0, true, false>(p, starts, panel_begin, panel_end)
        : prefill_panels<0, false, false>(p, starts, panel_begin, panel_end);
}

}  // namespace leap_sparse

#pragma GCC pop_options
