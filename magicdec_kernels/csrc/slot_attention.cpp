// Attention over explicit lists of KV-pool slots on CPU: decode, verify and the sparse draft.
// (Layout and semantics: magicdec_kernels/cpu_native.py.)
//
// At long context, decode and verify cost one read of every key and value a request attends to,
// so this kernel reads each (request, KV head)'s keys and values once for all of the request's
// query rows times the query heads of the GQA group (q_len x group rows, up to kMaxRows per
// task), straight from the pool by slot index, with an online softmax over blocks of two vectors
// of keys. Per block, the keys are transposed to [D, keys] in L1, so each row's scores are a few
// vectors of broadcast-FMAs over d, and each value row is loaded once for all rows of the task:
// both products are small GEMM micro-kernels with the accumulators in registers. With bf16
// queries and KV on a CPU with AVX512-BF16 ("avx512bf16"), both products are bf16 pair dot
// products instead (`Bf16Dot`): twice the multiply-adds per instruction, where verify's 12 rows
// per KV head are compute-bound.
//
// Work is split into (request, KV head, row tile, key chunk) tasks that threads pull from a shared
// counter inside at::parallel_for, so one long request still keeps every core streaming. Chunks of
// a row tile produce a normalised partial output and log-sum-exp each, merged exactly afterwards:
// out = sum_c exp(lse_c - lse) * out_c.
//
// The kernel body (the end of this file) is compiled three times, each time inside a namespace
// that defines `Ops` under a matching `#pragma GCC target`: AVX-512, AVX2+FMA and portable C++.
// The file includes itself for that (as Highway does), so the .so runs on any x86-64 machine
// (no -march=native) and picks the widest set the CPU has at run time.

#ifndef SLOT_ATTENTION_BODY

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "cpu_common.h"

namespace {

// Rows (q_len x group) one task computes per read of its keys: verify's 8 tokens x 4 heads.
constexpr int kMaxRows = 32;
// Widest vector (AVX-512 floats), and the largest block of keys (two vectors).
constexpr int kMaxWidth = 16;
constexpr int kMaxBlock = 2 * kMaxWidth;
// A key chunk is at least this long, so splitting a list never costs more than it saves.
constexpr int64_t kMinChunk = 256;
// Chunks are sized for about this many tasks per thread, for balance under ragged batches.
constexpr int kTasksPerThread = 4;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using magicdec::bf16_bits;

// Where the keys and values are: element pointers and strides (in elements) of the pool.
struct Pool {
  const void* k;
  const void* v;
  int64_t k_slot_stride, k_head_stride, v_slot_stride, v_head_stride;
  int64_t num_slots;
  int head_dim, v_dim;
};

// One thread's working set, reused across its tasks (a few tens of KiB: stays in L1/L2).
struct Scratch {
  float* q;    // [kMaxRows, D] the task's query rows, times scale * log2(e)
  float* kt;   // [D, KB] the block's keys, transposed
  float* s;    // [kMaxRows, KB] the block's scores, then its probabilities
  float* acc;  // [kMaxRows, Dv] un-normalised output rows
  float* l_lanes;  // [kMaxRows, W] running sums of 2^(score - m), spread over the lanes
  const void* zeros;  // max(D, Dv) zero floats: stands in for the missing keys of a last block
  // The bf16 dot-product path (both operands bf16): q as given, its scale applied to the scores;
  // keys as [D / 2, KB] pairs of dims (kt's storage), values as [KB / 2, Dv] pairs of keys.
  bf16_bits* q16;  // [kMaxRows, D]
  uint32_t* vt2;   // [KB / 2, Dv]
  float score_scale;  // scale * log2(e)
  // Scores are in log2 units: q is pre-multiplied by scale * log2(e).
  float m[kMaxRows];      // running max of each row's scores
  float l[kMaxRows];      // sum of 2^(score - m) (set at the end of a task)
  float alpha[kMaxRows];  // this block's rescale of acc: 2^(m_old - m_new)
  int64_t visible[kMaxRows];  // keys of the list row r may see (causal, aligned to the end)
  int64_t max_visible;

  std::unique_ptr<float, decltype(&std::free)> storage{nullptr, &std::free};

  Scratch(int head_dim, int v_dim) {
    const size_t q_n = size_t(kMaxRows) * head_dim, kt_n = size_t(head_dim) * kMaxBlock;
    const size_t s_n = size_t(kMaxRows) * kMaxBlock, acc_n = size_t(kMaxRows) * v_dim;
    const size_t l_n = size_t(kMaxRows) * kMaxWidth, zeros_n = std::max(head_dim, v_dim);
    const size_t q16_n = q_n / 2, vt2_n = size_t(kMaxBlock / 2) * v_dim;
    const size_t total = q_n + kt_n + s_n + acc_n + l_n + zeros_n + q16_n + vt2_n;
    // Every piece is a multiple of 16 floats, so 64-byte alignment of the whole aligns each.
    storage.reset(static_cast<float*>(std::aligned_alloc(64, total * sizeof(float))));
    TORCH_CHECK(storage, "slot_attention: out of memory for scratch");
    q = storage.get();
    kt = q + q_n;
    s = kt + kt_n;
    acc = s + s_n;
    l_lanes = acc + acc_n;
    float* zero_floats = l_lanes + l_n;
    std::fill(zero_floats, zero_floats + zeros_n, 0.0f);
    zeros = zero_floats;
    q16 = reinterpret_cast<bf16_bits*>(zero_floats + zeros_n);
    vt2 = reinterpret_cast<uint32_t*>(zero_floats + zeros_n + q16_n);
  }
};

// Attend rows [0, rows) of the scratch over list[key_begin:key_end) of KV head `head`, leaving
// acc (un-normalised), m and l. False if a slot was outside the pool (read as a zero key).
using AttendFn = bool (*)(const Pool&, const int64_t* list, int64_t list_stride, int64_t head,
                          int rows, int64_t key_begin, int64_t key_end, Scratch& sc);

}  // namespace

// ---------------------------------------------------------------------------------------------
// Instruction sets. Each defines Ops: W floats per vector and the handful of operations the
// kernel body uses, then compiles the body under the same target.

#ifdef MAGICDEC_X86

#pragma GCC push_options
// avx512bf16 only for the intrinsics of `Bf16Dot`, taken where the CPU has them (the body holds
// no float-to-bf16 conversion the compiler could turn into one).
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
namespace slot_avx512 {
namespace {

struct Ops {
  static constexpr int W = 16;
  static constexpr int kRegisters = 32;
  static constexpr int kTileRows = 12;  // 24 accumulators + 3 of the 32 registers
  using V = __m512;
  static inline V zero() { return _mm512_setzero_ps(); }
  static inline V set1(float x) { return _mm512_set1_ps(x); }
  static inline V load(const float* p) { return _mm512_loadu_ps(p); }
  static inline V load(const bf16_bits* p) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  }
  static inline void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  static inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static inline V add(V a, V b) { return _mm512_add_ps(a, b); }
  static inline V max(V a, V b) { return _mm512_max_ps(a, b); }
  static inline bool any_greater(V x, float m) {
    return _mm512_cmp_ps_mask(x, _mm512_set1_ps(m), _CMP_GT_OQ) != 0;
  }
  static inline float hmax(V x) { return _mm512_reduce_max_ps(x); }
  static inline float hsum(V x) { return _mm512_reduce_add_ps(x); }
  // Lanes n.. replaced by `fill` (any n: <= 0 replaces all, >= W none).
  static inline V keep_first(V x, int n, float fill) {
    const __mmask16 keep = __mmask16((1u << std::clamp(n, 0, W)) - 1);
    return _mm512_mask_blend_ps(keep, _mm512_set1_ps(fill), x);
  }
  // 2^x to ~2 ulp: 2^n * (Taylor series of 2^r, |r| <= 1/2, degree 6). Large negative x and
  // -inf give 0 (scalef); the kernel only passes x <= 0.
  static inline V exp2(V x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));
    const V n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const V r = _mm512_sub_ps(x, n);
    V p = _mm512_set1_ps(1.540353039338161e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.333355814642844e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.618129107628477e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.550410866482158e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.402265069591007e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.931471805599453e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
  }
  // t[i][j] <- t[j][i] for a 16 x 16 block.
  __attribute__((always_inline)) static inline void transpose(V (&t)[W]) {
    __m512 u[16], v[16];
    for (int i = 0; i < 16; i += 4) {
      const __m512 a0 = _mm512_unpacklo_ps(t[i], t[i + 1]);
      const __m512 a1 = _mm512_unpackhi_ps(t[i], t[i + 1]);
      const __m512 a2 = _mm512_unpacklo_ps(t[i + 2], t[i + 3]);
      const __m512 a3 = _mm512_unpackhi_ps(t[i + 2], t[i + 3]);
      // u[i + c], lane L: column 4L + c of rows i .. i+3.
      u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a0), _mm512_castps_pd(a2)));
      u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a0), _mm512_castps_pd(a2)));
      u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a1), _mm512_castps_pd(a3)));
      u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a1), _mm512_castps_pd(a3)));
    }
    for (int base = 0; base < 16; base += 8) {
      for (int c = 0; c < 4; ++c) {
        v[base + c] = _mm512_shuffle_f32x4(u[base + c], u[base + c + 4], 0x88);
        v[base + c + 4] = _mm512_shuffle_f32x4(u[base + c], u[base + c + 4], 0xdd);
      }
    }
    for (int c = 0; c < 4; ++c) {
      t[c] = _mm512_shuffle_f32x4(v[c], v[c + 8], 0x88);
      t[c + 4] = _mm512_shuffle_f32x4(v[c + 4], v[c + 12], 0x88);
      t[c + 8] = _mm512_shuffle_f32x4(v[c], v[c + 8], 0xdd);
      t[c + 12] = _mm512_shuffle_f32x4(v[c + 4], v[c + 12], 0xdd);
    }
  }
  static inline void prefetch(const void* p) {  // into L2
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
  }
};

#define SLOT_ATTENTION_BODY
#include __FILE__
#undef SLOT_ATTENTION_BODY

// bf16 queries and KV with AVX512-BF16: both products as dot products of bf16 pairs
// (`vdpbf16ps`: per float32 lane, two exact products added to the accumulator), twice the
// multiply-adds per instruction of the widened FMAs and half the transposing. Keys are
// transposed in pairs of dims, values interleaved in pairs of keys. q is used as given, its scale
// applied to the float32 scores; the probabilities are rounded to bf16 for the value product, as
// GPU flash attention does (a relative 2^-9 per probability; softmax and its sums stay float32).
struct Bf16Dot {
  using T = bf16_bits;

  static inline __m512 dot(__m512 acc, __m512i pairs, __m512i broadcast) {
    return _mm512_dpbf16_ps(acc, (__m512bh)pairs, (__m512bh)broadcast);
  }
  static inline __m512i load_pairs(const void* p) { return _mm512_loadu_si512(p); }
  // The block's probabilities in place of their scores, as bf16 pairs of keys: [rows, KB / 2].
  static inline const uint32_t* probability_pairs(Scratch& sc, int r) {
    return reinterpret_cast<const uint32_t*>(sc.s + r * KB);
  }

  static inline void scores(const bf16_bits* const* kp, int D, int rows, Scratch& sc) {
    // kt2[d2, j] = dims 2 d2 and 2 d2 + 1 of key j: a 16 x 16 transpose of 32-bit pairs.
    uint32_t* kt2 = reinterpret_cast<uint32_t*>(sc.kt);
    for (int half = 0; half < KB; half += W) {
      for (int d0 = 0; d0 < D; d0 += 2 * W) {
        V t[W];
        for (int j = 0; j < W; ++j) t[j] = _mm512_castsi512_ps(load_pairs(kp[half + j] + d0));
        Ops::transpose(t);
        for (int i = 0; i < W; ++i) Ops::store(reinterpret_cast<float*>(kt2 + (d0 / 2 + i) * KB + half), t[i]);
      }
    }
    int r = 0;
    for (; r + kTileRows <= rows; r += kTileRows) score_tile<kTileRows>(kt2, D, r, sc);
    with_rows<kTileRows - 1>(rows - r, [&](auto nr) { score_tile<nr()>(kt2, D, r, sc); });
  }

  template <int NR>
  static inline void score_tile(const uint32_t* kt2, int D, int r0, Scratch& sc) {
    // Few rows (decode): even and odd pairs in separate accumulators, for enough independent
    // chains to hide the dot product's latency.
    constexpr int NA = NR <= 3 ? 2 : 1;
    const int pairs = D / 2;
    const uint32_t* q = reinterpret_cast<const uint32_t*>(sc.q16 + r0 * D);
    __m512 acc[NA][NR][2];
    for (int a = 0; a < NA; ++a)
      for (int r = 0; r < NR; ++r) acc[a][r][0] = acc[a][r][1] = _mm512_setzero_ps();
    for (int d2 = 0; d2 < pairs; d2 += NA) {
      for (int a = 0; a < NA; ++a) {
        const __m512i k0 = load_pairs(kt2 + (d2 + a) * KB), k1 = load_pairs(kt2 + (d2 + a) * KB + W);
        for (int r = 0; r < NR; ++r) {
          const __m512i qr = _mm512_set1_epi32(int(q[r * pairs + d2 + a]));
          acc[a][r][0] = dot(acc[a][r][0], k0, qr);
          acc[a][r][1] = dot(acc[a][r][1], k1, qr);
        }
      }
    }
    const __m512 scale = _mm512_set1_ps(sc.score_scale);
    for (int r = 0; r < NR; ++r) {
      if constexpr (NA == 2) {
        acc[0][r][0] = _mm512_add_ps(acc[0][r][0], acc[1][r][0]);
        acc[0][r][1] = _mm512_add_ps(acc[0][r][1], acc[1][r][1]);
      }
      Ops::store(sc.s + (r0 + r) * KB, _mm512_mul_ps(acc[0][r][0], scale));
      Ops::store(sc.s + (r0 + r) * KB + W, _mm512_mul_ps(acc[0][r][1], scale));
    }
  }

  template <bool kRescale>
  static inline void values(const bf16_bits* const* vp, int nk, int Dv, int rows, Scratch& sc) {
    // vt2[m, c] = (v[2m, c], v[2m + 1, c]): word 2i of a vector from the first row, 2i + 1 from
    // the second (a key past nk reads zeros, with probability 0).
    alignas(64) static constexpr uint16_t kInterleave[32] = {
        0, 32, 1, 33, 2, 34, 3, 35, 4,  36, 5,  37, 6,  38, 7,  39,
        8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
    const __m512i interleave = _mm512_load_si512(kInterleave);
    const int pairs = (nk + 1) / 2;
    for (int m = 0; m < pairs; ++m) {
      for (int c = 0; c < Dv; c += W) {
        const __m512i first =
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vp[2 * m] + c)));
        const __m512i second = _mm512_castsi256_si512(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vp[2 * m + 1] + c)));
        _mm512_storeu_si512(sc.vt2 + m * Dv + c, _mm512_permutex2var_epi16(first, interleave, second));
      }
    }
    for (int r = 0; r < rows; ++r) {
      float* p = sc.s + r * KB;
      const __m512bh rounded = _mm512_cvtne2ps_pbh(Ops::load(p + W), Ops::load(p));
      _mm512_storeu_si512(p, (__m512i)rounded);
    }
    int r = 0;
    for (; r + kTileRows <= rows; r += kTileRows) value_tile<kTileRows, kRescale>(pairs, Dv, r, sc);
    with_rows<kTileRows - 1>(rows - r, [&](auto nr) { value_tile<nr(), kRescale>(pairs, Dv, r, sc); });
  }

  template <int NR, bool kRescale>
  static inline void value_tile(int pairs, int Dv, int r0, Scratch& sc) {
    int c = 0;
    // Few rows (decode): four vectors of columns at once, for more independent chains.
    if constexpr (NR <= 3) {
      for (; c + 4 * W <= Dv; c += 4 * W) value_chunk<NR, 4, kRescale>(pairs, Dv, c, r0, sc);
    }
    for (; c + 2 * W <= Dv; c += 2 * W) value_chunk<NR, 2, kRescale>(pairs, Dv, c, r0, sc);
    if (c < Dv) value_chunk<NR, 1, kRescale>(pairs, Dv, c, r0, sc);
  }

  template <int NR, int NC, bool kRescale>
  static inline void value_chunk(int pairs, int Dv, int c, int r0, Scratch& sc) {
    float* acc = sc.acc + r0 * Dv;
    __m512 a[NR][NC];
    for (int r = 0; r < NR; ++r) {
      for (int i = 0; i < NC; ++i) {
        a[r][i] = Ops::load(acc + r * Dv + c + i * W);
        if constexpr (kRescale) a[r][i] = _mm512_mul_ps(a[r][i], _mm512_set1_ps(sc.alpha[r0 + r]));
      }
    }
    for (int m = 0; m < pairs; ++m) {
      __m512i v[NC];
      for (int i = 0; i < NC; ++i) v[i] = load_pairs(sc.vt2 + m * Dv + c + i * W);
      for (int r = 0; r < NR; ++r) {
        const __m512i pr = _mm512_set1_epi32(int(probability_pairs(sc, r0 + r)[m]));
        for (int i = 0; i < NC; ++i) a[r][i] = dot(a[r][i], v[i], pr);
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < NC; ++i) Ops::store(acc + r * Dv + c + i * W, a[r][i]);
  }
};

bool attend_bf16_dot(const Pool& pool, const int64_t* list, int64_t list_stride, int64_t head,
                     int rows, int64_t key_begin, int64_t key_end, Scratch& sc) {
  return attend_with<Bf16Dot>(pool, list, list_stride, head, rows, key_begin, key_end, sc);
}

}  // namespace
}  // namespace slot_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace slot_avx2 {
namespace {

struct Ops {
  static constexpr int W = 8;
  static constexpr int kRegisters = 16;
  static constexpr int kTileRows = 6;  // 12 accumulators + 3 of the 16 registers
  using V = __m256;
  static inline V zero() { return _mm256_setzero_ps(); }
  static inline V set1(float x) { return _mm256_set1_ps(x); }
  static inline V load(const float* p) { return _mm256_loadu_ps(p); }
  static inline V load(const bf16_bits* p) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
  }
  static inline void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  static inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static inline V add(V a, V b) { return _mm256_add_ps(a, b); }
  static inline V max(V a, V b) { return _mm256_max_ps(a, b); }
  static inline bool any_greater(V x, float m) {
    return _mm256_movemask_ps(_mm256_cmp_ps(x, _mm256_set1_ps(m), _CMP_GT_OQ)) != 0;
  }
  static inline float hmax(V x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
  }
  static inline float hsum(V x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static inline V keep_first(V x, int n, float fill) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes));
    return _mm256_blendv_ps(_mm256_set1_ps(fill), x, keep);
  }
  // 2^x to ~2 ulp: 2^n * (Taylor series of 2^r, |r| <= 1/2, degree 6). x below -126 (and -inf)
  // clamps to 2^-126, which the kernel masks to 0 where it matters (keys a row may not see).
  static inline V exp2(V x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-126.0f)), _mm256_set1_ps(127.0f));
    const V n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const V r = _mm256_sub_ps(x, n);
    V p = _mm256_set1_ps(1.540353039338161e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.333355814642844e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(9.618129107628477e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.550410866482158e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(2.402265069591007e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(6.931471805599453e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i pow2 = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2));
  }
  // t[i][j] <- t[j][i] for an 8 x 8 block.
  __attribute__((always_inline)) static inline void transpose(V (&t)[W]) {
    __m256 u[8];
    for (int i = 0; i < 8; i += 4) {
      const __m256 a0 = _mm256_unpacklo_ps(t[i], t[i + 1]);
      const __m256 a1 = _mm256_unpackhi_ps(t[i], t[i + 1]);
      const __m256 a2 = _mm256_unpacklo_ps(t[i + 2], t[i + 3]);
      const __m256 a3 = _mm256_unpackhi_ps(t[i + 2], t[i + 3]);
      u[i] = _mm256_shuffle_ps(a0, a2, 0x44);
      u[i + 1] = _mm256_shuffle_ps(a0, a2, 0xEE);
      u[i + 2] = _mm256_shuffle_ps(a1, a3, 0x44);
      u[i + 3] = _mm256_shuffle_ps(a1, a3, 0xEE);
    }
    for (int c = 0; c < 4; ++c) {
      t[c] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x20);
      t[c + 4] = _mm256_permute2f128_ps(u[c], u[c + 4], 0x31);
    }
  }
  static inline void prefetch(const void* p) {  // into L2
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1);
  }
};

#define SLOT_ATTENTION_BODY
#include __FILE__
#undef SLOT_ATTENTION_BODY

}  // namespace
}  // namespace slot_avx2
#pragma GCC pop_options

#endif  // MAGICDEC_X86

namespace slot_scalar {
namespace {

// Plain C++ (the compiler vectorises what it can for the baseline target).
struct Ops {
  static constexpr int W = 8;
  static constexpr int kRegisters = 16;
  static constexpr int kTileRows = 6;
  struct V {
    float x[W];
  };
  static inline V zero() { return set1(0.0f); }
  static inline V set1(float a) {
    V r;
    for (int i = 0; i < W; ++i) r.x[i] = a;
    return r;
  }
  static inline V load(const float* p) {
    V r;
    std::memcpy(r.x, p, sizeof(r.x));
    return r;
  }
  static inline V load(const bf16_bits* p) {
    V r;
    for (int i = 0; i < W; ++i) {
      const uint32_t bits = uint32_t(p[i]) << 16;
      std::memcpy(&r.x[i], &bits, sizeof(float));
    }
    return r;
  }
  static inline void store(float* p, const V& a) { std::memcpy(p, a.x, sizeof(a.x)); }
  static inline V fma(const V& a, const V& b, V c) {
    for (int i = 0; i < W; ++i) c.x[i] += a.x[i] * b.x[i];
    return c;
  }
  static inline V mul(V a, const V& b) {
    for (int i = 0; i < W; ++i) a.x[i] *= b.x[i];
    return a;
  }
  static inline V sub(V a, const V& b) {
    for (int i = 0; i < W; ++i) a.x[i] -= b.x[i];
    return a;
  }
  static inline V add(V a, const V& b) {
    for (int i = 0; i < W; ++i) a.x[i] += b.x[i];
    return a;
  }
  static inline V max(V a, const V& b) {
    for (int i = 0; i < W; ++i) a.x[i] = std::max(a.x[i], b.x[i]);
    return a;
  }
  static inline bool any_greater(const V& a, float m) {
    bool any = false;
    for (int i = 0; i < W; ++i) any |= a.x[i] > m;
    return any;
  }
  static inline float hmax(const V& a) { return *std::max_element(a.x, a.x + W); }
  static inline float hsum(const V& a) {
    float s = 0.0f;
    for (int i = 0; i < W; ++i) s += a.x[i];
    return s;
  }
  static inline V keep_first(V a, int n, float fill) {
    for (int i = std::max(n, 0); i < W; ++i) a.x[i] = fill;
    return a;
  }
  static inline V exp2(V a) {
    for (int i = 0; i < W; ++i) a.x[i] = std::exp2(a.x[i]);
    return a;
  }
  __attribute__((always_inline)) static inline void transpose(V (&t)[W]) {
    for (int i = 0; i < W; ++i)
      for (int j = i + 1; j < W; ++j) std::swap(t[i].x[j], t[j].x[i]);
  }
  static inline void prefetch(const void*) {}
};

#define SLOT_ATTENTION_BODY
#include __FILE__
#undef SLOT_ATTENTION_BODY

}  // namespace
}  // namespace slot_scalar

// ---------------------------------------------------------------------------------------------
// Planning, threads, merging and the entry point (instruction-set independent; the Python
// binding is in module.cpp).

namespace {

struct Isa {
  const char* name;
  AttendFn attend_f32;
  AttendFn attend_bf16;
  AttendFn attend_bf16_dot;  // bf16 queries and KV, head dim a multiple of 32; or null
};

std::vector<Isa> supported_isas() {
  std::vector<Isa> isas;
#ifdef MAGICDEC_X86
  if (magicdec::cpu_has_avx512_bf16()) {
    isas.push_back({"avx512bf16", &slot_avx512::attend<float>, &slot_avx512::attend<bf16_bits>,
                    &slot_avx512::attend_bf16_dot});
  }
  if (magicdec::cpu_has_avx512()) {
    isas.push_back(
        {"avx512", &slot_avx512::attend<float>, &slot_avx512::attend<bf16_bits>, nullptr});
  }
  if (magicdec::cpu_has_avx2()) {
    isas.push_back({"avx2", &slot_avx2::attend<float>, &slot_avx2::attend<bf16_bits>, nullptr});
  }
#endif
  isas.push_back(
      {"scalar", &slot_scalar::attend<float>, &slot_scalar::attend<bf16_bits>, nullptr});
  return isas;
}

// A piece of work: rows [row_begin, row_end) (row = token * group + head in group) of request b,
// KV head h, over keys [key_begin, key_end) of its list.
struct Task {
  int64_t b, h;
  int row_begin, row_end;
  int64_t key_begin, key_end;
  int64_t part_row;  // first row of this chunk in the partial buffers; -1: write `out` directly
};

// A row tile whose keys were split into chunks: its partial rows are merged into `out`.
struct Split {
  int64_t b, h;
  int row_begin, row_end;
  int64_t part_row;  // chunk c's rows start at part_row + c * (row_end - row_begin)
  int chunks;
};

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

template <typename T>
void store_row(T* dst, const float* src, int n, float factor) {
  for (int i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i] * factor);
}

template <typename QT>
void run_all(const torch::Tensor& q, const Pool& pool, const torch::Tensor& head_slots,
             const std::vector<int64_t>& q_start, const std::vector<int64_t>& q_len,
             const std::vector<int64_t>& kv_len, int64_t num_kv_heads, int group, float scale,
             torch::Tensor& out, AttendFn attend, bool bf16_dot) {
  const int64_t batch = int64_t(q_len.size());
  const int D = pool.head_dim, Dv = pool.v_dim;
  const int threads = std::max(1, at::get_num_threads());
  const float scale_log2 = scale * 1.4426950408889634f;  // scores in log2 units: exp2 is cheaper

  // Row tiles of at most kMaxRows rows, balanced in size.
  std::vector<Task> tiles;
  int64_t total_keys = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t rows = q_len[b] * group;
    if (rows == 0) continue;
    const int64_t n_tiles = (rows + kMaxRows - 1) / kMaxRows;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      for (int64_t t = 0; t < n_tiles; ++t) {
        const int row_begin = int(rows * t / n_tiles), row_end = int(rows * (t + 1) / n_tiles);
        const int64_t last_token = (row_end - 1) / group;
        const int64_t keys =
            std::clamp<int64_t>(kv_len[b] - q_len[b] + last_token + 1, 0, kv_len[b]);
        tiles.push_back({b, h, row_begin, row_end, 0, keys, -1});
        total_keys += keys;
      }
    }
  }

  // Split long lists so that there are about kTasksPerThread tasks per thread.
  const int64_t target = int64_t(threads) * kTasksPerThread;
  const int64_t chunk_len = std::max(kMinChunk, (total_keys + target - 1) / target);
  std::vector<Task> tasks;
  std::vector<Split> splits;
  int64_t part_rows = 0;
  for (const Task& tile : tiles) {
    const int64_t chunks = std::max<int64_t>(1, tile.key_end / chunk_len);
    if (chunks == 1) {
      tasks.push_back(tile);
      continue;
    }
    const int rows = tile.row_end - tile.row_begin;
    splits.push_back({tile.b, tile.h, tile.row_begin, tile.row_end, part_rows, int(chunks)});
    // Chunk boundaries on whole blocks of keys, so only the last chunk has a partial block.
    const int64_t step = (tile.key_end + chunks * kMaxBlock - 1) / (chunks * kMaxBlock) * kMaxBlock;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t begin = std::min(c * step, tile.key_end);
      const int64_t end = std::min(begin + step, tile.key_end);
      tasks.push_back({tile.b, tile.h, tile.row_begin, tile.row_end, begin, end, part_rows});
      part_rows += rows;
    }
  }
  // Largest first (cost ~ keys x (rows + the per-key work independent of rows)), so the
  // threads pulling tasks finish together.
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) {
    return (x.key_end - x.key_begin) * (x.row_end - x.row_begin + 8) >
           (y.key_end - y.key_begin) * (y.row_end - y.row_begin + 8);
  });

  // Each chunk's normalised output rows and log-sum-exp (log2 units).
  std::vector<float> part_out(size_t(part_rows) * Dv), part_lse(part_rows);
  const QT* q_data = q.data_ptr<QT>();
  QT* out_data = out.data_ptr<QT>();
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1), o_s0 = out.stride(0), o_s1 = out.stride(1);
  const int64_t* slots_data = head_slots.data_ptr<int64_t>();
  const int64_t sl_s0 = head_slots.stride(0), sl_s2 = head_slots.stride(2);
  const int64_t sl_s1 = head_slots.size(1) == 1 ? 0 : head_slots.stride(1);

  auto run_task = [&](const Task& task, Scratch& sc) -> bool {
    const int rows = task.row_end - task.row_begin;
    const int64_t b = task.b;
    sc.max_visible = 0;
    sc.score_scale = scale_log2;
    for (int r = 0; r < rows; ++r) {
      const int64_t row = task.row_begin + r, token = row / group;
      const int64_t head = task.h * group + row % group;
      const QT* src = q_data + (q_start[b] + token) * q_s0 + head * q_s1;
      if constexpr (std::is_same_v<QT, c10::BFloat16>) {
        if (bf16_dot) {
          for (int d = 0; d < D; ++d) sc.q16[r * D + d] = src[d].x;
        }
      }
      if (!bf16_dot) {
        for (int d = 0; d < D; ++d) sc.q[r * D + d] = to_float(src[d]) * scale_log2;
      }
      sc.visible[r] = std::clamp<int64_t>(kv_len[b] - q_len[b] + token + 1, 0, kv_len[b]);
      sc.max_visible = std::max(sc.max_visible, sc.visible[r]);
      sc.m[r] = kNegInf;
      sc.l[r] = 0.0f;
    }
    std::fill(sc.acc, sc.acc + size_t(rows) * Dv, 0.0f);
    const int64_t* list = slots_data + b * sl_s0 + task.h * sl_s1;
    const bool ok = attend(pool, list, sl_s2, task.h, rows, task.key_begin, task.key_end, sc);
    for (int r = 0; r < rows; ++r) {
      const float* acc = sc.acc + size_t(r) * Dv;
      const bool seen = sc.l[r] > 0.0f;
      const float inv = seen ? 1.0f / sc.l[r] : 0.0f;
      if (task.part_row < 0) {
        const int64_t row = task.row_begin + r, token = row / group;
        const int64_t head = task.h * group + row % group;
        store_row(out_data + (q_start[b] + token) * o_s0 + head * o_s1, acc, Dv, inv);
      } else {
        store_row(part_out.data() + size_t(task.part_row + r) * Dv, acc, Dv, inv);
        part_lse[task.part_row + r] = seen ? sc.m[r] + std::log2(sc.l[r]) : kNegInf;
      }
    }
    return ok;
  };

  std::atomic<int64_t> next{0};
  std::atomic<bool> bad_slot{false};
  const int64_t n_tasks = int64_t(tasks.size());
  // Each thread pulls tasks until none are left: dynamic balance over the static split of
  // at::parallel_for (a nested call runs inline, and then one "thread" takes everything).
  at::parallel_for(0, std::min<int64_t>(threads, n_tasks), 1, [&](int64_t, int64_t) {
    Scratch sc(D, Dv);
    for (int64_t i = next.fetch_add(1); i < n_tasks; i = next.fetch_add(1)) {
      if (!run_task(tasks[i], sc)) bad_slot.store(true);
    }
  });
  TORCH_CHECK(!bad_slot.load(), "slot_attention: head_slots holds a slot outside the KV pool");

  // Merge the chunks of each split row tile: out = sum_c 2^(lse_c - lse) out_c (log2 units).
  std::vector<float> merged(Dv);
  for (const Split& split : splits) {
    const int rows = split.row_end - split.row_begin;
    for (int r = 0; r < rows; ++r) {
      float top = kNegInf;
      for (int c = 0; c < split.chunks; ++c) {
        top = std::max(top, part_lse[split.part_row + int64_t(c) * rows + r]);
      }
      std::fill(merged.begin(), merged.end(), 0.0f);
      float total = 0.0f;
      if (top > kNegInf) {
        for (int c = 0; c < split.chunks; ++c) {
          const int64_t part = split.part_row + int64_t(c) * rows + r;
          const float w = std::exp2(part_lse[part] - top);
          total += w;
          const float* src = part_out.data() + size_t(part) * Dv;
          for (int d = 0; d < Dv; ++d) merged[d] += w * src[d];
        }
      }
      const int64_t row = split.row_begin + r, token = row / group;
      const int64_t head = split.h * group + row % group;
      QT* dst = out_data + (q_start[split.b] + token) * o_s0 + head * o_s1;
      store_row(dst, merged.data(), Dv, total > 0.0f ? 1.0f / total : 0.0f);
    }
  }
}

}  // namespace

namespace magicdec {

std::string best_isa() { return supported_isas().front().name; }

std::vector<std::string> isa_names() {
  std::vector<std::string> names;
  for (const Isa& isa : supported_isas()) names.emplace_back(isa.name);
  return names;
}

torch::Tensor slot_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                             const torch::Tensor& v_cache, const torch::Tensor& q_indptr,
                             const torch::Tensor& head_slots, const torch::Tensor& kv_lens,
                             double scale, torch::Tensor out, const std::string& isa) {
  using TensorList = std::initializer_list<const torch::Tensor*>;
  for (const torch::Tensor* t : TensorList{&q, &k_cache, &v_cache, &q_indptr, &head_slots,
                                           &kv_lens, &out}) {
    TORCH_CHECK(t->device().is_cpu(), "slot_attention: all tensors must be on the CPU");
  }
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3 && out.dim() == 3,
              "slot_attention: q, k_cache, v_cache and out must be 3-D");
  const auto q_type = q.scalar_type(), kv_type = k_cache.scalar_type();
  TORCH_CHECK(q_type == at::kFloat || q_type == at::kBFloat16,
              "slot_attention: q must be float32 or bfloat16");
  TORCH_CHECK(kv_type == at::kFloat || kv_type == at::kBFloat16,
              "slot_attention: the KV cache must be float32 or bfloat16");
  TORCH_CHECK(v_cache.scalar_type() == kv_type,
              "slot_attention: k_cache and v_cache dtypes differ");
  TORCH_CHECK(out.scalar_type() == q_type, "slot_attention: out must have q's dtype");
  const int64_t num_q = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_slots = k_cache.size(0), num_kv_heads = k_cache.size(1);
  const int64_t v_dim = v_cache.size(2);
  TORCH_CHECK(k_cache.size(2) == head_dim, "slot_attention: q and k_cache head dims differ");
  TORCH_CHECK(v_cache.size(0) == num_slots && v_cache.size(1) == num_kv_heads,
              "slot_attention: k_cache and v_cache pools differ in shape");
  TORCH_CHECK(head_dim % 16 == 0 && v_dim % 16 == 0 && head_dim > 0 && v_dim > 0,
              "slot_attention: head dims must be positive multiples of 16");
  TORCH_CHECK(num_kv_heads > 0 && num_q_heads % num_kv_heads == 0,
              "slot_attention: query heads must be a multiple of KV heads");
  TORCH_CHECK(out.size(0) == num_q && out.size(1) == num_q_heads && out.size(2) == v_dim,
              "slot_attention: out must be [num_q, num_q_heads, v_dim]");
  for (const torch::Tensor* t : TensorList{&q, &k_cache, &v_cache, &out}) {
    TORCH_CHECK(t->size(2) <= 1 || t->stride(2) == 1,
                "slot_attention: the last dim of q, k_cache, v_cache and out must be contiguous");
  }
  TORCH_CHECK(q_indptr.scalar_type() == at::kLong && kv_lens.scalar_type() == at::kLong &&
                  head_slots.scalar_type() == at::kLong,
              "slot_attention: q_indptr, head_slots and kv_lens must be int64");
  const int64_t batch = kv_lens.numel();
  TORCH_CHECK(q_indptr.dim() == 1 && q_indptr.numel() == batch + 1,
              "slot_attention: q_indptr must be [batch + 1]");
  TORCH_CHECK(head_slots.dim() == 3 && head_slots.size(0) == batch &&
                  (head_slots.size(1) == num_kv_heads || head_slots.size(1) == 1),
              "slot_attention: head_slots must be [batch, num_kv_heads or 1, width]");

  const torch::Tensor indptr_c = q_indptr.contiguous(), lens_c = kv_lens.contiguous();
  const int64_t* indptr = indptr_c.data_ptr<int64_t>();
  const int64_t* lens = lens_c.data_ptr<int64_t>();
  std::vector<int64_t> q_start(batch), q_len(batch), kv_len(batch);
  for (int64_t b = 0; b < batch; ++b) {
    q_start[b] = indptr[b];
    q_len[b] = indptr[b + 1] - indptr[b];
    kv_len[b] = lens[b];
    TORCH_CHECK(q_len[b] >= 0 && q_start[b] >= 0 && indptr[b + 1] <= num_q,
                "slot_attention: q_indptr must be non-decreasing within q's rows");
    TORCH_CHECK(kv_len[b] >= 0 && kv_len[b] <= head_slots.size(2),
                "slot_attention: kv_lens must lie in [0, head_slots.size(2)]");
  }

  const std::vector<Isa> isas = supported_isas();
  const Isa* chosen = &isas.front();
  if (isa != "auto") {
    chosen = nullptr;
    for (const Isa& candidate : isas) {
      if (isa == candidate.name) chosen = &candidate;
    }
    TORCH_CHECK(chosen, "slot_attention: instruction set '", isa, "' is not available here");
  }
  const Pool pool{k_cache.data_ptr(),   v_cache.data_ptr(),   k_cache.stride(0),
                  k_cache.stride(1),    v_cache.stride(0),    v_cache.stride(1),
                  num_slots,            int(head_dim),        int(v_dim)};
  const bool bf16_dot = chosen->attend_bf16_dot != nullptr && q_type == at::kBFloat16 &&
                        kv_type == at::kBFloat16 && head_dim % 32 == 0;
  const AttendFn attend = bf16_dot              ? chosen->attend_bf16_dot
                          : kv_type == at::kFloat ? chosen->attend_f32
                                                  : chosen->attend_bf16;
  const int group = int(num_q_heads / num_kv_heads);
  const float scale_f = float(scale);
  if (q_type == at::kFloat) {
    run_all<float>(q, pool, head_slots, q_start, q_len, kv_len, num_kv_heads, group, scale_f, out,
                   attend, bf16_dot);
  } else {
    run_all<c10::BFloat16>(q, pool, head_slots, q_start, q_len, kv_len, num_kv_heads, group,
                           scale_f, out, attend, bf16_dot);
  }
  return out;
}

}  // namespace magicdec

#else  // SLOT_ATTENTION_BODY
// ---------------------------------------------------------------------------------------------
// The kernel body. Included once per instruction set, inside a namespace that defines `Ops`.
// Scores are in log2 units (q carries scale * log2(e)), so the softmax needs only exp2.

constexpr int W = Ops::W;
// Keys per block: two vectors, so that every broadcast feeds two FMAs in both products (as in
// a GEMM micro-kernel: loads, not FMAs, would otherwise bound the kernel).
constexpr int KB = 2 * W;
// Rows per register tile: 2 * kTileRows accumulators, two loaded vectors and a broadcast.
constexpr int kTileRows = Ops::kTileRows;
// How far ahead of the current block keys and values are prefetched, into L2 (64 keys: 32 KiB
// at D = 64 in float32). Measured here: decode and verify ~20% faster than without, over
// contiguous and scattered slots alike; 128 or 256 keys ahead are no better.
constexpr int64_t kPrefetchKeys = 64;
using V = Ops::V;

// Calls f(std::integral_constant<int, n>) for a run-time 1 <= n <= N: the row count of a tile
// becomes a compile-time constant, so its accumulators live in registers.
template <int N, typename F>
inline void with_rows(int n, F&& f) {
  if constexpr (N > 0) {
    if (n == N) {
      f(std::integral_constant<int, N>{});
    } else {
      with_rows<N - 1>(n, f);
    }
  }
}

// s[r, :] = q[r, :] . kt (the KB scores of row r) for NR rows.
template <int NR>
inline void score_tile(const float* q, int D, const float* kt, float* s) {
  // Few rows (decode: 2 x NR < 8 FMA chains): even and odd d in separate accumulators, for
  // enough independent chains to hide the FMA latency, where the registers allow.
  constexpr int NA = NR <= 3 && 2 * 2 * NR + 3 <= Ops::kRegisters ? 2 : 1;
  V acc[NA][NR][2];
  for (int a = 0; a < NA; ++a)
    for (int r = 0; r < NR; ++r) acc[a][r][0] = acc[a][r][1] = Ops::zero();
  for (int d = 0; d < D; d += NA) {
    for (int a = 0; a < NA; ++a) {
      const V k0 = Ops::load(kt + (d + a) * KB), k1 = Ops::load(kt + (d + a) * KB + W);
      for (int r = 0; r < NR; ++r) {
        const V qr = Ops::set1(q[r * D + d + a]);
        acc[a][r][0] = Ops::fma(qr, k0, acc[a][r][0]);
        acc[a][r][1] = Ops::fma(qr, k1, acc[a][r][1]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    if constexpr (NA == 2) {
      acc[0][r][0] = Ops::add(acc[0][r][0], acc[1][r][0]);
      acc[0][r][1] = Ops::add(acc[0][r][1], acc[1][r][1]);
    }
    Ops::store(s + r * KB, acc[0][r][0]);
    Ops::store(s + r * KB + W, acc[0][r][1]);
  }
}

inline void score_rows(const float* q, int D, const float* kt, int rows, float* s) {
  int r = 0;
  for (; r + kTileRows <= rows; r += kTileRows) score_tile<kTileRows>(q + r * D, D, kt, s + r * KB);
  with_rows<kTileRows - 1>(rows - r, [&](auto nr) {
    score_tile<nr()>(q + r * D, D, kt, s + r * KB);
  });
}

// acc[r, c:c+NC*W] = acc * alpha[r] + sum_j p[r, j] v[j, c:c+NC*W] for NR rows and nk keys.
template <int NR, int NC, bool kRescale, typename KV>
inline void value_chunk(const KV* const* vp, int nk, int Dv, int c, const float* p,
                        const float* alpha, float* acc) {
  V a[NR][NC];
  for (int r = 0; r < NR; ++r) {
    for (int i = 0; i < NC; ++i) {
      a[r][i] = Ops::load(acc + r * Dv + c + i * W);
      if constexpr (kRescale) a[r][i] = Ops::mul(a[r][i], Ops::set1(alpha[r]));
    }
  }
  for (int j = 0; j < nk; ++j) {
    V v[NC];
    for (int i = 0; i < NC; ++i) v[i] = Ops::load(vp[j] + c + i * W);
    for (int r = 0; r < NR; ++r) {
      const V pr = Ops::set1(p[r * KB + j]);
      for (int i = 0; i < NC; ++i) a[r][i] = Ops::fma(pr, v[i], a[r][i]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < NC; ++i) Ops::store(acc + r * Dv + c + i * W, a[r][i]);
}

template <int NR, bool kRescale, typename KV>
inline void value_tile(const KV* const* vp, int nk, int Dv, const float* p, const float* alpha,
                       float* acc) {
  int c = 0;
  // Few rows (decode): four vectors of columns at once, for more independent FMA chains, where
  // the registers allow (NR x 4 accumulators, 4 value vectors and a broadcast).
  if constexpr (NR <= 3 && 4 * NR + 5 <= Ops::kRegisters) {
    for (; c + 4 * W <= Dv; c += 4 * W) value_chunk<NR, 4, kRescale>(vp, nk, Dv, c, p, alpha, acc);
  }
  for (; c + 2 * W <= Dv; c += 2 * W) value_chunk<NR, 2, kRescale>(vp, nk, Dv, c, p, alpha, acc);
  if (c < Dv) value_chunk<NR, 1, kRescale>(vp, nk, Dv, c, p, alpha, acc);
}

template <bool kRescale, typename KV>
inline void value_rows(const KV* const* vp, int nk, int Dv, const float* p,
                       const float* alpha, int rows, float* acc) {
  int r = 0;
  for (; r + kTileRows <= rows; r += kTileRows) {
    value_tile<kTileRows, kRescale>(vp, nk, Dv, p + r * KB, alpha + r, acc + r * Dv);
  }
  with_rows<kTileRows - 1>(rows - r, [&](auto nr) {
    value_tile<nr(), kRescale>(vp, nk, Dv, p + r * KB, alpha + r, acc + r * Dv);
  });
}

// How a block's two products are computed: `Widened<KV>` widens bf16 to float32 and multiplies
// with FMAs (float32 q, pre-scaled); an instruction set may add its own (AVX512-BF16 below).
// scores(kp, D, rows, sc) leaves the block's scores in sc.s (log2 units); values<kRescale>(vp, nk,
// Dv, rows, sc) adds the probabilities in sc.s times the values to sc.acc (rescaled by sc.alpha).
template <typename KV>
struct Widened {
  using T = KV;
  static inline void scores(const KV* const* kp, int D, int rows, Scratch& sc) {
    // The block's keys transposed to [D, KB], then KB scores per row by broadcast-FMA.
    for (int half = 0; half < KB; half += W) {
      for (int d0 = 0; d0 < D; d0 += W) {
        V t[W];
        for (int j = 0; j < W; ++j) t[j] = Ops::load(kp[half + j] + d0);
        Ops::transpose(t);
        for (int j = 0; j < W; ++j) Ops::store(sc.kt + (d0 + j) * KB + half, t[j]);
      }
    }
    score_rows(sc.q, D, sc.kt, rows, sc.s);
  }
  template <bool kRescale>
  static inline void values(const KV* const* vp, int nk, int Dv, int rows, Scratch& sc) {
    value_rows<kRescale>(vp, nk, Dv, sc.s, sc.alpha, rows, sc.acc);
  }
};

template <typename Products>
bool attend_with(const Pool& pool, const int64_t* list, int64_t list_stride, int64_t head,
                 int rows, int64_t key_begin, int64_t key_end, Scratch& sc) {
  using KV = typename Products::T;
  const int D = pool.head_dim, Dv = pool.v_dim;
  const KV* k_base = static_cast<const KV*>(pool.k) + head * pool.k_head_stride;
  const KV* v_base = static_cast<const KV*>(pool.v) + head * pool.v_head_stride;
  const KV* zeros = static_cast<const KV*>(sc.zeros);
  const int64_t end = std::min(key_end, sc.max_visible);
  for (int r = 0; r < rows; ++r) Ops::store(sc.l_lanes + r * W, Ops::zero());
  bool ok = true;
  const KV* kp[KB];
  const KV* vp[KB];
  for (int64_t block = key_begin; block < end; block += KB) {
    const int nk = int(std::min<int64_t>(KB, end - block));
    for (int j = 0; j < KB; ++j) {
      kp[j] = vp[j] = zeros;
      if (j >= nk) continue;
      const int64_t slot = list[(block + j) * list_stride];
      if (uint64_t(slot) >= uint64_t(pool.num_slots)) {
        ok = false;
        continue;
      }
      kp[j] = k_base + slot * pool.k_slot_stride;
      vp[j] = v_base + slot * pool.v_slot_stride;
    }
    // Ask for the keys (here) and values (before the value product) kPrefetchKeys ahead, so
    // memory streams while this block computes: the hardware prefetchers alone leave verify's
    // compute and the loads mostly serial, and know nothing of scattered slots. Two smaller
    // bursts queue better than one. A prefetch of a bad address is harmless.
    const int64_t ahead_begin = block + kPrefetchKeys;
    const int64_t ahead_end = std::min<int64_t>(ahead_begin + KB, end);
    for (int64_t pos = ahead_begin; pos < ahead_end; ++pos) {
      const int64_t slot = list[pos * list_stride];
      const char* k_row = reinterpret_cast<const char*>(k_base + slot * pool.k_slot_stride);
      for (size_t byte = 0; byte < D * sizeof(KV); byte += 64) Ops::prefetch(k_row + byte);
    }
    Products::scores(kp, D, rows, sc);
    // Online softmax. The running max m only moves when a score exceeds it (rare after the first
    // blocks), so the usual block is a compare, an exp2 and an add per row and vector; the row
    // sums stay spread over W lanes until the end. Probabilities overwrite the scores.
    bool rescale = false;
    for (int r = 0; r < rows; ++r) {
      float* s_row = sc.s + r * KB;
      float* l_row = sc.l_lanes + r * W;
      const int64_t seen = std::min<int64_t>(sc.visible[r] - block, nk);
      sc.alpha[r] = 1.0f;
      if (seen <= 0) {  // the row's causal limit is behind this block: nothing to add
        Ops::store(s_row, Ops::zero());
        Ops::store(s_row + W, Ops::zero());
        continue;
      }
      V x0 = Ops::load(s_row), x1 = Ops::load(s_row + W);
      if (seen < KB) {
        x0 = Ops::keep_first(x0, int(seen), kNegInf);
        x1 = Ops::keep_first(x1, int(seen) - W, kNegInf);
      }
      const V x = Ops::max(x0, x1);
      if (Ops::any_greater(x, sc.m[r])) {
        const float m_new = Ops::hmax(x);
        const float alpha = std::exp2(sc.m[r] - m_new);  // 0 for the first block (m = -inf)
        Ops::store(l_row, Ops::mul(Ops::load(l_row), Ops::set1(alpha)));
        sc.m[r] = m_new;
        sc.alpha[r] = alpha;
        rescale = true;
      }
      const V m = Ops::set1(sc.m[r]);
      V p0 = Ops::exp2(Ops::sub(x0, m)), p1 = Ops::exp2(Ops::sub(x1, m));
      if (seen < KB) {
        p0 = Ops::keep_first(p0, int(seen), 0.0f);
        p1 = Ops::keep_first(p1, int(seen) - W, 0.0f);
      }
      Ops::store(l_row, Ops::add(Ops::load(l_row), Ops::add(p0, p1)));
      Ops::store(s_row, p0);
      Ops::store(s_row + W, p1);
    }
    for (int64_t pos = ahead_begin; pos < ahead_end; ++pos) {
      const int64_t slot = list[pos * list_stride];
      const char* v_row = reinterpret_cast<const char*>(v_base + slot * pool.v_slot_stride);
      for (size_t byte = 0; byte < Dv * sizeof(KV); byte += 64) Ops::prefetch(v_row + byte);
    }
    if (rescale) {
      Products::template values<true>(vp, nk, Dv, rows, sc);
    } else {
      Products::template values<false>(vp, nk, Dv, rows, sc);
    }
  }
  for (int r = 0; r < rows; ++r) sc.l[r] = Ops::hsum(Ops::load(sc.l_lanes + r * W));
  return ok;
}

template <typename KV>
bool attend(const Pool& pool, const int64_t* list, int64_t list_stride, int64_t head, int rows,
            int64_t key_begin, int64_t key_end, Scratch& sc) {
  return attend_with<Widened<KV>>(pool, list, list_stride, head, rows, key_begin, key_end, sc);
}

#endif  // SLOT_ATTENTION_BODY
