// What every kernel body uses, compiled for one instruction set at a time (multiversion.h
// includes it in each set's namespace, so each copy is built for its own target): `Ops`, a vector
// of W floats and the handful of operations the bodies need; the scalar bf16 conversions; and
// `with_count`. MAGICDEC_VEC_AVX512 or MAGICDEC_VEC_AVX2 selects the set; neither: portable C++.
//
// No include guard: included once per instruction set, on purpose.

// bfloat16 bits -> float32 (exact).
inline float widen(float value) { return value; }
inline float widen(bf16_bits bits) {
  const uint32_t wide = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
}

// float -> T, rounded to nearest even (as torch rounds to bfloat16); NaN stays NaN.
inline float narrow(float value, float*) { return value; }
inline bf16_bits narrow(float value, bf16_bits*) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  const uint32_t rounded = bits + 0x7fffu + ((bits >> 16) & 1u);
  return bf16_bits((nan ? bits | 0x400000u : rounded) >> 16);
}
template <typename T>
inline T narrow_to(float value) {
  return narrow(value, static_cast<T*>(nullptr));
}
// What a torch op on T tensors leaves: the float result rounded to T, read back as float.
template <typename T>
inline float round_as(float value) {
  return widen(narrow_to<T>(value));
}

// Calls f(std::integral_constant<int, n>) for a run-time 1 <= n <= N (nothing for other n): a
// tile's row or column count becomes a compile-time constant, so its accumulators live in
// registers.
template <int N, typename F>
inline void with_count(int n, F&& f) {
  if constexpr (N > 0) {
    if (n == N) {
      f(std::integral_constant<int, N>{});
    } else {
      with_count<N - 1>(n, std::forward<F>(f));
    }
  }
}

#if defined(MAGICDEC_VEC_AVX512)

struct Ops {
  static constexpr int W = 16;
  static constexpr int kRegisters = 32;
  using V = __m512;
  static inline V zero() { return _mm512_setzero_ps(); }
  static inline V set1(float x) { return _mm512_set1_ps(x); }
  static inline V load(const float* p) { return _mm512_loadu_ps(p); }
  static inline V load(const bf16_bits* p) {
    return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static inline V widen16(__m256i half) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  }
  // W pairs of bf16 at p (2W elements), each pair one 32-bit lane (the bits as they are).
  static inline V load_words(const bf16_bits* p) { return _mm512_loadu_ps(p); }
  // The first (half 0) or second (half 1) bf16 of each pair in `words`, widened.
  static inline V pair_half(V words, int half) {
    const __m512i w = _mm512_castps_si512(words);
    return _mm512_castsi512_ps(half == 0 ? _mm512_slli_epi32(w, 16)
                                         : _mm512_and_si512(w, _mm512_set1_epi32(-65536)));
  }
  static inline V load_pair_half(const bf16_bits* p, int half) {
    return pair_half(load_words(p), half);
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
  static inline void prefetch(const void* p) {  // into L1 (slot_attention_body.h says why)
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
  }
};

#elif defined(MAGICDEC_VEC_AVX2)

struct Ops {
  static constexpr int W = 8;
  static constexpr int kRegisters = 16;
  using V = __m256;
  static inline V zero() { return _mm256_setzero_ps(); }
  static inline V set1(float x) { return _mm256_set1_ps(x); }
  static inline V load(const float* p) { return _mm256_loadu_ps(p); }
  static inline V load(const bf16_bits* p) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
  }
  static inline V load_words(const bf16_bits* p) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  }
  static inline V pair_half(V words, int half) {
    const __m256i w = _mm256_castps_si256(words);
    return _mm256_castsi256_ps(half == 0 ? _mm256_slli_epi32(w, 16)
                                         : _mm256_and_si256(w, _mm256_set1_epi32(-65536)));
  }
  static inline V load_pair_half(const bf16_bits* p, int half) {
    return pair_half(load_words(p), half);
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
  static inline void prefetch(const void* p) {  // into L1 (slot_attention_body.h says why)
    _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0);
  }
};

#else  // portable C++

struct Ops {
  static constexpr int W = 8;
  static constexpr int kRegisters = 16;
  struct V {
    float x[W];
  };
  static inline V zero() { return set1(0.0f); }
  static inline V set1(float a) {
    V r;
    for (int i = 0; i < W; ++i) r.x[i] = a;
    return r;
  }
  template <typename T>
  static inline V load(const T* p) {
    V r;
    for (int i = 0; i < W; ++i) r.x[i] = widen(p[i]);
    return r;
  }
  static inline V load_words(const bf16_bits* p) {
    V r;
    std::memcpy(r.x, p, sizeof(r.x));
    return r;
  }
  static inline V pair_half(V words, int half) {
    for (int i = 0; i < W; ++i) {
      uint32_t w;
      std::memcpy(&w, &words.x[i], sizeof(w));
      w = half == 0 ? w << 16 : w & 0xFFFF0000u;
      std::memcpy(&words.x[i], &w, sizeof(w));
    }
    return words;
  }
  static inline V load_pair_half(const bf16_bits* p, int half) {
    V r;
    for (int i = 0; i < W; ++i) r.x[i] = widen(p[2 * i + half]);
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

#endif
