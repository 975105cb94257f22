// Products of a few rows with a weight matrix on CPU: out = x . weight^T, with x [M, K] for a
// few dozen rows at most (decode, the draft step, verification) and weight [N, K] as torch's
// Linear stores it. (Python side and reference: magicdec_kernels/cpu_native.py.)
//
// With a handful of rows such a product costs one read of the weight: about 4 FLOP per float32
// byte at 8 rows, below this CPU's ridge. The work is split over threads by blocks of kBlockN
// weight rows; each block meets x's rows in tiles of up to kTileM, a register tile of
// kBlockN x kTileM dot products over K, so the block comes from memory once and from L1 for the
// next tiles, and x (a few hundred KiB at most) stays in L2.
//
// Every output is one dot product in a fixed order (lane-wise over K, then across the lanes),
// whatever M is and whichever tile it falls in: a row's result does not depend on the rows that
// share the call, so a verify pass computes a token's logits exactly as a decode step would.
//
// bfloat16: with AVX512-BF16, `vdpbf16ps` multiplies pairs of bf16 exactly and accumulates in
// float32; without it, bf16 is widened to float32 and multiplied with FMAs. The output is
// rounded once (to nearest even) to the output's dtype.
//
// As in slot_attention.cpp, the portable body (the end of this file) is compiled twice by
// including the file into namespaces under `#pragma GCC target`: AVX2+FMA and the baseline.
// AVX-512 has its own intrinsics version.

#ifndef FEW_ROWS_BODY

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_common.h"

namespace {

using magicdec::bf16_bits;

// Weight rows per block, and x rows per register tile (kBlockN x kTileM accumulators).
constexpr int kBlockN = 4;
constexpr int kTileM = 4;
// Multiply-adds below which one thread does the whole product (a parallel region costs more).
constexpr int64_t kMinParallelWork = int64_t(1) << 18;
// Weight rows ahead of the current block that its first tile prefetches into L2, so the next
// blocks stream in while later tiles compute from L1 (measured here: 8 rows ~ 16 rows; without,
// 8 rows of x took memory time plus compute time, 1.4x the weight's bytes floor).
constexpr int64_t kPrefetchRows = 16;

inline float to_float(float value) { return value; }
inline float to_float(bf16_bits bits) {
  const uint32_t widened = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

inline void store(float* dst, float value) { *dst = value; }
inline void store(c10::BFloat16* dst, float value) { *dst = c10::BFloat16(value); }

// Calls f(std::integral_constant<int, n>) for a run-time 1 <= n <= N: tile sizes become
// compile-time constants, so the accumulators live in registers.
template <int N, typename F>
inline void with_count(int n, F&& f) {
  if constexpr (N > 1) {
    if (n < N) return with_count<N - 1>(n, std::forward<F>(f));
  }
  f(std::integral_constant<int, N>{});
}

// Where the operands are: x [M, K] and out [M, N] contiguous, weight rows weight_stride apart.
template <typename T>
struct Operands {
  const T* x;
  const T* weight;
  void* out;
  int64_t num_rows, depth, weight_stride, num_out;
};

// out[:, n_begin:n_end] = x . weight[n_begin:n_end]^T. Kernel::tile<NB, MB>(w, w_stride, x,
// depth, result) computes one tile of dot products.
template <typename Kernel, typename T, typename OutT>
void block_range(const Operands<T>& ops, int64_t n_begin, int64_t n_end) {
  OutT* out = static_cast<OutT*>(ops.out);
  for (int64_t n = n_begin; n < n_end; n += kBlockN) {
    with_count<kBlockN>(int(std::min<int64_t>(kBlockN, n_end - n)), [&](auto nb) {
      constexpr int NB = decltype(nb)::value;
      const T* w = ops.weight + n * ops.weight_stride;
      for (int64_t m = 0; m < ops.num_rows; m += kTileM) {
        with_count<kTileM>(int(std::min<int64_t>(kTileM, ops.num_rows - m)), [&](auto mb) {
          constexpr int MB = decltype(mb)::value;
          float result[NB][MB];
          Kernel::template tile<NB, MB>(w, ops.weight_stride, ops.x + m * ops.depth, ops.depth,
                                        m == 0, result);
          for (int j = 0; j < MB; ++j) {
            for (int i = 0; i < NB; ++i) store(out + (m + j) * ops.num_out + n + i, result[i][j]);
          }
        });
      }
    });
  }
}

using ProductFn = void (*)(const void* ops, bool bf16_out, int64_t n_begin, int64_t n_end);

template <typename Kernel, typename T>
void product(const void* ops, bool bf16_out, int64_t n_begin, int64_t n_end) {
  const auto& operands = *static_cast<const Operands<T>*>(ops);
  if (bf16_out) {
    block_range<Kernel, T, c10::BFloat16>(operands, n_begin, n_end);
  } else {
    block_range<Kernel, T, float>(operands, n_begin, n_end);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// AVX-512 (with AVX512-BF16 dot products where the CPU has them).

#ifdef MAGICDEC_X86

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
namespace rows_avx512 {
namespace {

// One tile of dot products, lane-wise over K in steps of Load::kStep, then across lanes.
// Load: Raw (a register of kStep elements), load(p), load_tail(p, n) (first n, rest zero) and
// madd(acc, w, x) (acc + the lane-wise products of w and x).
template <typename Load>
struct Tile {
  template <int NB, int MB>
  static inline void tile(const typename Load::T* w, int64_t w_stride,
                          const typename Load::T* x, int64_t depth, bool prefetch,
                          float (&result)[NB][MB]) {
    constexpr int kStep = Load::kStep;
    __m512 acc[NB][MB];
    for (int i = 0; i < NB; ++i) {
      for (int j = 0; j < MB; ++j) acc[i][j] = _mm512_setzero_ps();
    }
    int64_t k = 0;
    const typename Load::T* ahead = w + kPrefetchRows * w_stride;
    for (; k + kStep <= depth; k += kStep) {
      typename Load::Raw wv[NB];
      for (int i = 0; i < NB; ++i) wv[i] = Load::load(w + i * w_stride + k);
      if (prefetch) {
        for (int i = 0; i < NB; ++i) {
          _mm_prefetch(reinterpret_cast<const char*>(ahead + i * w_stride + k), _MM_HINT_T1);
        }
      }
      for (int j = 0; j < MB; ++j) {
        const typename Load::Raw xv = Load::load(x + j * depth + k);
        for (int i = 0; i < NB; ++i) acc[i][j] = Load::madd(acc[i][j], wv[i], xv);
      }
    }
    if (k < depth) {
      const int rest = int(depth - k);
      typename Load::Raw wv[NB];
      for (int i = 0; i < NB; ++i) wv[i] = Load::load_tail(w + i * w_stride + k, rest);
      for (int j = 0; j < MB; ++j) {
        const typename Load::Raw xv = Load::load_tail(x + j * depth + k, rest);
        for (int i = 0; i < NB; ++i) acc[i][j] = Load::madd(acc[i][j], wv[i], xv);
      }
    }
    for (int i = 0; i < NB; ++i) {
      for (int j = 0; j < MB; ++j) result[i][j] = _mm512_reduce_add_ps(acc[i][j]);
    }
  }
};

struct Float32 {
  using T = float;
  using Raw = __m512;
  static constexpr int kStep = 16;
  static inline Raw load(const float* p) { return _mm512_loadu_ps(p); }
  static inline Raw load_tail(const float* p, int n) {
    return _mm512_maskz_loadu_ps(__mmask16((1u << n) - 1), p);
  }
  static inline __m512 madd(__m512 acc, Raw w, Raw x) { return _mm512_fmadd_ps(w, x, acc); }
};

// bf16 widened to float32 (AVX-512 without BF16).
struct Bf16Widened {
  using T = bf16_bits;
  using Raw = __m512;
  static constexpr int kStep = 16;
  static inline Raw widen(__m256i half) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  }
  static inline Raw load(const bf16_bits* p) {
    return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline Raw load_tail(const bf16_bits* p, int n) {
    return widen(_mm256_maskz_loadu_epi16(__mmask16((1u << n) - 1), p));
  }
  static inline __m512 madd(__m512 acc, Raw w, Raw x) { return _mm512_fmadd_ps(w, x, acc); }
};

// bf16 pairs multiplied and summed by vdpbf16ps into float32 lanes.
struct Bf16Dot {
  using T = bf16_bits;
  using Raw = __m512i;
  static constexpr int kStep = 32;
  static inline Raw load(const bf16_bits* p) { return _mm512_loadu_si512(p); }
  static inline Raw load_tail(const bf16_bits* p, int n) {
    return _mm512_maskz_loadu_epi16(__mmask32((uint64_t(1) << n) - 1), p);
  }
  static inline __m512 madd(__m512 acc, Raw w, Raw x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
  }
};

}  // namespace

ProductFn product_f32() { return &product<Tile<Float32>, float>; }
ProductFn product_bf16_widened() { return &product<Tile<Bf16Widened>, bf16_bits>; }
ProductFn product_bf16_dot() { return &product<Tile<Bf16Dot>, bf16_bits>; }

}  // namespace rows_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace rows_avx2 {
#define FEW_ROWS_BODY
#include __FILE__
#undef FEW_ROWS_BODY
}  // namespace rows_avx2
#pragma GCC pop_options

#endif  // MAGICDEC_X86

namespace rows_scalar {
#define FEW_ROWS_BODY
#include __FILE__
#undef FEW_ROWS_BODY
}  // namespace rows_scalar

// ---------------------------------------------------------------------------------------------
// Choosing a version, threads and the entry point.

namespace magicdec {

namespace {

struct LinearIsa {
  const char* name;
  ProductFn f32;
  ProductFn bf16;
};

std::vector<LinearIsa> linear_isas() {
  std::vector<LinearIsa> isas;
#ifdef MAGICDEC_X86
  // The names of slot_attention.cpp's instruction sets: "avx512bf16" multiplies bf16 pairs with
  // `vdpbf16ps`, "avx512" widens bf16 to float32.
  if (cpu_has_avx512_bf16()) {
    isas.push_back({"avx512bf16", rows_avx512::product_f32(), rows_avx512::product_bf16_dot()});
  }
  if (cpu_has_avx512()) {
    isas.push_back({"avx512", rows_avx512::product_f32(), rows_avx512::product_bf16_widened()});
  }
  if (cpu_has_avx2()) {
    isas.push_back({"avx2", rows_avx2::product_f32(), rows_avx2::product_bf16()});
  }
#endif
  isas.push_back({"scalar", rows_scalar::product_f32(), rows_scalar::product_bf16()});
  return isas;
}

}  // namespace

torch::Tensor few_rows_linear(const torch::Tensor& x, const torch::Tensor& weight,
                              torch::Tensor out, const std::string& isa) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && out.device().is_cpu(),
              "few_rows_linear: all tensors must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && out.dim() == 2,
              "few_rows_linear: x, weight and out must be 2-D");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "few_rows_linear: x must be float32 or bfloat16");
  TORCH_CHECK(weight.scalar_type() == dtype && out.scalar_type() == dtype,
              "few_rows_linear: x, weight and out must share a dtype");
  const int64_t num_rows = x.size(0), depth = x.size(1), num_out = weight.size(0);
  TORCH_CHECK(weight.size(1) == depth, "few_rows_linear: x and weight differ in K");
  TORCH_CHECK(out.size(0) == num_rows && out.size(1) == num_out,
              "few_rows_linear: out must be [x rows, weight rows]");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(),
              "few_rows_linear: x and out must be contiguous");
  TORCH_CHECK(weight.size(1) <= 1 || weight.stride(1) == 1,
              "few_rows_linear: weight rows must be contiguous");

  const std::vector<LinearIsa> isas = linear_isas();
  const LinearIsa* chosen = &isas.front();
  if (isa != "auto") {
    chosen = nullptr;
    for (const LinearIsa& candidate : isas) {
      if (isa == candidate.name) chosen = &candidate;
    }
    TORCH_CHECK(chosen, "few_rows_linear: instruction set '", isa, "' is not available here");
  }
  if (num_rows == 0 || num_out == 0) return out;
  const bool bf16 = dtype == at::kBFloat16;
  const ProductFn run = bf16 ? chosen->bf16 : chosen->f32;
  const int64_t weight_stride = num_out > 1 ? weight.stride(0) : depth;
  Operands<float> f32_ops{nullptr, nullptr, out.data_ptr(), num_rows, depth, weight_stride,
                          num_out};
  Operands<bf16_bits> bf16_ops{nullptr, nullptr, out.data_ptr(), num_rows, depth,
                               weight_stride, num_out};
  const void* ops;
  if (bf16) {
    bf16_ops.x = static_cast<const bf16_bits*>(x.data_ptr());
    bf16_ops.weight = static_cast<const bf16_bits*>(weight.data_ptr());
    ops = &bf16_ops;
  } else {
    f32_ops.x = x.data_ptr<float>();
    f32_ops.weight = weight.data_ptr<float>();
    ops = &f32_ops;
  }
  // Blocks of kBlockN weight rows, spread evenly; small products stay on one thread.
  const int64_t blocks = (num_out + kBlockN - 1) / kBlockN;
  const int64_t work = num_rows * depth * num_out;
  const int64_t grain = work < kMinParallelWork ? blocks : 1;
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    run(ops, bf16, begin * kBlockN, std::min(end * kBlockN, num_out));
  });
  return out;
}

}  // namespace magicdec

#else  // FEW_ROWS_BODY
// ---------------------------------------------------------------------------------------------
// The portable body: one tile of dot products accumulated in kLanes float lanes (which the
// compiler keeps in vector registers for the target it is compiled for), then summed across.
// Products and sums are rounded separately (no FMA contraction): how the compiler vectorises a
// tile depends on its size, and a fused multiply-add in one tile but not another would make a
// row's result depend on the rows beside it.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
namespace {

constexpr int kLanes = 8;

template <typename T>
struct Tile {
  // acc[i][j][l] += w_i[l] * x_j[l] for the kLanes elements at w and x.
  template <int NB, int MB>
  static inline void accumulate(float (&acc)[NB][MB][kLanes], const T* w, int64_t w_stride,
                                const T* x, int64_t x_stride) {
    for (int i = 0; i < NB; ++i) {
      for (int j = 0; j < MB; ++j) {
        for (int l = 0; l < kLanes; ++l) {
          acc[i][j][l] += to_float(w[i * w_stride + l]) * to_float(x[j * x_stride + l]);
        }
      }
    }
  }

  template <int NB, int MB>
  static inline void tile(const T* w, int64_t w_stride, const T* x, int64_t depth,
                          bool /*prefetch*/, float (&result)[NB][MB]) {
    float acc[NB][MB][kLanes] = {};
    int64_t k = 0;
    for (; k + kLanes <= depth; k += kLanes) accumulate(acc, w + k, w_stride, x + k, depth);
    if (k < depth) {  // the same code over zero-padded copies: each output's order stays fixed
      T w_tail[NB][kLanes] = {}, x_tail[MB][kLanes] = {};
      for (int l = 0; k + l < depth; ++l) {
        for (int i = 0; i < NB; ++i) w_tail[i][l] = w[i * w_stride + k + l];
        for (int j = 0; j < MB; ++j) x_tail[j][l] = x[j * depth + k + l];
      }
      accumulate(acc, &w_tail[0][0], kLanes, &x_tail[0][0], kLanes);
    }
    for (int i = 0; i < NB; ++i) {
      for (int j = 0; j < MB; ++j) {
        float sum = 0.0f;
        for (int l = 0; l < kLanes; ++l) sum += acc[i][j][l];
        result[i][j] = sum;
      }
    }
  }
};

}  // namespace

ProductFn product_f32() { return &product<Tile<float>, float>; }
ProductFn product_bf16() { return &product<Tile<bf16_bits>, bf16_bits>; }
#pragma GCC pop_options

#endif  // FEW_ROWS_BODY
