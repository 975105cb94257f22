// Which of the instruction sets our kernels are compiled for this CPU runs (checked at run time:
// the extension is built without -march=native, so one .so serves any x86-64 machine).
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#define MAGICDEC_X86 1

namespace magicdec {

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

}  // namespace magicdec

#endif
