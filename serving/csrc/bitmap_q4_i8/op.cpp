// The torch ops of bitmap-q4 weights with int8 x (the plugin's `activations=int8`):
//   leap_sparse_cpu::bitmap_q4_i8_available() -> whether this CPU and the chosen ISA run them
//   leap_sparse_cpu::bitmap_q4_pack_pairs(bitmap, codes, scales, row_offsets, n_cols, zeros=None,
//                                         pruned_at_zero=False, checked=False)
//       -> (masks, codes, block_offsets, scales, zeros): the pair layout (bitmap_q4/kernels.h) of a checked
//          bitmap-q4 weight, made once at load; zeros (the asymmetric grid's zero points as stored, uint8 [rows,
//          (groups + 1) / 2], two to a byte) become one byte per row and group in the scales' order, or an empty
//          tensor (the symmetric grid) where none are given. pruned_at_zero (the asymmetric grid only): the dense
//          layout, every column a code, a pruned one its group's zero point (the value 0): for CPUs without a
//          byte expand, where reading those codes costs less than placing the kept ones (bitmap_q4_i8/avx2.cpp).
//          Unless `checked` (a weight checked at load), the row offsets are checked first (common/offset_checks.h)
//   leap_sparse_cpu::bitmap_q4_i8_linear(x, masks, codes, block_offsets, scales, n_rows, n_cols, bias=None,
//                                        zeros=None, checked=False)
//       -> y = x W^T + b from the pair layout (zeros: pack_pairs' zeros, None or empty for the symmetric grid):
//          x is quantized to int8 per row and weight group (scale max|x| /
//          127) and multiplied in integers: up to kPairMaxM rows (decoding steps) straight from the layout,
//          more (prefill) by a GEMM on panels of W decoded for it (bitmap_q4_i8/avx512.cpp's header: 0.57x the
//          time of the tiles below at 400 rows of Llama-3.2-1B's layer, 0.60x vLLM's oneDNN bf16 linear).
//          Unless `checked` (a layout pack_pairs made from a checked weight, as the vLLM layer's), the block
//          offsets and pass headers are checked against the masks first (common/offset_checks.h)
//   leap_sparse_cpu::bitmap_q4_i8_prefill(mode="") -> "int8" (the default) or "tiles": how the op multiplies
//          more than kPairMaxM rows; "tiles" multiplies x as it is with exact decoded tiles of W and ATen's GEMM
//          (for bf16 x decoded straight to bf16: each exact value rounded once), as bitmap_q4_linear does. Set
//          for the whole process (benchmarks and tests); "" only asks. The AVX2 kernels have no prefill kernel:
//          their "int8" prefill is the decoding kernel, kPairChunkM rows of x at a time.
// A fragment of the leap_sparse_cpu library (common/isa.cpp), using its isa()/set_isa() choice.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "bitmap_q4/kernels.h"
#include "common/offset_checks.h"
#include "common/op_common.h"

namespace leap_sparse {
namespace {

// Prefill (above kPairMaxM rows of x): int8 x (true) or exact decoded tiles and ATen's GEMM, x as it is.
// Measured at M = 400 (bench/prefill_q4.py): the int8 kernel 0.57-0.59x the tiles' time per layer.
std::atomic<bool> g_prefill_int8{true};

// x as int8 (Q8Rows) and its group sums for one call. A decoding step (at most kPairMaxM rows) uses buffers
// each thread keeps between calls: a step calls the op once per linear (~120 times on SmolLM2-135M), and three
// at::empty a call were ~0.4 ms of a 16-20 ms step on a Zen 3 EPYC (vLLM's profiler: 526 at::empty a step,
// 366 of them this op's). A prefill's x gets tensors of its own, freed with the call.
struct Int8X {
  Q8Rows q8;
  int32_t* starts;     // [m, groups]
  at::Tensor held[3];  // a prefill's storage

  Int8X(int64_t m, int64_t cols, int64_t groups, const at::TensorOptions& options) {
    if (m <= kPairMaxM) {
      thread_local std::vector<int8_t> values;
      thread_local std::vector<float> scales;
      thread_local std::vector<int32_t> sums;
      if (static_cast<int64_t>(values.size()) < m * cols) values.resize(m * cols);
      if (static_cast<int64_t>(scales.size()) < m * groups) {
        scales.resize(m * groups);
        sums.resize(m * groups);
      }
      q8 = Q8Rows{values.data(), scales.data(), groups};
      starts = sums.data();
      return;
    }
    held[0] = at::empty({m, cols}, options.dtype(at::kChar));
    held[1] = at::empty({m, groups}, options.dtype(at::kFloat));
    held[2] = at::empty({m, groups}, options.dtype(at::kInt));
    q8 = Q8Rows{held[0].data_ptr<int8_t>(), held[1].data_ptr<float>(), groups};
    starts = held[2].data_ptr<int32_t>();
  }
};

std::string prefill_op(std::string mode) {
  TORCH_CHECK(mode.empty() || mode == "int8" || mode == "tiles",
              "leap_sparse_cpu::bitmap_q4_i8_prefill: use \"int8\" or \"tiles\", not ", mode);
  if (!mode.empty()) g_prefill_int8.store(mode == "int8");
  return g_prefill_int8.load() ? "int8" : "tiles";
}

// The AVX-512 kernels need VNNI, VBMI2 and GFNI beside the avx512 ISA's set; the AVX2 ones only what the avx2
// ISA already requires (AVX2, FMA, F16C, POPCNT, BMI2).
bool avx512_i8() {
  static const bool cpu =
      __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("gfni");
  return cpu && chosen_isa() == "avx512";
}

bool i8_available() { return avx512_i8() || chosen_isa() == "avx2"; }

uint64_t pair_mask(const uint8_t* row, int64_t pair) {
  uint64_t word;
  std::memcpy(&word, row + 8 * pair, 8);
  return word;
}

// Puts one row's codes of pair q, from the stored layout (each 32-column word's codes from a byte, `codes` at
// the pair's first word), in the low (nibble 0) or high (nibble 1) nibbles of the pair layout's bytes at `out`,
// its k-th kept code in byte k; with a `fill` (0..15) every column's, a pruned one's the fill, in byte c.
void pack_pair(uint64_t mask, const uint8_t* codes, int nibble, uint8_t* out, int fill = -1) {
  int64_t t = 0;  // byte of the pair layout
  for (int half = 0; half < 2; ++half) {
    const uint32_t word = static_cast<uint32_t>(mask >> (32 * half));
    for (int c = 0, k = 0; c < 32; ++c) {
      const bool kept = (word >> c) & 1;
      if (!kept && fill < 0) continue;
      const uint8_t code = kept ? (codes[k / 2] >> (4 * (k % 2))) & 0xf : static_cast<uint8_t>(fill);
      out[t++] |= static_cast<uint8_t>(code << (4 * nibble));
      k += kept;
    }
    codes += (__builtin_popcount(word) + 1) / 2;
  }
}

// ---- the pair layout's offset checks (common/offset_checks.h's machinery) ----

// The code bytes of two rows of a block at one pair of the pair layout: the longer row's count.
LEAP_ALWAYS_INLINE int64_t row_pair_bytes(uint64_t first, uint64_t second) {
  return std::max(__builtin_popcountll(first), __builtin_popcountll(second));
}

// Bytes of codes of block `b` of the pair layout (`masks`: nullptr for the dense one).
LEAP_ALWAYS_INLINE int64_t block_code_bytes(const uint64_t* masks, int64_t b, int64_t pairs) {
  if (masks == nullptr) return pairs * 2 * 64;
  int64_t bytes = 0;
  for (int64_t q = 0; q < pairs; ++q) {
    const uint64_t* m = masks + (b * pairs + q) * kPairRows;
    bytes += kPairHeader + row_pair_bytes(m[0], m[1]) + row_pair_bytes(m[2], m[3]);
  }
  return bytes;
}

// The bytes of each block, by its masks, for the checks.
struct BlockCodeBytes {  // the pair layout: the bytes of a block of kPairRows rows and `pairs` pairs
  const uint64_t* masks;
  int64_t pairs;
  LEAP_ALWAYS_INLINE int64_t operator()(int64_t b) const { return block_code_bytes(masks, b, pairs); }
};

constexpr Names kPairNames{"block_offsets", "block", "the masks put", "the masks need", "code byte",
                           "codes (less its padding)",
                           "make the layout with bitmap_q4_pack_pairs; checked=True only for one it made from a "
                           "checked weight"};

// The pair layout: block_offsets into `codes` (its last kPairPad bytes the padding), each block's bytes by its
// masks; then every pass header (sparse layout) against the masks, read only once the offsets are known good.
inline void check_pair_offsets(const char* op, const uint64_t* masks, const uint8_t* codes, int64_t n_codes,
                               const int64_t* block_offsets, int64_t blocks, int64_t pairs) {
  const Extents<int64_t, BlockCodeBytes> e{block_offsets, blocks, n_codes - kPairPad, BlockCodeBytes{masks, pairs}};
  check_extents(op, e, check_grain(64 * kPairRows * pairs), kPairNames);
  if (masks == nullptr) return;
  std::atomic<int64_t> bad{blocks * pairs};
  at::parallel_for(0, blocks, check_grain(64 * kPairRows * pairs), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* c = codes + block_offsets[b];
      for (int64_t q = 0; q < pairs; ++q) {
        const uint64_t* m = masks + (b * pairs + q) * kPairRows;
        const int64_t first = row_pair_bytes(m[0], m[1]), both = first + row_pair_bytes(m[2], m[3]);
        if (c[0] != first || c[1] != both) {
          int64_t seen = bad.load();
          while (b * pairs + q < seen && !bad.compare_exchange_weak(seen, b * pairs + q)) {
          }
          return;
        }
        c += kPairHeader + both;
      }
    }
  });
  const int64_t at = bad.load();
  TORCH_CHECK(at == blocks * pairs, op, ": the header of block ", at / pairs, ", pair ", at % pairs,
              " in codes does not match the masks (", kPairNames.hint, ")");
}

// The argument checks of bitmap_q4_pack_pairs.
void check_pack_args(const char* kOp, const at::Tensor& bitmap, const at::Tensor& codes, const at::Tensor& scales,
                     const at::Tensor& row_offsets, int64_t n_cols, const std::optional<at::Tensor>& zeros,
                     bool pruned_at_zero) {
  TORCH_CHECK(n_cols > 0 && n_cols % 64 == 0, kOp, ": n_cols must be a positive multiple of 64, got ", n_cols);
  TORCH_CHECK(bitmap.device().is_cpu() && codes.device().is_cpu() && row_offsets.device().is_cpu() &&
                  bitmap.scalar_type() == at::kByte && bitmap.dim() == 2 && bitmap.size(1) == n_cols / 8 &&
                  codes.scalar_type() == at::kByte && row_offsets.scalar_type() == at::kInt &&
                  row_offsets.numel() == bitmap.size(0) && scales.device().is_cpu() &&
                  scales.scalar_type() == at::kHalf && scales.dim() == 2 && scales.size(0) == bitmap.size(0) &&
                  scales.size(1) > 0 && n_cols % scales.size(1) == 0 && (n_cols / scales.size(1)) % 64 == 0,
              kOp, " takes the CPU tensors of a checked bitmap-q4 weight (uint8 bitmap [rows, n_cols / 8], uint8 "
              "codes, float16 scales [rows, groups] of a multiple of 64 columns, int32 row_offsets [rows])");
  TORCH_CHECK(!zeros.has_value() ||
                  (zeros->device().is_cpu() && zeros->scalar_type() == at::kByte && zeros->dim() == 2 &&
                   zeros->size(0) == bitmap.size(0) && zeros->size(1) == (scales.size(1) + 1) / 2),
              kOp, ": zeros must be a CPU uint8 tensor [rows, (groups + 1) / 2] = [", bitmap.size(0), ", ",
              (scales.size(1) + 1) / 2, "] (two 4-bit zero points a byte), got ",
              zeros.has_value() ? zeros->scalar_type() : at::kByte, " ",
              zeros.has_value() ? zeros->sizes() : at::IntArrayRef{});
  TORCH_CHECK(!pruned_at_zero || zeros.has_value(), kOp,
              ": pruned_at_zero needs the asymmetric grid's zeros (the symmetric grid has no level 0)");
}

// Each block's 64-bit masks per pair and row ([blocks, pairs, kPairRows]), the padding rows' 0.
void pair_masks(const uint8_t* bit_data, int64_t rows, int64_t n_cols, uint64_t* mask_data) {
  const int64_t pairs = n_cols / 64, blocks = (rows + kPairRows - 1) / kPairRows;
  const auto mask_of = [&](int64_t row, int64_t q) -> uint64_t {
    return row < rows ? pair_mask(bit_data + row * (n_cols / 8), q) : 0;
  };
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t q = 0; q < pairs; ++q) {
      for (int64_t r = 0; r < kPairRows; ++r) mask_data[(b * pairs + q) * kPairRows + r] = mask_of(b * kPairRows + r, q);
    }
  }
}

// Each block's first code byte (block_offset[b]); returns the bytes of all blocks. `dense`: no masks or headers.
int64_t pair_block_offsets(const uint64_t* mask_data, int64_t blocks, int64_t pairs, bool dense,
                           int64_t* block_offset) {
  const int64_t header = dense ? 0 : kPairHeader;
  int64_t total = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    block_offset[b] = total;
    for (int64_t q = 0; q < pairs; ++q) {
      const uint64_t* m = mask_data + (b * pairs + q) * kPairRows;
      total += dense ? 2 * 64 : header + row_pair_bytes(m[0], m[1]) + row_pair_bytes(m[2], m[3]);
    }
  }
  return total;
}

// The scales in the pair layout's order: [blocks, groups, kPairRows], padded rows 0.
at::Tensor pair_scales(const at::Tensor& scales, int64_t blocks) {
  const int64_t rows = scales.size(0), groups = scales.size(1);
  const at::Tensor scale = scales.contiguous();
  at::Tensor block_scales = at::zeros({blocks, groups, kPairRows}, scale.options());
  block_scales.narrow(0, 0, rows / kPairRows)
      .copy_(scale.narrow(0, 0, rows / kPairRows * kPairRows).view({rows / kPairRows, kPairRows, groups}).transpose(1, 2));
  for (int64_t row = rows / kPairRows * kPairRows; row < rows; ++row) {
    block_scales.select(0, blocks - 1).select(1, row % kPairRows).copy_(scale.select(0, row));
  }
  return block_scales;
}

// The zero points, one byte each in the scales' order: [blocks, groups, kPairRows], padded rows 0 (empty
// without zeros).
at::Tensor pair_zeros(const std::optional<at::Tensor>& zeros, int64_t rows, int64_t blocks, int64_t groups,
                      const at::TensorOptions& options) {
  at::Tensor block_zeros = at::zeros({zeros.has_value() ? blocks : 0, groups, kPairRows}, options);
  if (zeros.has_value()) {
    const at::Tensor stored_zeros = zeros->contiguous();
    const auto zero_of = [&](int64_t row, int64_t g) {  // as stored: group g of a row in byte g / 2
      const uint8_t* z = stored_zeros.data_ptr<uint8_t>() + row * stored_zeros.size(1);
      return (z[g / 2] >> (4 * (g % 2))) & 0xf;
    };
    uint8_t* zout = block_zeros.data_ptr<uint8_t>();
    for (int64_t row = 0; row < rows; ++row) {
      for (int64_t g = 0; g < groups; ++g) {
        zout[((row / kPairRows) * groups + g) * kPairRows + row % kPairRows] = static_cast<uint8_t>(zero_of(row, g));
      }
    }
  }
  return block_zeros;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bitmap_q4_pack_pairs(
    const at::Tensor& bitmap, const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& row_offsets,
    int64_t n_cols, const std::optional<at::Tensor>& zeros, bool pruned_at_zero, bool checked) {
  constexpr const char* kOp = "leap_sparse_cpu::bitmap_q4_pack_pairs";
  check_pack_args(kOp, bitmap, codes, scales, row_offsets, n_cols, zeros, pruned_at_zero);
  const at::Tensor bits = bitmap.contiguous(), code = codes.contiguous(), offsets = row_offsets.contiguous();
  const int64_t rows = bits.size(0), pairs = n_cols / 64, blocks = (rows + kPairRows - 1) / kPairRows;
  const uint8_t* bit_data = bits.data_ptr<uint8_t>();
  // Each row's codes are read from its offset on: unless `checked`, the offsets must agree with the bitmap.
  if (!checked) check_q4_offsets(kOp, bit_data, n_cols, offsets.data_ptr<int32_t>(), rows, code.numel());
  at::Tensor block_offsets = at::empty({blocks}, offsets.options().dtype(at::kLong));
  at::Tensor masks = at::empty({blocks, pairs, kPairRows}, offsets.options().dtype(at::kLong));
  int64_t* block_offset = block_offsets.data_ptr<int64_t>();
  uint64_t* mask_data = reinterpret_cast<uint64_t*>(masks.data_ptr<int64_t>());
  pair_masks(bit_data, rows, n_cols, mask_data);
  // Every weight kept (rows a whole number of blocks), or pruned_at_zero: the dense layout, without masks or pass
  // headers.
  const bool dense = pruned_at_zero || (rows % kPairRows == 0 &&
                                        std::all_of(mask_data, mask_data + masks.numel(),
                                                    [](uint64_t mask) { return mask == ~uint64_t{0}; }));
  const int64_t total = pair_block_offsets(mask_data, blocks, pairs, dense, block_offset);
  const int64_t groups = scales.size(1);
  const at::Tensor block_scales = pair_scales(scales, blocks);
  at::Tensor packed = at::zeros({total + kPairPad}, code.options());
  uint8_t* out = packed.data_ptr<uint8_t>();
  const uint8_t* in = code.data_ptr<uint8_t>();
  const int32_t* in_offset = offsets.data_ptr<int32_t>();
  const at::Tensor stored_zeros = zeros.has_value() ? zeros->contiguous() : at::Tensor();
  const auto zero_of = [&](int64_t row, int64_t g) {  // as stored: group g of a row in byte g / 2
    const uint8_t* z = stored_zeros.data_ptr<uint8_t>() + row * stored_zeros.size(1);
    return (z[g / 2] >> (4 * (g % 2))) & 0xf;
  };
  const int64_t group_pairs = n_cols / scales.size(1) / 64;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* row_codes[kPairRows];
      for (int64_t r = 0; r < kPairRows; ++r) {
        row_codes[r] = b * kPairRows + r < rows ? in + in_offset[b * kPairRows + r] : nullptr;
      }
      uint8_t* dst = out + block_offset[b];
      for (int64_t q = 0; q < pairs; ++q) {
        const uint64_t* m = mask_data + (b * pairs + q) * kPairRows;
        if (!dense) {  // the pass's header: the first pair of rows' bytes, and both pairs'
          const int64_t first = row_pair_bytes(m[0], m[1]);
          dst[0] = static_cast<uint8_t>(first);
          dst[1] = static_cast<uint8_t>(first + row_pair_bytes(m[2], m[3]));
          dst += kPairHeader;
        }
        for (int64_t r = 0; r < kPairRows; ++r) {
          if (row_codes[r] != nullptr) {  // padding rows (mask 0) have none
            const int fill = pruned_at_zero ? zero_of(b * kPairRows + r, q / group_pairs) : -1;
            pack_pair(m[r], row_codes[r], static_cast<int>(r % 2), dst, fill);
            row_codes[r] += (__builtin_popcount(static_cast<uint32_t>(m[r])) + 1) / 2 +
                            (__builtin_popcount(static_cast<uint32_t>(m[r] >> 32)) + 1) / 2;
          }
          if (r % 2 == 1) dst += dense ? 64 : row_pair_bytes(m[r - 1], m[r]);
        }
      }
    }
  });
  const at::Tensor block_zeros = pair_zeros(zeros, rows, blocks, groups, code.options());
  return {dense ? masks.new_empty({0}) : masks, packed, block_offsets, block_scales,
          zeros.has_value() ? block_zeros : code.new_empty({0})};
}

// The argument checks of bitmap_q4_i8_linear: the pair layout's shapes and dtypes, x's, the bias's.
void check_i8_args(const char* kOp, const at::Tensor& x, const at::Tensor& masks, const at::Tensor& codes,
                   const at::Tensor& block_offsets, const at::Tensor& scales, int64_t n_rows, int64_t n_cols,
                   const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& zeros) {
  TORCH_CHECK(x.device().is_cpu() && masks.device().is_cpu() && codes.device().is_cpu() &&
                  scales.device().is_cpu() && block_offsets.device().is_cpu() &&
                  (!bias.has_value() || bias->device().is_cpu()),
              kOp, " takes CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, kOp,
              " supports bfloat16 and float32 x, not ", x.scalar_type());
  TORCH_CHECK(n_cols > 0 && n_cols % 64 == 0 && x.dim() >= 1 && x.size(-1) == n_cols, kOp, ": x has ",
              x.dim() >= 1 ? x.size(-1) : 0, " features, the weight has ", n_cols, " columns (a multiple of 64)");
  const int64_t rows = n_rows, blocks = (rows + kPairRows - 1) / kPairRows;
  TORCH_CHECK(rows >= 0 && scales.scalar_type() == at::kHalf && scales.dim() == 3 && scales.size(0) == blocks &&
                  scales.size(2) == kPairRows && scales.size(1) > 0 && n_cols % scales.size(1) == 0 &&
                  (n_cols / scales.size(1)) % 64 == 0,
              kOp, ": scales must be float16 [blocks, groups, ", kPairRows, "] with groups of a multiple of 64 "
              "columns (the pair layout, bitmap_q4_pack_pairs)");
  const bool dense = masks.numel() == 0;
  TORCH_CHECK(masks.scalar_type() == at::kLong &&
                  (dense || masks.numel() == blocks * (n_cols / 64) * kPairRows) &&
                  codes.scalar_type() == at::kByte && codes.dim() == 1 && codes.numel() >= kPairPad &&
                  block_offsets.scalar_type() == at::kLong && block_offsets.numel() == blocks,
              kOp, ": masks, codes and block_offsets must be the pair layout (bitmap_q4_pack_pairs)");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == rows), kOp, ": bias must have ", rows,
              " entries");
  const bool asym = zeros.has_value() && zeros->numel() > 0;
  TORCH_CHECK(!asym || (zeros->device().is_cpu() && zeros->scalar_type() == at::kByte && zeros->dim() == 3 &&
                        zeros->size(0) == blocks && zeros->size(1) == scales.size(1) && zeros->size(2) == kPairRows),
              kOp, ": zeros must be uint8 [blocks, groups, ", kPairRows, "] like the scales (bitmap_q4_pack_pairs), "
              "or empty for the symmetric grid");
}

// Prefill with int8 x (AVX-512): x quantized once, W decoded panel by panel into the int8 kernel's layout.
void prefill_int8(Q4PairProblem& p, const at::Tensor& x2, bool asym) {
  const int64_t m = p.m, n_cols = p.cols;
  const Int8X xq(m, n_cols, p.groups, x2.options());
  const Q8Rows& q8 = xq.q8;
  quantize_x_avx512(p.dtype, x2.data_ptr(), x2.stride(0), m, n_cols, n_cols / p.groups, q8);
  q8_group_starts_avx512(q8, m, n_cols, xq.starts, asym);
  p.x_values = q8.values;
  p.x_scales = q8.scales;
  const int64_t panels = (p.rows + kPrefillPanelRows - 1) / kPrefillPanelRows;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    q4_pairs_prefill_panels_avx512(p, xq.starts, begin, end);
  });
}

// Prefill: x as it is against exact tiles (decoded straight to bf16 for bf16 x), whole blocks of rows per tile.
void prefill_tiles(const Q4PairProblem& p, const at::Tensor& x2, const std::optional<at::Tensor>& bias, at::Tensor& y,
                   bool avx512, int64_t grain) {
  const int64_t n_cols = p.cols;
  const auto decode_bf16 = avx512 ? q4_pairs_decode_blocks_bf16_avx512 : q4_pairs_decode_blocks_bf16_avx2;
  const auto decode_f32 = avx512 ? q4_pairs_decode_blocks_avx512 : q4_pairs_decode_blocks_avx2;
  tiled_gemm(x2, bias, p.rows, kPairRows, y, true, [&](int64_t first, int64_t last, void* tile, bool bf16) {
    at::parallel_for(first / kPairRows, (last + kPairRows - 1) / kPairRows, grain, [&](int64_t begin, int64_t end) {
      const int64_t at_row = (begin * kPairRows - first) * n_cols;
      if (bf16) {
        decode_bf16(p, begin, end, static_cast<uint16_t*>(tile) + at_row, n_cols);
      } else {
        decode_f32(p, begin, end, static_cast<float*>(tile) + at_row, n_cols);
      }
    });
  });
}

at::Tensor bitmap_q4_i8_linear(const at::Tensor& x, const at::Tensor& masks, const at::Tensor& codes,
                               const at::Tensor& block_offsets, const at::Tensor& scales, int64_t n_rows,
                               int64_t n_cols, const std::optional<at::Tensor>& bias,
                               const std::optional<at::Tensor>& zeros, bool checked) {
  constexpr const char* kOp = "leap_sparse_cpu::bitmap_q4_i8_linear";
  TORCH_CHECK(i8_available(), kOp, " needs AVX2 (or AVX-512 with VNNI, VBMI2 and GFNI) and that ISA chosen");
  const bool avx512 = avx512_i8();
  check_i8_args(kOp, x, masks, codes, block_offsets, scales, n_rows, n_cols, bias, zeros);
  const int64_t rows = n_rows, blocks = (rows + kPairRows - 1) / kPairRows;
  const bool dense = masks.numel() == 0, asym = zeros.has_value() && zeros->numel() > 0;
  at::Tensor y = empty_output(x, rows);
  const int64_t m = y.numel() / std::max<int64_t>(rows, 1);
  if (m == 0 || rows == 0) return y;

  const at::Tensor mask = masks.contiguous(), code = codes.contiguous(), scale = scales.contiguous(),
                   offsets = block_offsets.contiguous();
  const at::Tensor zero = asym ? zeros->contiguous() : at::Tensor();
  at::Tensor x2 = x.reshape({m, n_cols});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  std::optional<at::Tensor> bias32;
  if (bias.has_value()) bias32 = bias->to(at::kFloat).contiguous();

  Q4PairProblem p{};
  set_operands(p, x.scalar_type() == at::kBFloat16 ? DType::BF16 : DType::F32, rows, n_cols, m, bias32, y);
  p.masks = dense ? nullptr : reinterpret_cast<const uint64_t*>(mask.data_ptr<int64_t>());
  p.codes = code.data_ptr<uint8_t>();
  p.block_offsets = offsets.data_ptr<int64_t>();
  p.scales = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  p.zeros = asym ? zero.data_ptr<uint8_t>() : nullptr;
  p.groups = scale.size(1);
  p.group_pairs = n_cols / p.groups / 64;
  TORCH_CHECK(p.block_offsets[0] == 0 && p.block_offsets[blocks - 1] <= code.numel() - kPairPad &&
                  (!dense || code.numel() == blocks * kPairRows * (n_cols / 2) + kPairPad), kOp,
              ": block_offsets do not fit the codes (make them with bitmap_q4_pack_pairs)");
  if (!checked) check_pair_offsets(kOp, p.masks, p.codes, code.numel(), p.block_offsets, blocks, n_cols / 64);
  const int64_t grain = std::max<int64_t>(1, kTaskWeights / (n_cols * kPairRows));

  if (m <= kPairMaxM || (!avx512 && g_prefill_int8.load())) {
    const Int8X xq(m, n_cols, p.groups, x.options());
    const Q8Rows& q8 = xq.q8;
    (avx512 ? quantize_x_avx512 : quantize_x_avx2)(p.dtype, x2.data_ptr(), x2.stride(0), m, n_cols,
                                                    n_cols / p.groups, q8);
    p.x_values = q8.values;
    p.x_scales = q8.scales;
    // The asymmetric grid's zero points' term needs each group's sum of q (the kernels fold it per row and group);
    // the AVX2 kernel's pruned columns' term needs it on either grid.
    if (asym || !avx512) {
      if (avx512) {
        q8_group_starts_avx512(q8, m, n_cols, xq.starts, true);
      } else {
        q8_group_starts_avx2(q8, m, n_cols, xq.starts);
      }
      p.x_starts = xq.starts;
    }
    const auto gemm = avx512 ? q4_pairs_gemm_blocks_avx512 : q4_pairs_gemm_blocks_avx2;
    at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) { gemm(p, begin, end); });
    return y;
  }

  if (g_prefill_int8.load()) {
    prefill_int8(p, x2, asym);
  } else {
    prefill_tiles(p, x2, bias, y, avx512, grain);
  }
  return y;
}

}  // namespace
}  // namespace leap_sparse

TORCH_LIBRARY_FRAGMENT(leap_sparse_cpu, m) {
  m.def("bitmap_q4_i8_available() -> bool", &leap_sparse::i8_available);
  m.def("bitmap_q4_i8_prefill(str mode=\"\") -> str", &leap_sparse::prefill_op);
  m.def("bitmap_q4_pack_pairs(Tensor bitmap, Tensor codes, Tensor scales, Tensor row_offsets, int n_cols, "
        "Tensor? zeros=None, bool pruned_at_zero=False, bool checked=False) -> (Tensor masks, Tensor codes, Tensor block_offsets, "
        "Tensor scales, Tensor zeros)");
  m.def("bitmap_q4_i8_linear(Tensor x, Tensor masks, Tensor codes, Tensor block_offsets, Tensor scales, "
        "int n_rows, int n_cols, Tensor? bias=None, Tensor? zeros=None, bool checked=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(leap_sparse_cpu, CPU, m) {
  m.impl("bitmap_q4_pack_pairs", &leap_sparse::bitmap_q4_pack_pairs);
  m.impl("bitmap_q4_i8_linear", &leap_sparse::bitmap_q4_i8_linear);
}
