// What every layout's kernels and ops share: the dtype of x and y, and the operands every kernel's problem
// has. Plain C++ (no torch, no intrinsics), like the layouts' kernel headers that include it.
#pragma once

#include <cstdint>

// For a hot loop's named steps: inlined whatever the optimizer's size heuristics say, so that the loop compiles as
// if written in one piece (its accumulators stay in registers).
#define LEAP_ALWAYS_INLINE __attribute__((always_inline)) inline

namespace leap_sparse {

enum class DType : int { BF16 = 0, F16 = 1, F32 = 2 };

// What every kernel's problem has (set by common/op_common.h's set_operands): the weight's shape, the rows of x and
// where y goes. Each layout's problem adds its weight's and x's pointers.
struct Operands {
  DType dtype;  // of y (and of x as the op hands it over)
  int64_t rows;
  int64_t cols;
  int64_t m;          // rows of x
  const float* bias;  // [rows] in fp32, or nullptr
  void* y;            // [m, y_stride] of dtype
  int64_t y_stride;
};

}  // namespace leap_sparse
