// What both CPU kernels share: the OpenMP build check, bfloat16's storage type, and which of
// the instruction sets they are compiled for this CPU runs (checked at run time: the extension is
// built without -march=native, so one .so serves any x86-64 machine).
#pragma once

#include <ATen/Config.h>

#include <cstdint>

// at::parallel_for is an inline template: with torch's OpenMP backend its `#pragma omp parallel`
// is compiled into the extension, and without -fopenmp it silently runs everything on one thread.
#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "torch uses OpenMP: compile with -fopenmp, or at::parallel_for runs serially"
#endif

#if defined(__x86_64__) || defined(__i386__)
#define MAGICDEC_X86 1
#include <immintrin.h>
#endif

namespace magicdec {

using bf16_bits = uint16_t;  // bfloat16 as stored: the high half of a float32

#ifdef MAGICDEC_X86

inline bool cpu_has_avx512() {  // the subsets the AVX-512 versions use
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

inline bool cpu_has_avx512_bf16() {
  __builtin_cpu_init();
  return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
}

inline bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

#endif

}  // namespace magicdec
