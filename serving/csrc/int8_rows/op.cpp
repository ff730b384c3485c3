// The torch ops of int8-rows weights (an 8-bit lm_head; int8_rows/kernels.h):
//   leap_sparse_cpu::int8_rows_available() -> whether this CPU and the chosen ISA run int8_rows_linear
//   leap_sparse_cpu::int8_rows_linear(x, qweight, scales, row_sums, bias=None)
//       -> y = x W^T + b for W = scales * qweight (int8 [rows, cols], fp16 [rows]; row_sums: int32 [rows], each
//          row's sum of codes, made once at load), x quantized to int8 per row (scale max|x| / 127, ties to even:
//          serving.int8_linear.int8_rows_activations) and multiplied in integers, for up to kInt8RowsMaxM rows
//          of x (decoding steps; the caller multiplies more another way).
// A fragment of the leap_sparse_cpu library (common/isa.cpp), using its isa()/set_isa() choice.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>

#include "bitmap_q4/kernels.h"
#include "int8_rows/kernels.h"
#include "common/op_common.h"

namespace leap_sparse {
namespace {

bool avx512_rows() { return __builtin_cpu_supports("avx512vnni") && chosen_isa() == "avx512"; }

bool int8_rows_available() { return avx512_rows() || chosen_isa() == "avx2"; }

at::Tensor int8_rows_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                            const at::Tensor& row_sums, const std::optional<at::Tensor>& bias) {
  constexpr const char* kOp = "leap_sparse_cpu::int8_rows_linear";
  TORCH_CHECK(int8_rows_available(), kOp, " needs AVX2 (or AVX-512 VNNI) and that ISA chosen");
  const bool avx512 = avx512_rows();
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu() && scales.device().is_cpu() &&
                  row_sums.device().is_cpu() && (!bias.has_value() || bias->device().is_cpu()),
              kOp, " takes CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, kOp,
              " supports bfloat16 and float32 x, not ", x.scalar_type());
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.dim() == 2, kOp, ": qweight must be int8 [rows, cols]");
  const int64_t rows = qweight.size(0), cols = qweight.size(1);
  // 255 * 127 * cols must stay below 2^31 for the int32 sums (cols < 66311).
  TORCH_CHECK(cols > 0 && cols % 64 == 0 && cols <= 65536, kOp, ": the weight's ", cols,
              " columns must be a multiple of 64, at most 65536");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == cols, kOp, ": x has ", x.dim() >= 1 ? x.size(-1) : 0,
              " features, the weight has ", cols, " columns");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 1 && scales.size(0) == rows, kOp,
              ": scales must be float16 [", rows, "]");
  TORCH_CHECK(row_sums.scalar_type() == at::kInt && row_sums.dim() == 1 && row_sums.size(0) == rows, kOp,
              ": row_sums must be int32 [", rows, "] (each row's sum of codes)");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == rows), kOp, ": bias must have ", rows,
              " entries");
  at::Tensor y = empty_output(x, rows);
  const int64_t m = y.numel() / std::max<int64_t>(rows, 1);
  TORCH_CHECK(m <= kInt8RowsMaxM, kOp, " takes at most ", kInt8RowsMaxM, " rows of x, not ", m);
  if (m == 0 || rows == 0) return y;

  const at::Tensor weight = qweight.contiguous(), scale = scales.contiguous(), sums = row_sums.contiguous();
  at::Tensor x2 = x.reshape({m, cols});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  std::optional<at::Tensor> bias32;
  if (bias.has_value()) bias32 = bias->to(at::kFloat).contiguous();

  const DType dtype = x.scalar_type() == at::kBFloat16 ? DType::BF16 : DType::F32;
  const at::Tensor values = at::empty({m, cols}, x.options().dtype(at::kChar));
  const at::Tensor x_scales = at::empty({m}, x.options().dtype(at::kFloat));
  (avx512 ? quantize_x_avx512 : quantize_x_avx2)(dtype, x2.data_ptr(), x2.stride(0), m, cols, cols,
                                                  Q8Rows{values.data_ptr<int8_t>(), x_scales.data_ptr<float>(), 1});

  Int8RowsProblem p{};
  set_operands(p, dtype, rows, cols, m, bias32, y);
  p.weight = weight.data_ptr<int8_t>();
  p.scales = reinterpret_cast<const uint16_t*>(scale.data_ptr<at::Half>());
  p.row_sums = sums.data_ptr<int32_t>();
  // u = q + 128 (q's top bit flipped; AVX2: q as it is), interleaved by 64 columns: the rows of x a step of the
  // kernel reads lie together (rows of 2048 columns lay in the same few L1 sets, which made 8 rows of x take twice
  // 4 rows' time).
  const at::Tensor interleaved = at::empty({m * cols}, x.options().dtype(at::kByte));
  const uint8_t* q = reinterpret_cast<const uint8_t*>(values.data_ptr<int8_t>());
  const uint8_t flip = avx512 ? 0x80 : 0;
  uint8_t* u = interleaved.data_ptr<uint8_t>();
  for (int64_t i = 0; i < m; ++i)
    for (int64_t k = 0; k < cols / 64; ++k)
      for (int64_t j = 0; j < 64; ++j) u[(k * m + i) * 64 + j] = q[i * cols + 64 * k + j] ^ flip;
  p.x_values = u;
  p.x_scales = x_scales.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(8, kTaskWeights / cols);
  const auto gemm = avx512 ? int8_rows_gemm_avx512 : int8_rows_gemm_avx2;
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) { gemm(p, begin, end); });
  return y;
}

}  // namespace
}  // namespace leap_sparse

TORCH_LIBRARY_FRAGMENT(leap_sparse_cpu, m) {
  m.def("int8_rows_available() -> bool", &leap_sparse::int8_rows_available);
  m.def("int8_rows_linear(Tensor x, Tensor qweight, Tensor scales, Tensor row_sums, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(leap_sparse_cpu, CPU, m) { m.impl("int8_rows_linear", &leap_sparse::int8_rows_linear); }
