// Which instruction set a native call runs: the one dispatch layer every kernel shares.
//
// The extension is built without -march=native, so one .so serves any x86-64 machine: each
// kernel's body is compiled once per instruction set (multiversion.h) and a call picks one at run
// time. The sets this CPU runs are found once, at first use; "auto" is the widest of them. A
// call may name another (tests run every set the CPU has).
#pragma once

#include <ATen/Config.h>
#include <c10/util/Exception.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

// at::parallel_for is an inline template: with torch's OpenMP backend its `#pragma omp parallel`
// is compiled into the extension, and without -fopenmp it silently runs everything on one thread.
#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
#error "torch uses OpenMP: compile with -fopenmp, or at::parallel_for runs serially"
#endif

#if defined(__x86_64__) || defined(__i386__)
#define MAGICDEC_X86 1
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace magicdec {

using bf16_bits = uint16_t;  // bfloat16 as stored: the high half of a float32

// Widest first. "avx512bf16" multiplies bf16 pairs with `vdpbf16ps`; "avx512" widens bf16 to
// float32; "scalar" is portable C++ (the compiler vectorises what it can for the baseline).
enum class Isa : int { kAvx512Bf16 = 0, kAvx512 = 1, kAvx2 = 2, kScalar = 3 };
constexpr int kNumIsas = 4;
constexpr std::array<const char*, kNumIsas> kIsaNames = {"avx512bf16", "avx512", "avx2",
                                                         "scalar"};

inline bool cpu_runs(Isa isa) {
#ifdef MAGICDEC_X86
  __builtin_cpu_init();
  // The AVX-512 subsets the AVX-512 versions are compiled for.
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("fma");
  switch (isa) {
    case Isa::kAvx512Bf16: return avx512 && __builtin_cpu_supports("avx512bf16");
    case Isa::kAvx512: return avx512;
    case Isa::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case Isa::kScalar: return true;
  }
  return false;
#else
  return isa == Isa::kScalar;
#endif
}

// AMX with bf16 tiles, usable: CPUID.(7,0):EDX has AMX-BF16 (bit 22) and AMX-TILE (bit 24), and
// the OS saves the tile state (XCR0 bits 17 and 18). Our kernels do not use it; oneDNN's bf16
// products do, which changes which product is faster (loader.Capabilities.few_rows_max).
inline bool cpu_has_amx_bf16() {
#ifdef MAGICDEC_X86
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!((edx >> 22) & 1) || !((edx >> 24) & 1)) return false;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !((ecx >> 27) & 1)) return false;  // OSXSAVE
  unsigned xcr0_low, xcr0_high;
  __asm__("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
  constexpr unsigned kTileState = (1u << 17) | (1u << 18);
  return (xcr0_low & kTileState) == kTileState;
#else
  return false;
#endif
}

// The instruction sets this CPU runs, widest first (found once).
inline const std::vector<Isa>& available_isas() {
  static const std::vector<Isa> isas = [] {
    std::vector<Isa> found;
    for (int i = 0; i < kNumIsas; ++i) {
      if (cpu_runs(Isa(i))) found.push_back(Isa(i));
    }
    return found;
  }();
  return isas;
}

inline const char* isa_name(Isa isa) { return kIsaNames[int(isa)]; }

// "auto": the widest set this CPU runs; else the named set, which it must run.
inline Isa resolve_isa(const std::string& name, const char* op) {
  if (name == "auto") return available_isas().front();
  for (const Isa isa : available_isas()) {
    if (name == isa_name(isa)) return isa;
  }
  TORCH_CHECK(false, op, ": instruction set '", name, "' is not available here");
}

// The value for `isa` of one per instruction set: pick(isa, MAGICDEC_PER_ISA(name)) is the
// version of a kernel's `name` compiled for `isa` (multiversion.h).
template <typename T>
inline T pick(Isa isa, T avx512bf16, T avx512, T avx2, T scalar) {
  const T versions[kNumIsas] = {avx512bf16, avx512, avx2, scalar};
  return versions[int(isa)];
}

}  // namespace magicdec
