// The torch ops of the native CPU sparse linear layer:
//   leap_sparse_cpu::bitmap_linear(x, bitmap, values, row_offsets, n_cols, bias=None, checked=False)
//       -> y = x W^T + b. Unless `checked` (the caller checked this weight's layout once, as the vLLM layer
//       does at load), every row offset is checked against the bitmap's popcounts first: a corrupt offset
//       would otherwise read outside `values`.
// A fragment of the leap_sparse_cpu library (common/isa.cpp), using its isa()/set_isa() choice.
// Up to kSparseMaxM rows of x (decode, small batches) run the sparse kernels, which read each weight's
// bitmap and values once per call; more rows (prefill) decode tiles of W and multiply them with ATen's
// dense GEMM.
// Work is split over output rows with ATen's thread pool and thread count.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "bitmap/kernels.h"
#include "common/isa.h"
#include "common/offset_checks.h"
#include "common/op_common.h"

namespace leap_sparse {
namespace {

// The shape, dtype and device checks; returns the kernels' dtype.
DType check_args(const at::Tensor& x, const at::Tensor& bitmap, const at::Tensor& values,
                 const at::Tensor& row_offsets, int64_t n_cols, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && bitmap.device().is_cpu() && values.device().is_cpu() &&
                  row_offsets.device().is_cpu() && (!bias.has_value() || bias->device().is_cpu()),
              "leap_sparse_cpu::bitmap_linear takes CPU tensors");
  const DType dtype = x_dtype(x.scalar_type(), "leap_sparse_cpu::bitmap_linear", "");
  TORCH_CHECK(values.scalar_type() == x.scalar_type(), "leap_sparse_cpu::bitmap_linear: values are ",
              values.scalar_type(), " but x is ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == n_cols, "leap_sparse_cpu::bitmap_linear: x has ",
              x.dim() >= 1 ? x.size(-1) : 0, " features, the weight has ", n_cols, " columns");
  TORCH_CHECK(bitmap.scalar_type() == at::kByte && bitmap.dim() == 2 && bitmap.size(1) == (n_cols + 7) / 8,
              "leap_sparse_cpu::bitmap_linear: bitmap must be uint8 [rows, ", (n_cols + 7) / 8, "], got ",
              bitmap.scalar_type(), " ", bitmap.sizes());
  const int64_t rows = bitmap.size(0);
  TORCH_CHECK(row_offsets.scalar_type() == at::kLong && row_offsets.dim() == 1 && row_offsets.size(0) == rows,
              "leap_sparse_cpu::bitmap_linear: row_offsets must be int64 [", rows, "]");
  TORCH_CHECK(values.dim() == 1, "leap_sparse_cpu::bitmap_linear: values must be 1-D");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == rows),
              "leap_sparse_cpu::bitmap_linear: bias must have ", rows, " entries");
  return dtype;
}

// Where each range of rows reads its values: rows before `unpadded` from `whole`, the others from `padded` (a
// copy of the last rows' values with kValuePad zeros after them); `grain` rows at least per task.
struct RowSplit {
  int64_t unpadded;
  Values whole, padded;
  int64_t grain;
};

// Up to kSparseMaxM rows of x: x packed as the kernels read it, then the sparse kernels over the rows.
void sparse_rows(Problem& p, const at::Tensor& x2, Isa isa, int64_t padded_cols, const RowSplit& split) {
  const int64_t m = p.m, n_cols = p.cols;
  p.x_is_bf16 = isa == Isa::Avx512 && p.dtype == DType::BF16;
  const auto packed_type = p.x_is_bf16 ? at::kBFloat16 : at::kFloat;
  // One bf16 row of whole 32-column words is already interleaved (a decode step of one sequence).
  const bool as_is = p.x_is_bf16 && m == 1 && n_cols == padded_cols;
  at::Tensor packed = as_is ? x2 : at::empty({m, padded_cols}, x2.options().dtype(packed_type));
  if (p.x_is_bf16 && !as_is) {
    interleave_words(static_cast<const uint16_t*>(x2.data_ptr()), x2.stride(0), m, n_cols,
                     static_cast<uint16_t*>(packed.data_ptr()));
  } else if (!p.x_is_bf16) {
    widen_x_avx2(p.dtype, x2.data_ptr(), x2.stride(0), m, n_cols, packed.data_ptr<float>(), padded_cols);
  }
  p.x = packed.data_ptr();
  p.x_stride = padded_cols;
  const auto gemm = isa == Isa::Avx512 ? gemm_rows_avx512 : gemm_rows_avx2;
  parallel_rows(0, p.rows, split.grain, split.unpadded, [&](bool in_tail, int64_t begin, int64_t end) {
    gemm(p, in_tail ? split.padded : split.whole, begin, end);
  });
}

// More rows of x: tiles of W decoded by the kernels, multiplied with ATen's dense GEMM into y.
void tiled_rows(const Problem& p, const at::Tensor& x2, const std::optional<at::Tensor>& bias, at::Tensor& y,
                const at::Tensor& vals, Isa isa, int64_t padded_cols, const RowSplit& split) {
  const int64_t rows = p.rows, m = p.m, n_cols = p.cols, elem = p.dtype == DType::F32 ? 4 : 2;
  const auto decode = isa == Isa::Avx512 ? decode_rows_avx512 : decode_rows_avx2;
  const int64_t tile_rows = std::clamp<int64_t>(kTileBytes / (padded_cols * elem), 16, rows);
  at::Tensor tile = at::empty({tile_rows, padded_cols}, vals.options());
  char* tile_data = static_cast<char*>(tile.data_ptr());
  at::Tensor y2 = y.view({m, rows});
  std::optional<at::Tensor> bias_out;  // what F.linear would add: the bias in the output dtype
  if (bias.has_value()) bias_out = bias->to(y.scalar_type());
  for (int64_t first = 0; first < rows; first += tile_rows) {
    const int64_t last = std::min(rows, first + tile_rows);
    parallel_rows(first, last, split.grain, split.unpadded, [&](bool in_tail, int64_t begin, int64_t end) {
      decode(p, in_tail ? split.padded : split.whole, begin, end, tile_data + (begin - first) * padded_cols * elem,
             padded_cols);
    });
    const at::Tensor w = tile.narrow(0, 0, last - first).narrow(1, 0, n_cols);
    y2.narrow(1, first, last - first)
        .copy_(bias_out.has_value() ? at::addmm(bias_out->narrow(0, first, last - first), x2, w.t())
                                    : at::mm(x2, w.t()));
  }
}

at::Tensor bitmap_linear(const at::Tensor& x, const at::Tensor& bitmap, const at::Tensor& values,
                         const at::Tensor& row_offsets, int64_t n_cols,
                         const std::optional<at::Tensor>& bias, bool checked) {
  const Isa isa = current_isa();
  TORCH_CHECK(isa != Isa::None, "leap_sparse_cpu: this CPU has neither AVX2 (with FMA and F16C) nor AVX-512");
  const DType dtype = check_args(x, bitmap, values, row_offsets, n_cols, bias);
  const int64_t rows = bitmap.size(0);
  at::Tensor y = empty_output(x, rows);
  const int64_t m = y.numel() / std::max<int64_t>(rows, 1);
  if (m == 0 || rows == 0) return y;

  const at::Tensor bits = bitmap.contiguous(), vals = values.contiguous(), offsets = row_offsets.contiguous();
  const int64_t stride = bits.size(1), n_values = vals.numel();
  const int64_t* offset = offsets.data_ptr<int64_t>();
  const uint8_t* last_row = bits.data_ptr<uint8_t>() + (rows - 1) * stride;
  TORCH_CHECK(offset[0] == 0 && offset[rows - 1] + row_values(last_row, stride) == n_values,
              "leap_sparse_cpu::bitmap_linear: row_offsets and bitmap do not account for the ", n_values,
              " values (check the layout with sparse_formats.get_format('bitmap').check)");
  // Each row starts where the rows before it end (so offsets never decrease and stay in `values`).
  if (!checked) {
    check_bitmap_offsets("leap_sparse_cpu::bitmap_linear", bits.data_ptr<uint8_t>(), stride, offset, rows, n_values);
  }

  at::Tensor x2 = x.reshape({m, n_cols});
  if (n_cols > 0 && x2.stride(1) != 1) x2 = x2.contiguous();
  const int64_t padded_cols = std::max<int64_t>(32, (n_cols + 31) / 32 * 32);
  std::optional<at::Tensor> bias32;
  if (bias.has_value()) bias32 = bias->to(at::kFloat).contiguous();

  Problem p{};
  set_operands(p, dtype, rows, n_cols, m, bias32, y);
  p.bitmap = bits.data_ptr<uint8_t>();
  p.bitmap_stride = stride;
  p.row_offsets = offset;

  // Values of the last rows, with kValuePad zeros after them.
  const int64_t unpadded = first_unpadded_row(offset, rows, n_values, kValuePad);
  const int64_t tail_first = unpadded < rows ? offset[unpadded] : n_values;
  const at::Tensor tail = padded_tail(vals, tail_first, kValuePad);
  const RowSplit split{unpadded, Values{vals.data_ptr(), 0}, Values{tail.data_ptr(), tail_first},
                       std::max<int64_t>(1, kTaskWeights / std::max<int64_t>(n_cols, 1))};
  if (m <= kSparseMaxM) {
    sparse_rows(p, x2, isa, padded_cols, split);
  } else {
    tiled_rows(p, x2, bias, y, vals, isa, padded_cols, split);
  }
  return y;
}

}  // namespace
}  // namespace leap_sparse

TORCH_LIBRARY_FRAGMENT(leap_sparse_cpu, m) {
  m.def("bitmap_linear(Tensor x, Tensor bitmap, Tensor values, Tensor row_offsets, int n_cols, "
        "Tensor? bias=None, bool checked=False) -> Tensor");
}

TORCH_LIBRARY_IMPL(leap_sparse_cpu, CPU, m) { m.impl("bitmap_linear", &leap_sparse::bitmap_linear); }
