// The few-row product's body: out[m, n] = x[m, :] . W[n, :] over a packed W (entry point,
// packing and threads: few_rows_linear.cpp). Compiled once per instruction set by
// multiversion.h, with that set's `Ops`.
//
// W is packed in panels of kPanel = 16 output rows, each panel's K walked in order (float32:
// [K][16]; bf16: [K / 2][16][2], pairs of k). A register tile holds NP panels x MB rows of x as
// output vectors: each step over k loads the panels' weights once and meets them with MB
// broadcast elements of x. Each output lane sums its K products in order, whatever M is and
// whichever tile it falls in, and is never reduced across lanes: a row's result does not depend
// on the rows that share the call.

constexpr int kVectorsPerPanel = kPanel / Ops::W;
// Panels per tile: the tile's MB x NP x kVectorsPerPanel accumulators, NP x kVectorsPerPanel
// weight vectors and a broadcast fit the registers (AVX-512: 8 x 3 + 3 + 1 of 32; AVX2 and
// portable: 4 x 1 x 2 + 2 + 1 of 16).
constexpr int kTilePanels = Ops::kRegisters == 32 ? 3 : 1;
constexpr int kTileRowsMax = Ops::kRegisters == 32 ? 8 : 4;
using V = Ops::V;
// How far ahead (in k, or pairs of k for bf16: one 64-byte line of a panel each) the panels
// are prefetched into L1, so the stream of weights overlaps the multiply-adds of 2 or more rows
// instead of the two taking turns; AVX2 builds only. Measured on an AVX2-only AMD EPYC, SmolLM2's
// layers, builds alternating (`benchmark/bench_builds.py`): float32 0-24% faster at 4-32 rows
// (about 5% at 8), bf16 (widened) 4-18% at 1-32 rows; 32 lines ahead and 96 about the same. Not
// measured with AVX-512 (no such CPU here), where a prefetch of the next tile's panels into L2
// measured 0-7% slower on a Xeon (stop 50), so those builds have none.
constexpr bool kPrefetchPanels = Ops::W == 8;
constexpr int64_t kPrefetchLines = 32;

// float32 W, or bf16 W widened to float32 (a pair of k per 32-bit word: the low half is k).
template <typename T>
struct Widened {
  // acc[r][v] += x[r][k] * W[k] for the panel vectors v, over k in [k_begin, k_end).
  template <int MB, int NP>
  static inline void tile(const T* panels, int64_t panel_stride, const T* x, int64_t x_stride,
                          int64_t depth, V (&acc)[MB][NP * kVectorsPerPanel]) {
    if constexpr (std::is_same_v<T, float>) {
      for (int64_t k = 0; k < depth; ++k) {
        if constexpr (kPrefetchPanels && MB > 1) {  // one row: as fast without (4% slower with)
          for (int p = 0; p < NP; ++p) {
            Ops::prefetch(panels + p * panel_stride + (k + kPrefetchLines) * kPanel);
          }
        }
        V w[NP * kVectorsPerPanel];
        for (int p = 0; p < NP; ++p) {
          for (int v = 0; v < kVectorsPerPanel; ++v) {
            w[p * kVectorsPerPanel + v] = Ops::load(panels + p * panel_stride + k * kPanel + v * Ops::W);
          }
        }
        for (int r = 0; r < MB; ++r) {
          const V xr = Ops::set1(x[r * x_stride + k]);
          for (int i = 0; i < NP * kVectorsPerPanel; ++i) acc[r][i] = Ops::fma(xr, w[i], acc[r][i]);
        }
      }
    } else {
      // bf16: word l of pair k2 holds (W[l][2 k2], W[l][2 k2 + 1]); k first, then k + 1.
      const int64_t pairs = (depth + 1) / 2;
      for (int64_t k2 = 0; k2 < pairs; ++k2) {
        if constexpr (kPrefetchPanels) {
          for (int p = 0; p < NP; ++p) {
            Ops::prefetch(panels + p * panel_stride + (k2 + kPrefetchLines) * 2 * kPanel);
          }
        }
        for (int half = 0; half < 2; ++half) {
          const int64_t k = 2 * k2 + half;
          if (k >= depth) break;
          V w[NP * kVectorsPerPanel];
          for (int p = 0; p < NP; ++p) {
            for (int v = 0; v < kVectorsPerPanel; ++v) {
              w[p * kVectorsPerPanel + v] = Ops::load_pair_half(
                  panels + p * panel_stride + (k2 * kPanel + v * Ops::W) * 2, half);
            }
          }
          for (int r = 0; r < MB; ++r) {
            const V xr = Ops::set1(widen(x[r * x_stride + k]));
            for (int i = 0; i < NP * kVectorsPerPanel; ++i) {
              acc[r][i] = Ops::fma(xr, w[i], acc[r][i]);
            }
          }
        }
      }
    }
  }
};

#ifdef MAGICDEC_VEC_BF16_DOT
// bf16 pairs multiplied exactly and summed by `vdpbf16ps`: one instruction per pair of k.
struct Bf16Dot {
  template <int MB, int NP>
  static inline void tile(const bf16_bits* panels, int64_t panel_stride, const bf16_bits* x,
                          int64_t x_stride, int64_t depth, V (&acc)[MB][NP]) {
    const int64_t pairs = depth / 2;
    for (int64_t k2 = 0; k2 < pairs; ++k2) {
      __m512i w[NP];
      for (int p = 0; p < NP; ++p) {
        w[p] = _mm512_loadu_si512(panels + p * panel_stride + k2 * 2 * kPanel);
      }
      for (int r = 0; r < MB; ++r) {
        uint32_t pair;
        std::memcpy(&pair, x + r * x_stride + 2 * k2, sizeof(pair));
        const __m512i xr = _mm512_set1_epi32(int(pair));
        for (int p = 0; p < NP; ++p) {
          acc[r][p] = _mm512_dpbf16_ps(acc[r][p], (__m512bh)w[p], (__m512bh)xr);
        }
      }
    }
    if (depth % 2) {  // an odd K: the last k alone, its pair's other half zero in both
      const int64_t k2 = pairs;
      for (int p = 0; p < NP; ++p) {
        const __m512i w = _mm512_loadu_si512(panels + p * panel_stride + k2 * 2 * kPanel);
        for (int r = 0; r < MB; ++r) {
          const __m512i xr = _mm512_set1_epi32(int(uint32_t(x[r * x_stride + 2 * k2])));
          acc[r][p] = _mm512_dpbf16_ps(acc[r][p], (__m512bh)w, (__m512bh)xr);
        }
      }
    }
  }
};
#endif

// out[m0:m0+MB, panel p's 16 columns] for panels [p_begin, p_begin + NP).
template <typename Kernel, typename T, typename OutT, int MB, int NP>
inline void run_tile(const PackedOperands<T>& ops, int64_t m0, int64_t p_begin) {
  V acc[MB][NP * kVectorsPerPanel];
  for (int r = 0; r < MB; ++r) {
    for (int i = 0; i < NP * kVectorsPerPanel; ++i) acc[r][i] = Ops::zero();
  }
  const T* panels = ops.packed + p_begin * ops.panel_stride;
  Kernel::template tile<MB, NP>(panels, ops.panel_stride, ops.x + m0 * ops.depth, ops.depth,
                                ops.depth, acc);
  OutT* out = static_cast<OutT*>(ops.out);
  alignas(64) float lanes[kPanel];
  for (int r = 0; r < MB; ++r) {
    for (int p = 0; p < NP; ++p) {
      for (int v = 0; v < kVectorsPerPanel; ++v) {
        Ops::store(lanes + v * Ops::W, acc[r][p * kVectorsPerPanel + v]);
      }
      const int64_t n0 = (p_begin + p) * kPanel;
      const int64_t columns = std::min<int64_t>(kPanel, ops.num_out - n0);
      OutT* row = out + (m0 + r) * ops.num_out + n0;
      for (int64_t c = 0; c < columns; ++c) row[c] = narrow_to<OutT>(lanes[c]);
    }
  }
}

// Panels [p_begin, p_end) for every row of x: tiles of up to kTilePanels panels x kTileRowsMax
// rows, the panels' weights streamed once per tile of rows (from cache after the first).
template <typename Kernel, typename T, typename OutT>
void panel_range(const PackedOperands<T>& ops, int64_t p_begin, int64_t p_end) {
  for (int64_t p = p_begin; p < p_end; p += kTilePanels) {
    with_count<kTilePanels>(int(std::min<int64_t>(kTilePanels, p_end - p)), [&](auto np) {
      constexpr int NP = decltype(np)::value;
      for (int64_t m = 0; m < ops.num_rows; m += kTileRowsMax) {
        with_count<kTileRowsMax>(int(std::min<int64_t>(kTileRowsMax, ops.num_rows - m)),
                                 [&](auto mb) {
                                   constexpr int MB = decltype(mb)::value;
                                   run_tile<Kernel, T, OutT, MB, NP>(ops, m, p);
                                 });
      }
    });
  }
}

template <typename Kernel, typename T>
void product(const void* ops, bool bf16_out, int64_t p_begin, int64_t p_end) {
  const auto& operands = *static_cast<const PackedOperands<T>*>(ops);
  if (bf16_out) {
    panel_range<Kernel, T, bf16_bits>(operands, p_begin, p_end);
  } else {
    panel_range<Kernel, T, float>(operands, p_begin, p_end);
  }
}

// This instruction set's product for float32 and for bf16 operands.
constexpr ProductFns kProduct = {
    &product<Widened<float>, float>,
#ifdef MAGICDEC_VEC_BF16_DOT
    &product<Bf16Dot, bf16_bits>,
#else
    &product<Widened<bf16_bits>, bf16_bits>,
#endif
};
