// The torch ops of the native CPU linear layer on the `bitmap-q4` layout (sparse_formats/bitmap_q4.py):
//   leap_sparse_cpu::bitmap_q4_linear(x, bitmap, codes, scales, row_offsets, n_cols, bias=None, zeros=None,
//                                     checked=False)
//       -> y = x W^T + b, W[r, c] = scales[r, c / G] * (code - 7.5) where kept, 0 elsewhere; with zeros (the
//          asymmetric grid, bitmap_q4/kernels.h: far less quality lost than with 7.5) scales[r, c / G] *
//          (code - zero of row r and group c / G); bitmap_q4/avx512.cpp measures what it costs. Unless `checked`
//          (the caller checked the layout once, as the vLLM layer does at load), every row offset is checked
//          against the bitmap first (common/offset_checks.h): a corrupt one would read outside `codes`
//   leap_sparse_cpu::bitmap_q4_validate(bitmap, codes, scales, row_offsets, n_cols, zeros=None)
//       -> checks every row's offset against the bitmap (once, when a layer loads: it reads the whole bitmap)
// Registered as a fragment of the leap_sparse_cpu library that common/isa.cpp defines, and using the
// instruction set that its isa()/set_isa() choose (one choice for both ops). Up to kSparseMaxM rows of x
// run the sparse kernels, which read each weight's bitmap, codes and scales once per call; more rows
// (prefill) decode tiles of W (exact fp32; for bf16 x bf16, each exact value rounded once, straight from the
// AVX-512 kernel) and multiply them with ATen's GEMM. Work is split over output rows with ATen's thread pool
// and thread count.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "bitmap_q4/kernels.h"
#include "common/offset_checks.h"
#include "common/op_common.h"

namespace leap_sparse {
namespace {

enum class Q4Isa { Avx2, Avx512 };

// The kernel that leap_sparse_cpu::isa() names (chosen_isa), where this CPU runs its q4 form: the AVX-512 one
// also needs VBMI (vpmultishiftqb), which every CPU with VBMI2 has, and the AVX2 one BMI2 (pdep).
Q4Isa current_q4_isa() {
  static const bool vbmi = __builtin_cpu_supports("avx512vbmi");
  static const bool bmi2 = __builtin_cpu_supports("bmi2");
  const std::string isa = chosen_isa();
  if (isa == "avx512" && vbmi) return Q4Isa::Avx512;
  TORCH_CHECK(isa != "none" && bmi2, "leap_sparse_cpu::bitmap_q4_linear: this CPU has neither AVX-512 (with "
              "VBMI, VBMI2 and BF16) nor AVX2 with FMA, F16C and BMI2");
  return Q4Isa::Avx2;
}

// The shape and dtype checks both ops make; returns the group size.
int64_t check_layout(const char* op, const at::Tensor& bitmap, const at::Tensor& codes, const at::Tensor& scales,
                     const at::Tensor& row_offsets, int64_t n_cols) {
  TORCH_CHECK(bitmap.device().is_cpu() && codes.device().is_cpu() && scales.device().is_cpu() &&
                  row_offsets.device().is_cpu(),
              op, " takes CPU tensors");
  TORCH_CHECK(n_cols > 0 && n_cols % 32 == 0, op, ": n_cols must be a positive multiple of 32, got ", n_cols);
  TORCH_CHECK(bitmap.scalar_type() == at::kByte && bitmap.dim() == 2 && bitmap.size(1) == n_cols / 8, op,
              ": bitmap must be uint8 [rows, ", n_cols / 8, "], got ", bitmap.scalar_type(), " ", bitmap.sizes());
  const int64_t rows = bitmap.size(0);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 1, op, ": codes must be 1-D uint8, got ",
              codes.scalar_type(), " ", codes.sizes());
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 2 && scales.size(0) == rows &&
                  scales.size(1) > 0 && n_cols % scales.size(1) == 0 && (n_cols / scales.size(1)) % 32 == 0,
              op, ": scales must be float16 [", rows, ", groups] with groups of whole 32-column words "
              "dividing the ", n_cols, " columns, got ", scales.scalar_type(), " ", scales.sizes());
  TORCH_CHECK(row_offsets.scalar_type() == at::kInt && row_offsets.dim() == 1 && row_offsets.size(0) == rows, op,
              ": row_offsets must be int32 [", rows, "], got ", row_offsets.scalar_type(), " ", row_offsets.sizes());
  return n_cols / scales.size(1);
}

// The zero points' checks (both ops): uint8 [rows, (groups + 1) / 2], two 4-bit zeros a byte.
void check_zeros(const char* op, const std::optional<at::Tensor>& zeros, const at::Tensor& scales) {
  if (!zeros.has_value()) return;
  const int64_t rows = scales.size(0), stride = (scales.size(1) + 1) / 2;
  TORCH_CHECK(zeros->device().is_cpu(), op, " takes CPU tensors");
  TORCH_CHECK(zeros->scalar_type() == at::kByte && zeros->dim() == 2 && zeros->size(0) == rows &&
                  zeros->size(1) == stride,
              op, ": zeros must be uint8 [", rows, ", ", stride, "] (two 4-bit zero points a byte for the ",
              scales.size(1), " groups of each row), got ", zeros->scalar_type(), " ", zeros->sizes());
}

// Where each range of rows reads its codes: rows before `unpadded` from `whole`, the others from `padded` (a
// copy of the last rows' codes with kCodePad zeros after them); `grain` rows at least per task.
struct CodeSplit {
  int64_t unpadded;
  Codes whole, padded;
  int64_t grain;
};

// Up to kSparseMaxM rows of x: x as the kernels read it, then the sparse kernels over the rows.
void q4_sparse_rows(Q4Problem& p, const at::Tensor& x2, Q4Isa isa, const CodeSplit& split) {
  const int64_t m = p.m, n_cols = p.cols;
  p.x_is_bf16 = isa == Q4Isa::Avx512 && p.dtype == DType::BF16;
  at::Tensor packed;
  if (p.x_is_bf16 && m > 1) {
    packed = at::empty({m, n_cols}, x2.options());
    interleave_words(static_cast<const uint16_t*>(x2.data_ptr()), x2.stride(0), m, n_cols,
                     static_cast<uint16_t*>(packed.data_ptr()));
  } else if (p.x_is_bf16 || p.dtype == DType::F32) {
    packed = x2;  // one bf16 row is already interleaved; fp32 rows are read as they are
  } else {
    packed = at::empty({m, n_cols}, x2.options().dtype(at::kFloat));
    widen_x_avx2(p.dtype, x2.data_ptr(), x2.stride(0), m, n_cols, packed.data_ptr<float>(), n_cols);
  }
  p.x = packed.data_ptr();
  p.x_stride = packed.stride(0);
  const auto gemm = isa == Q4Isa::Avx512 ? q4_gemm_rows_avx512 : q4_gemm_rows_avx2;
  parallel_rows(0, p.rows, split.grain, split.unpadded, [&](bool in_tail, int64_t begin, int64_t end) {
    gemm(p, in_tail ? split.padded : split.whole, begin, end);
  });
}

// More rows: exact fp32 tiles and ATen's GEMM (for bf16 x bf16 tiles: the AVX-512 kernel writes them, AVX2's
// fp32 ones are converted by ATen).
void q4_tiled_rows(const Q4Problem& p, const at::Tensor& x2, const std::optional<at::Tensor>& bias, at::Tensor& y,
                   Q4Isa isa, const CodeSplit& split) {
  const int64_t n_cols = p.cols;
  const auto decode = isa == Q4Isa::Avx512 ? q4_decode_rows_avx512 : q4_decode_rows_avx2;
  tiled_gemm(x2, bias, p.rows, 1, y, isa == Q4Isa::Avx512, [&](int64_t first, int64_t last, void* tile, bool bf16) {
    parallel_rows(first, last, split.grain, split.unpadded, [&](bool in_tail, int64_t begin, int64_t end) {
      const Codes c = in_tail ? split.padded : split.whole;
      if (bf16) {
        q4_decode_rows_bf16_avx512(p, c, begin, end, static_cast<uint16_t*>(tile) + (begin - first) * n_cols, n_cols);
      } else {
        decode(p, c, begin, end, static_cast<float*>(tile) + (begin - first) * n_cols, n_cols);
      }
    });
  });
}

at::Tensor bitmap_q4_linear(const at::Tensor& x, const at::Tensor& bitmap, const at::Tensor& codes,
                            const at::Tensor& scales, const at::Tensor& row_offsets, int64_t n_cols,
                            const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& zeros,
                            bool checked) {
  constexpr const char* kOp = "leap_sparse_cpu::bitmap_q4_linear";
  const Q4Isa isa = current_q4_isa();
  const int64_t group = check_layout(kOp, bitmap, codes, scales, row_offsets, n_cols);
  check_zeros(kOp, zeros, scales);
  TORCH_CHECK(x.device().is_cpu() && (!bias.has_value() || bias->device().is_cpu()), kOp, " takes CPU tensors");
  const DType dtype = x_dtype(x.scalar_type(), kOp, " x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == n_cols, kOp, ": x has ", x.dim() >= 1 ? x.size(-1) : 0,
              " features, the weight has ", n_cols, " columns");
  const int64_t rows = bitmap.size(0);
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == rows), kOp, ": bias must have ", rows,
              " entries");

  at::Tensor y = empty_output(x, rows);
  const int64_t m = y.numel() / std::max<int64_t>(rows, 1);
  if (m == 0 || rows == 0) return y;

  const at::Tensor bits = bitmap.contiguous(), code = codes.contiguous(), scale = scales.contiguous(),
                   offsets = row_offsets.contiguous();
  const int64_t n_codes = code.numel();
  const int32_t* offset = offsets.data_ptr<int32_t>();
  // The first and last rows' offsets (O(1) work per call): with them every row's loads stay inside the
  // codes tensor or its padded copy unless the offsets between disagree with the bitmap, which the check
  // below finds (skipped with `checked`: a layout checked once, by bitmap_q4_validate or the format's check).
  TORCH_CHECK(offset[0] == 0 && offset[rows - 1] >= 0 && offset[rows - 1] <= n_codes &&
                  offset[rows - 1] + row_code_bytes(bits.data_ptr<uint8_t>() + (rows - 1) * (n_cols / 8),
                                                    n_cols / 32) == n_codes,
              kOp, ": row_offsets and bitmap do not account for the ", n_codes, " bytes of codes (check the "
              "layout with sparse_formats.get_format('bitmap-q4').check)");
  if (!checked) check_q4_offsets(kOp, bits.data_ptr<uint8_t>(), n_cols, offset, rows, n_codes);

  at::Tensor x2 = x.reshape({m, n_cols});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  std::optional<at::Tensor> bias32;
  if (bias.has_value()) bias32 = bias->to(at::kFloat).contiguous();

  Q4Problem p{};
  set_operands(p, dtype, rows, n_cols, m, bias32, y);
  p.bitmap = bits.data_ptr<uint8_t>();
  p.row_offsets = offset;
  p.scales = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  p.groups = scale.size(1);
  p.group_words = group / 32;
  at::Tensor zero;
  if (zeros.has_value()) {
    zero = zeros->contiguous();
    p.zeros = zero.data_ptr<uint8_t>();
    p.zeros_stride = zero.size(1);
  }

  // Codes of the last rows, with kCodePad zeros after them (see bitmap/op.cpp).
  const int64_t unpadded = first_unpadded_row(offset, rows, n_codes, kCodePad);
  const int64_t tail_first = unpadded < rows ? offset[unpadded] : n_codes;
  const at::Tensor tail = padded_tail(code, tail_first, kCodePad);
  const Codes whole{code.data_ptr<uint8_t>(), 0}, padded{tail.data_ptr<uint8_t>(), tail_first};
  const int64_t grain = std::max<int64_t>(1, kTaskWeights / n_cols);

  const CodeSplit split{unpadded, whole, padded, grain};
  if (m <= kSparseMaxM) {
    q4_sparse_rows(p, x2, isa, split);
  } else {
    q4_tiled_rows(p, x2, bias, y, isa, split);
  }
  return y;
}

void bitmap_q4_validate(const at::Tensor& bitmap, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& row_offsets, int64_t n_cols, const std::optional<at::Tensor>& zeros) {
  constexpr const char* kOp = "leap_sparse_cpu::bitmap_q4_validate";
  check_layout(kOp, bitmap, codes, scales, row_offsets, n_cols);
  check_zeros(kOp, zeros, scales);
  const at::Tensor bits = bitmap.contiguous(), offsets = row_offsets.contiguous();
  check_q4_offsets(kOp, bits.data_ptr<uint8_t>(), n_cols, offsets.data_ptr<int32_t>(), bits.size(0), codes.numel());
}

}  // namespace
}  // namespace leap_sparse

TORCH_LIBRARY_FRAGMENT(leap_sparse_cpu, m) {
  m.def("bitmap_q4_linear(Tensor x, Tensor bitmap, Tensor codes, Tensor scales, Tensor row_offsets, int n_cols, "
        "Tensor? bias=None, Tensor? zeros=None, bool checked=False) -> Tensor");
  m.def("bitmap_q4_validate(Tensor bitmap, Tensor codes, Tensor scales, Tensor row_offsets, int n_cols, "
        "Tensor? zeros=None) -> ()");
}

TORCH_LIBRARY_IMPL(leap_sparse_cpu, CPU, m) {
  m.impl("bitmap_q4_linear", &leap_sparse::bitmap_q4_linear);
  m.impl("bitmap_q4_validate", &leap_sparse::bitmap_q4_validate);
}
