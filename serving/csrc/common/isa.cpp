// The library leap_sparse_cpu and its ISA set-up: which kernels this CPU runs and which of them the ops use.
//   leap_sparse_cpu::isa() -> the kernel in use ("avx512", "avx2" or "none")
//   leap_sparse_cpu::set_isa(name) -> choose "auto" (the best this CPU runs), "avx512" or "avx2"
// Every op's file registers its ops as a fragment of this library.
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <string>

#include "common/isa.h"

namespace leap_sparse {
namespace {

Isa best_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("popcnt") && __builtin_cpu_supports("f16c");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("avx512bf16")) {
    return Isa::Avx512;
  }
  if (avx2) return Isa::Avx2;
#endif
  return Isa::None;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    case Isa::None: break;
  }
  return "none";
}

std::atomic<int> g_isa{-1};

}  // namespace

Isa current_isa() {
  int isa = g_isa.load();
  if (isa < 0) {
    isa = static_cast<int>(best_isa());
    g_isa.store(isa);
  }
  return static_cast<Isa>(isa);
}

namespace {

std::string isa_op() { return isa_name(current_isa()); }

std::string set_isa_op(std::string name) {
  const Isa best = best_isa();
  Isa wanted = best;
  if (name == "avx512") {
    wanted = Isa::Avx512;
  } else if (name == "avx2") {
    wanted = Isa::Avx2;
  } else {
    TORCH_CHECK(name == "auto", "leap_sparse_cpu: unknown kernel '", name, "' (use auto, avx512 or avx2)");
  }
  TORCH_CHECK(static_cast<int>(wanted) <= static_cast<int>(best), "leap_sparse_cpu: this CPU cannot run the ",
              name, " kernel (it runs: ", isa_name(best), ")");
  g_isa.store(static_cast<int>(wanted));
  return isa_name(wanted);
}

}  // namespace
}  // namespace leap_sparse

TORCH_LIBRARY(leap_sparse_cpu, m) {
  m.def("isa() -> str", &leap_sparse::isa_op);
  m.def("set_isa(str name) -> str", &leap_sparse::set_isa_op);
}
