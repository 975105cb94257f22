// The few-row product's body: register tiles of dot products over K, lane-wise in vectors of the
// instruction set, then across the lanes (entry point and threads: few_rows_linear.cpp).
// Compiled once per instruction set by multiversion.h, with that set's `Ops`.
//
// Every output is one dot product in a fixed order, whatever tile it falls in: the same vector
// operations lane by lane over K (a partial last vector read as zeros), then `Ops::hsum`.

// Loads of a tile's operands: Raw registers of kStep elements, and acc + w * x lane-wise.
// Widened: float32, or bf16 widened to float32, multiplied with FMAs.
template <typename T>
struct Widened {
  using Elem = T;
  using Raw = Ops::V;
  static constexpr int kStep = Ops::W;
  static inline Raw load(const T* p) { return Ops::load(p); }
  static inline Raw load_first(const T* p, int n) { return Ops::load_first(p, n); }
  static inline Ops::V madd(Ops::V acc, Raw w, Raw x) { return Ops::fma(w, x, acc); }
};

#ifdef MAGICDEC_VEC_BF16_DOT
// bf16 pairs multiplied exactly and summed by `vdpbf16ps` into float32 lanes.
struct Bf16Dot {
  using Elem = bf16_bits;
  using Raw = __m512i;
  static constexpr int kStep = 32;
  static inline Raw load(const bf16_bits* p) { return _mm512_loadu_si512(p); }
  static inline Raw load_first(const bf16_bits* p, int n) {
    return _mm512_maskz_loadu_epi16(__mmask32((uint64_t(1) << n) - 1), p);
  }
  static inline Ops::V madd(Ops::V acc, Raw w, Raw x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x);
  }
};
#endif

// result[i][j] = w_i . x_j for NB weight rows and MB rows of x. The first tile of a block
// (prefetch) also asks for the weight rows kPrefetchRows ahead, into L2.
template <typename Load>
struct Tile {
  using T = typename Load::Elem;
  template <int NB, int MB>
  static inline void tile(const T* w, int64_t w_stride, const T* x, int64_t depth, bool prefetch,
                          float (&result)[NB][MB]) {
    constexpr int kStep = Load::kStep;
    typename Ops::V acc[NB][MB];
    for (int i = 0; i < NB; ++i) {
      for (int j = 0; j < MB; ++j) acc[i][j] = Ops::zero();
    }
    int64_t k = 0;
    const T* ahead = w + kPrefetchRows * w_stride;
    for (; k + kStep <= depth; k += kStep) {
      typename Load::Raw wv[NB];
      for (int i = 0; i < NB; ++i) wv[i] = Load::load(w + i * w_stride + k);
      if (prefetch) {
        for (int i = 0; i < NB; ++i) Ops::prefetch(ahead + i * w_stride + k);
      }
      for (int j = 0; j < MB; ++j) {
        const typename Load::Raw xv = Load::load(x + j * depth + k);
        for (int i = 0; i < NB; ++i) acc[i][j] = Load::madd(acc[i][j], wv[i], xv);
      }
    }
    if (k < depth) {
      const int rest = int(depth - k);
      typename Load::Raw wv[NB];
      for (int i = 0; i < NB; ++i) wv[i] = Load::load_first(w + i * w_stride + k, rest);
      for (int j = 0; j < MB; ++j) {
        const typename Load::Raw xv = Load::load_first(x + j * depth + k, rest);
        for (int i = 0; i < NB; ++i) acc[i][j] = Load::madd(acc[i][j], wv[i], xv);
      }
    }
    for (int i = 0; i < NB; ++i) {
      for (int j = 0; j < MB; ++j) result[i][j] = Ops::hsum(acc[i][j]);
    }
  }
};

// out[:, n_begin:n_end] = x . weight[n_begin:n_end]^T: blocks of kBlockN weight rows, each met
// by x's rows in tiles of up to kTileM (the block from memory once, from L1 for later tiles).
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
            for (int i = 0; i < NB; ++i) {
              out[(m + j) * ops.num_out + n + i] = narrow_to<OutT>(result[i][j]);
            }
          }
        });
      }
    });
  }
}

template <typename Kernel, typename T>
void product(const void* ops, bool bf16_out, int64_t n_begin, int64_t n_end) {
  const auto& operands = *static_cast<const Operands<T>*>(ops);
  if (bf16_out) {
    block_range<Kernel, T, bf16_bits>(operands, n_begin, n_end);
  } else {
    block_range<Kernel, T, float>(operands, n_begin, n_end);
  }
}

// This instruction set's product for float32 and for bf16 operands.
constexpr ProductFns kProduct = {
    &product<Tile<Widened<float>>, float>,
#ifdef MAGICDEC_VEC_BF16_DOT
    &product<Tile<Bf16Dot>, bf16_bits>,
#else
    &product<Tile<Widened<bf16_bits>>, bf16_bits>,
#endif
};
