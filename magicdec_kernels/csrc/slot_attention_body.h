// The slot-attention kernel body: one (request, KV head, row tile, key range) task at a time,
// both products and the online softmax (entry point, planning and merging: slot_attention.cpp).
// Compiled once per instruction set by multiversion.h, with that set's `Ops`.
//
// Scores are in log2 units (q carries scale * log2(e)), so the softmax needs only exp2.
// Scores are in log2 units (q carries scale * log2(e)), so the softmax needs only exp2.

constexpr int W = Ops::W;
// Keys per block: two vectors, so that every broadcast feeds two FMAs in both products (as in
// a GEMM micro-kernel: loads, not FMAs, would otherwise bound the kernel).
constexpr int KB = 2 * W;
// Rows per register tile: 2 * kTileRows accumulators, two loaded vectors and a broadcast (27 of
// AVX-512's 32 registers, 15 of AVX2's 16).
constexpr int kTileRows = Ops::kRegisters == 32 ? 12 : 6;
// How far ahead of the current block its keys and values are prefetched, both at once, into L1:
// 32 keys, the next block with AVX-512 (16 KiB at D = 64 in float32, beside the block read).
// A layer's attention here costs about its bytes plus its arithmetic (bench_cpu_backend
// --kernels, column `in cache`): the reads overlap the block's products only as far as
// prefetches run ahead.
// Measured on an AVX-512 Xeon without bf16 products, batch 8 x 8,000, alternating builds:
// float32 decode and verify 9-12% faster than the keys 64 ahead into L2 and the values asked
// for after the scores; bf16 and the AVX2 build unchanged; 64 to 1,024 keys ahead were slower.
constexpr int64_t kPrefetchKeys = 32;
using V = Ops::V;

// s[r, :] = q[r, :] . kt (the KB scores of row r) for NR rows. One accumulator per (row, vector
// of keys), summed over d in order whatever NR is: a row's scores do not depend on the rows that
// share its tile (a verify row computes its token's scores exactly as a decode step would).
template <int NR>
inline void score_tile(const float* q, int D, const float* kt, float* s) {
  V acc[NR][2];
  for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = Ops::zero();
  for (int d = 0; d < D; ++d) {
    const V k0 = Ops::load(kt + d * KB), k1 = Ops::load(kt + d * KB + W);
    for (int r = 0; r < NR; ++r) {
      const V qr = Ops::set1(q[r * D + d]);
      acc[r][0] = Ops::fma(qr, k0, acc[r][0]);
      acc[r][1] = Ops::fma(qr, k1, acc[r][1]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    Ops::store(s + r * KB, acc[r][0]);
    Ops::store(s + r * KB + W, acc[r][1]);
  }
}

inline void score_rows(const float* q, int D, const float* kt, int rows, float* s) {
  int r = 0;
  for (; r + kTileRows <= rows; r += kTileRows) score_tile<kTileRows>(q + r * D, D, kt, s + r * KB);
  with_count<kTileRows - 1>(rows - r, [&](auto nr) {
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
  with_count<kTileRows - 1>(rows - r, [&](auto nr) {
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
    if constexpr (std::is_same_v<KV, bf16_bits>) {
      if (D % (2 * W) == 0) {
        // bf16 keys transposed as 32-bit pairs of dims (half the transposes of widened rows,
        // and no widening shuffles), each pair then split into its two widened dims: the same
        // [D, KB] floats, so the same scores bit for bit.
        for (int half = 0; half < KB; half += W) {
          for (int d0 = 0; d0 < D; d0 += 2 * W) {
            V t[W];
            for (int j = 0; j < W; ++j) t[j] = Ops::load_words(kp[half + j] + d0);
            Ops::transpose(t);
            for (int i = 0; i < W; ++i) {
              Ops::store(sc.kt + (d0 + 2 * i) * KB + half, Ops::pair_half(t[i], 0));
              Ops::store(sc.kt + (d0 + 2 * i + 1) * KB + half, Ops::pair_half(t[i], 1));
            }
          }
        }
        score_rows(sc.q, D, sc.kt, rows, sc.s);
        return;
      }
    }
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
    // Ask for the keys and values kPrefetchKeys ahead, so memory streams while this block
    // computes: the hardware prefetchers alone leave the products and the loads mostly serial,
    // and know nothing of scattered slots. A prefetch of a bad address is harmless.
    const int64_t ahead_begin = block + kPrefetchKeys;
    const int64_t ahead_end = std::min<int64_t>(ahead_begin + KB, end);
    for (int64_t pos = ahead_begin; pos < ahead_end; ++pos) {
      const int64_t slot = list[pos * list_stride];
      const char* k_row = reinterpret_cast<const char*>(k_base + slot * pool.k_slot_stride);
      for (size_t byte = 0; byte < D * sizeof(KV); byte += 64) Ops::prefetch(k_row + byte);
      const char* v_row = reinterpret_cast<const char*>(v_base + slot * pool.v_slot_stride);
      for (size_t byte = 0; byte < Dv * sizeof(KV); byte += 64) Ops::prefetch(v_row + byte);
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

#ifdef MAGICDEC_VEC_BF16_DOT
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
    with_count<kTileRows - 1>(rows - r, [&](auto nr) { score_tile<nr()>(kt2, D, r, sc); });
  }

  // As the float32 score_tile: one accumulator per (row, vector of keys), whatever NR is.
  template <int NR>
  static inline void score_tile(const uint32_t* kt2, int D, int r0, Scratch& sc) {
    const int pairs = D / 2;
    const uint32_t* q = reinterpret_cast<const uint32_t*>(sc.q16 + r0 * D);
    __m512 acc[NR][2];
    for (int r = 0; r < NR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int d2 = 0; d2 < pairs; ++d2) {
      const __m512i k0 = load_pairs(kt2 + d2 * KB), k1 = load_pairs(kt2 + d2 * KB + W);
      for (int r = 0; r < NR; ++r) {
        const __m512i qr = _mm512_set1_epi32(int(q[r * pairs + d2]));
        acc[r][0] = dot(acc[r][0], k0, qr);
        acc[r][1] = dot(acc[r][1], k1, qr);
      }
    }
    const __m512 scale = _mm512_set1_ps(sc.score_scale);
    for (int r = 0; r < NR; ++r) {
      Ops::store(sc.s + (r0 + r) * KB, _mm512_mul_ps(acc[r][0], scale));
      Ops::store(sc.s + (r0 + r) * KB + W, _mm512_mul_ps(acc[r][1], scale));
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
    with_count<kTileRows - 1>(rows - r, [&](auto nr) { value_tile<nr(), kRescale>(pairs, Dv, r, sc); });
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
#endif  // MAGICDEC_VEC_BF16_DOT

// This instruction set's attention over each KV dtype (the entry point picks one).
constexpr AttendFns kAttend = {
    &attend<float>,
    &attend<bf16_bits>,
#ifdef MAGICDEC_VEC_BF16_DOT
    &attend_bf16_dot,
#else
    nullptr,
#endif
};
