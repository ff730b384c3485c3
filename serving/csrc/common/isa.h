// The instruction set the kernels use, chosen once per process (isa.cpp: leap_sparse_cpu::isa() and set_isa()):
// the bitmap op asks current_isa() directly, the other ops through the isa() op (common/op_common.h's chosen_isa).
#pragma once

namespace leap_sparse {

enum class Isa : int { None = 0, Avx2 = 1, Avx512 = 2 };

// The kernel in use: the best this CPU runs unless set_isa chose another.
Isa current_isa();

}  // namespace leap_sparse
