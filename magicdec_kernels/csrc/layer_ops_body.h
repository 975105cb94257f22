// A decoder layer's per-token ops, row by row (entry points: layer_ops.cpp). Compiled once per
// instruction set by multiversion.h, with fp-contract=off: plain loops the compiler vectorises
// for that set, products and sums rounded separately, as torch rounds them.

// e^x for x in [-87.3, 88.3] (the caller clamps), within ~2 ulp: Cody-Waite reduction to
// r = x - n ln 2, |r| <= ln 2 / 2, then Cephes' polynomial for e^r. Branch-free, so a loop of it
// vectorises (with the clamp in the same loop GCC splits the loop into branches and does not).
inline float exp_clamped(float x) {
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// SGLang's RMSNorm.forward_native, rows [begin, end): h = x (+ residual) in float32; residual_out
// = h as T; out = h / sqrt(mean(h^2) + eps) times the weight, rounded to T before the weight
// when cast_before_weight (then a product of T's), else after it.
template <typename T, typename WT>
void rms_norm_rows(const T* x, int64_t x_stride, const T* residual, int64_t res_stride,
                   const WT* weight, int64_t hidden, float eps, bool cast_before_weight, T* out,
                   int64_t out_stride, T* residual_out, int64_t res_out_stride, int64_t begin,
                   int64_t end, float* h) {
  constexpr int kLanes = 16;
  for (int64_t row = begin; row < end; ++row) {
    const T* x_row = x + row * x_stride;
    if (residual != nullptr) {
      const T* r_row = residual + row * res_stride;
      T* ro_row = residual_out + row * res_out_stride;
      for (int64_t i = 0; i < hidden; ++i) h[i] = widen(x_row[i]) + widen(r_row[i]);
      for (int64_t i = 0; i < hidden; ++i) ro_row[i] = narrow_to<T>(h[i]);
    } else {
      for (int64_t i = 0; i < hidden; ++i) h[i] = widen(x_row[i]);
    }
    // Squares summed in kLanes interleaved partial sums, then those in a fixed order: the same
    // sum whatever the vector width.
    float lanes[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= hidden; i += kLanes) {
      for (int j = 0; j < kLanes; ++j) lanes[j] += h[i + j] * h[i + j];
    }
    for (int j = 0; i < hidden; ++i, ++j) lanes[j] += h[i] * h[i];
    for (int width = kLanes / 2; width > 0; width /= 2) {
      for (int j = 0; j < width; ++j) lanes[j] += lanes[j + width];
    }
    const float inv_rms = 1.0f / std::sqrt(lanes[0] / float(hidden) + eps);
    T* o_row = out + row * out_stride;
    if (cast_before_weight) {
      for (int64_t k = 0; k < hidden; ++k) {
        o_row[k] = narrow_to<T>(widen(weight[k]) * round_as<T>(h[k] * inv_rms));
      }
    } else {
      for (int64_t k = 0; k < hidden; ++k) {
        o_row[k] = narrow_to<T>((h[k] * inv_rms) * widen(weight[k]));
      }
    }
  }
}

// SGLang's RotaryEmbedding.forward_native, in place, rows [begin, end): the first rotary_dim
// dims of every head rotated by the cached cos and sin of the row's position (each product and
// sum a torch op on T, as `apply_rotary_emb` computes them), the rest of each head unchanged.
// Neox style pairs dim i with i + rotary_dim / 2; GPT-J style pairs 2i with 2i + 1.
template <typename T, typename CT>
void rotary_rows(const int64_t* positions, T* query, int64_t q_stride, int64_t q_heads, T* key,
                 int64_t k_stride, int64_t k_heads, const CT* cache, int64_t cache_stride,
                 int64_t head_size, int64_t rotary_dim, bool neox_style, int64_t begin,
                 int64_t end) {
  const int64_t half = rotary_dim / 2;
  for (int64_t token = begin; token < end; ++token) {
    const CT* cos = cache + positions[token] * cache_stride;
    const CT* sin = cos + half;
    for (int part = 0; part < 2; ++part) {
      T* rows = part == 0 ? query + token * q_stride : key + token * k_stride;
      const int64_t heads = part == 0 ? q_heads : k_heads;
      for (int64_t head = 0; head < heads; ++head) {
        T* x = rows + head * head_size;
        const int64_t second = neox_style ? half : 1, step = neox_style ? 1 : 2;
        for (int64_t i = 0; i < half; ++i) {
          const float c = round_as<T>(widen(cos[i])), s = round_as<T>(widen(sin[i]));
          const float x1 = widen(x[i * step]), x2 = widen(x[i * step + second]);
          const float o1 = round_as<T>(x1 * c) - round_as<T>(x2 * s);
          const float o2 = round_as<T>(x2 * c) + round_as<T>(x1 * s);
          x[i * step] = narrow_to<T>(o1);
          x[i * step + second] = narrow_to<T>(o2);
        }
      }
    }
  }
}

// SGLang's SiluAndMul.forward_native, rows [begin, end): silu(x[:, :d]) * x[:, d:], silu(a) =
// a / (1 + e^-a) rounded to T before the product.
template <typename T>
void silu_and_mul_rows(const T* x, int64_t x_stride, T* out, int64_t out_stride, int64_t half,
                       int64_t begin, int64_t end) {
  // A row in chunks, each in three loops (clamp, e^-a, the product) that each vectorise.
  constexpr int64_t kChunk = 64;
  float e[kChunk];
  for (int64_t row = begin; row < end; ++row) {
    const T* gate = x + row * x_stride;
    const T* up = gate + half;
    T* o_row = out + row * out_stride;
    for (int64_t i0 = 0; i0 < half; i0 += kChunk) {
      const int64_t n = std::min(kChunk, half - i0);
      for (int64_t j = 0; j < n; ++j) e[j] = std::min(std::max(-widen(gate[i0 + j]), -87.3f), 88.3f);
      for (int64_t j = 0; j < n; ++j) e[j] = exp_clamped(e[j]);
      for (int64_t j = 0; j < n; ++j) {
        const float silu = round_as<T>(widen(gate[i0 + j]) / (1.0f + e[j]));
        o_row[i0 + j] = narrow_to<T>(silu * widen(up[i0 + j]));
      }
    }
  }
}
