// Compiles a kernel's body once per instruction set: the one multiversioning idiom of every
// kernel here. A kernel's .cpp defines MAGICDEC_KERNEL_BODY (its body header) and includes this
// file once; the body then exists as magicdec::isa_avx512bf16::..., isa_avx512, isa_avx2 and
// isa_scalar, each compiled under its own `#pragma GCC target` with vec.h's `Ops` and helpers for
// that set (MAGICDEC_VEC_BF16_DOT is defined for the set with AVX512-BF16). A kernel whose results
// must not depend on how the compiler vectorised it defines MAGICDEC_KERNEL_NO_FP_CONTRACT: its
// products and sums are then never fused into FMAs behind the code's back.
//
// The entry point runs the version of the set `resolve_isa` chose: pick(isa, MAGICDEC_PER_ISA(name)). On other architectures the x86 names alias the portable
// version, which is then the only one `available_isas()` lists.
//
// No include guard: the body and vec.h are included once per set, on purpose.
#ifndef MAGICDEC_KERNEL_BODY
#error "define MAGICDEC_KERNEL_BODY (the kernel's body header) before including multiversion.h"
#endif

#ifdef MAGICDEC_KERNEL_NO_FP_CONTRACT
#define MAGICDEC_FP_CONTRACT_PRAGMA _Pragma("GCC optimize(\"fp-contract=off\")")
#else
#define MAGICDEC_FP_CONTRACT_PRAGMA
#endif

#ifdef MAGICDEC_X86

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
MAGICDEC_FP_CONTRACT_PRAGMA
namespace magicdec::isa_avx512bf16 {
namespace {
#define MAGICDEC_VEC_AVX512 1
#define MAGICDEC_VEC_BF16_DOT 1
#include "vec.h"
#include MAGICDEC_KERNEL_BODY
#undef MAGICDEC_VEC_BF16_DOT
#undef MAGICDEC_VEC_AVX512
}  // namespace
}  // namespace magicdec::isa_avx512bf16
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
MAGICDEC_FP_CONTRACT_PRAGMA
namespace magicdec::isa_avx512 {
namespace {
#define MAGICDEC_VEC_AVX512 1
#include "vec.h"
#include MAGICDEC_KERNEL_BODY
#undef MAGICDEC_VEC_AVX512
}  // namespace
}  // namespace magicdec::isa_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
MAGICDEC_FP_CONTRACT_PRAGMA
namespace magicdec::isa_avx2 {
namespace {
#define MAGICDEC_VEC_AVX2 1
#include "vec.h"
#include MAGICDEC_KERNEL_BODY
#undef MAGICDEC_VEC_AVX2
}  // namespace
}  // namespace magicdec::isa_avx2
#pragma GCC pop_options

#endif  // MAGICDEC_X86

#pragma GCC push_options
MAGICDEC_FP_CONTRACT_PRAGMA
namespace magicdec::isa_scalar {
namespace {
#include "vec.h"
#include MAGICDEC_KERNEL_BODY
}  // namespace
}  // namespace magicdec::isa_scalar
#pragma GCC pop_options

#ifndef MAGICDEC_X86
namespace magicdec {
namespace isa_avx512bf16 = isa_scalar;
namespace isa_avx512 = isa_scalar;
namespace isa_avx2 = isa_scalar;
}  // namespace magicdec
#endif

#undef MAGICDEC_FP_CONTRACT_PRAGMA

// The versions of a name the body defines, in Isa order, for `pick` (isa.h): inside namespace
// magicdec, pick(isa, MAGICDEC_PER_ISA(name)) is the version for `isa`.
#define MAGICDEC_PER_ISA(...)                                                      \
  isa_avx512bf16::__VA_ARGS__, isa_avx512::__VA_ARGS__, isa_avx2::__VA_ARGS__,     \
      isa_scalar::__VA_ARGS__
