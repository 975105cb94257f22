// A decoder layer's small per-token operations on CPU, one native call each: RMSNorm (with the
// residual add), rotary embedding, SiLU-and-mul and the KV-pool write. (Python side, torch
// references and the exact semantics: magicdec_kernels/cpu_native.py; how SGLang reaches them:
// sglang_magicdec/platforms/torch_ops.py.)
//
// SGLang's torch versions of these are 5 to 20 small torch ops each. At decode sizes (a few
// rows) every op costs its dispatch, not its arithmetic: 80-270 us per call on two cores, about
// 20 ms of a 30-layer forward, as much as reading the weights of a 135M model. Here a call costs
// a few microseconds.
//
// Every result is computed row by row in a fixed order with the roundings of the torch version
// (products and sums rounded separately: no FMA contraction; a bf16 result rounded wherever torch
// rounds one), so a row's result never depends on the rows beside it or on the instruction set:
// rotary embedding, SiLU's product and the KV write are bit-identical to torch; RMSNorm's mean
// of squares and SiLU's exp differ from torch's in the last bits (summation order, exp).
//
// As in the other kernels, the body (the end of this file) is compiled once per instruction set
// (AVX-512, AVX2, baseline) by including the file into namespaces under `#pragma GCC target`,
// and left to the compiler to vectorise; the entry points pick the widest set at run time.

#ifndef LAYER_OPS_BODY

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "cpu_common.h"

namespace {

using magicdec::bf16_bits;

// Elements below which one thread does a whole call (a parallel region costs more): decode and
// verify run inline, prefill chunks split over the cores by rows.
constexpr int64_t kMinParallelElements = int64_t(1) << 16;

// The rows [begin, end) of a call, on all threads when the call is large.
template <typename F>
void for_rows(int64_t rows, int64_t row_elements, F&& f) {
  const int64_t grain = std::max<int64_t>(1, kMinParallelElements / std::max<int64_t>(1, row_elements));
  if (rows <= grain) {
    f(int64_t(0), rows);
  } else {
    at::parallel_for(0, rows, grain, f);
  }
}

}  // namespace

#define LAYER_OPS_BODY

#ifdef MAGICDEC_X86
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
#pragma GCC optimize("fp-contract=off")
namespace layer_avx512 {
#include __FILE__
}  // namespace layer_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#pragma GCC optimize("fp-contract=off")
namespace layer_avx2 {
#include __FILE__
}  // namespace layer_avx2
#pragma GCC pop_options
#endif  // MAGICDEC_X86

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
namespace layer_scalar {
#include __FILE__
}  // namespace layer_scalar
#pragma GCC pop_options

#undef LAYER_OPS_BODY

// ---------------------------------------------------------------------------------------------
// Checks, dtype dispatch and the entry points (instruction-set independent; the Python binding
// is in module.cpp).

namespace {

enum class Isa { kAvx512, kAvx2, kScalar };

Isa pick_isa(const std::string& isa) {
#ifdef MAGICDEC_X86
  const bool avx512 = magicdec::cpu_has_avx512(), avx2 = magicdec::cpu_has_avx2();
  const bool avx512_bf16 = magicdec::cpu_has_avx512_bf16();
#else
  const bool avx512 = false, avx2 = false, avx512_bf16 = false;
#endif
  if (isa == "auto") return avx512 ? Isa::kAvx512 : avx2 ? Isa::kAvx2 : Isa::kScalar;
  // The other kernels' names; these ops have no bf16 arithmetic of their own to pick.
  if ((isa == "avx512" && avx512) || (isa == "avx512bf16" && avx512_bf16)) return Isa::kAvx512;
  if (isa == "avx2" && avx2) return Isa::kAvx2;
  if (isa == "scalar") return Isa::kScalar;
  TORCH_CHECK(false, "layer ops: instruction set '", isa, "' is not available here");
}

// Calls f with a null pointer of the C++ element type of `type` (float or bfloat16's bits).
template <typename F>
void with_element_type(at::ScalarType type, const char* what, F&& f) {
  if (type == at::kFloat) return f(static_cast<float*>(nullptr));
  TORCH_CHECK(type == at::kBFloat16, what, " must be float32 or bfloat16");
  f(static_cast<bf16_bits*>(nullptr));
}

void check_rows(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be on the CPU");
  TORCH_CHECK(t.dim() == 2, what, " must be 2-D [rows, columns]");
  TORCH_CHECK(t.size(1) <= 1 || t.stride(1) == 1, what, "'s rows must be contiguous");
}

template <typename T>
const T* data_of(const torch::Tensor& t) {
  return static_cast<const T*>(t.data_ptr());
}
template <typename T>
T* mutable_data_of(torch::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

}  // namespace

namespace magicdec {

void rms_norm(const torch::Tensor& x, const std::optional<torch::Tensor>& residual,
              const torch::Tensor& weight, double eps, bool cast_before_weight, torch::Tensor out,
              std::optional<torch::Tensor> residual_out, const std::string& isa) {
  check_rows(x, "rms_norm: x");
  check_rows(out, "rms_norm: out");
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 1 && weight.is_contiguous(),
              "rms_norm: weight must be a contiguous 1-D CPU tensor");
  const int64_t rows = x.size(0), hidden = x.size(1);
  TORCH_CHECK(weight.size(0) == hidden, "rms_norm: weight and x differ in size");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
              "rms_norm: out must be like x");
  TORCH_CHECK(residual.has_value() == residual_out.has_value(),
              "rms_norm: residual and residual_out come together");
  if (residual) {
    check_rows(*residual, "rms_norm: residual");
    check_rows(*residual_out, "rms_norm: residual_out");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual_out->sizes() == x.sizes() &&
                    residual->scalar_type() == x.scalar_type() &&
                    residual_out->scalar_type() == x.scalar_type(),
                "rms_norm: residual and residual_out must be like x");
  }
  TORCH_CHECK(!cast_before_weight || weight.scalar_type() == x.scalar_type(),
              "rms_norm: casting before the weight needs the weight in x's dtype");
  const Isa chosen = pick_isa(isa);
  with_element_type(x.scalar_type(), "rms_norm: x", [&](auto* t_tag) {
    using T = std::remove_pointer_t<decltype(t_tag)>;
    with_element_type(weight.scalar_type(), "rms_norm: weight", [&](auto* w_tag) {
      using WT = std::remove_pointer_t<decltype(w_tag)>;
      const T* res = residual ? data_of<T>(*residual) : nullptr;
      T* res_out = residual_out ? mutable_data_of<T>(*residual_out) : nullptr;
      const int64_t res_stride = residual ? residual->stride(0) : 0;
      const int64_t res_out_stride = residual_out ? residual_out->stride(0) : 0;
      for_rows(rows, hidden, [&](int64_t begin, int64_t end) {
        std::vector<float> sums(static_cast<size_t>(hidden));
        auto run = [&](auto kernel) {
          kernel(data_of<T>(x), x.stride(0), res, res_stride, data_of<WT>(weight), hidden,
                 float(eps), cast_before_weight, mutable_data_of<T>(out), out.stride(0), res_out,
                 res_out_stride, begin, end, sums.data());
        };
        switch (chosen) {
#ifdef MAGICDEC_X86
          case Isa::kAvx512: return run(layer_avx512::rms_norm_rows<T, WT>);
          case Isa::kAvx2: return run(layer_avx2::rms_norm_rows<T, WT>);
#endif
          default: return run(layer_scalar::rms_norm_rows<T, WT>);
        }
      });
    });
  });
}

void rotary_embedding(const torch::Tensor& positions, torch::Tensor query, torch::Tensor key,
                      const torch::Tensor& cos_sin_cache, int64_t head_size, bool neox_style,
                      const std::string& isa) {
  check_rows(query, "rotary_embedding: query");
  check_rows(key, "rotary_embedding: key");
  check_rows(cos_sin_cache, "rotary_embedding: cos_sin_cache");
  TORCH_CHECK(positions.device().is_cpu() && positions.dim() == 1 &&
                  positions.scalar_type() == at::kLong,
              "rotary_embedding: positions must be a 1-D int64 CPU tensor");
  const int64_t tokens = positions.size(0);
  TORCH_CHECK(query.size(0) == tokens && key.size(0) == tokens,
              "rotary_embedding: query and key need one row per position");
  TORCH_CHECK(query.scalar_type() == key.scalar_type(),
              "rotary_embedding: query and key dtypes differ");
  TORCH_CHECK(head_size > 0 && query.size(1) % head_size == 0 && key.size(1) % head_size == 0,
              "rotary_embedding: rows must be whole heads");
  const int64_t rotary_dim = cos_sin_cache.size(1);
  TORCH_CHECK(rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= head_size,
              "rotary_embedding: the cache's rotary dim must be even and at most the head size");
  const torch::Tensor positions_c = positions.contiguous();
  const int64_t* pos = positions_c.data_ptr<int64_t>();
  const int64_t cached = cos_sin_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cached, "rotary_embedding: position ", pos[t],
                " is outside the cache's ", cached, " positions");
  }
  const Isa chosen = pick_isa(isa);
  const int64_t q_heads = query.size(1) / head_size, k_heads = key.size(1) / head_size;
  with_element_type(query.scalar_type(), "rotary_embedding: query", [&](auto* t_tag) {
    using T = std::remove_pointer_t<decltype(t_tag)>;
    with_element_type(cos_sin_cache.scalar_type(), "rotary_embedding: cache", [&](auto* c_tag) {
      using CT = std::remove_pointer_t<decltype(c_tag)>;
      for_rows(tokens, query.size(1) + key.size(1), [&](int64_t begin, int64_t end) {
        auto run = [&](auto kernel) {
          kernel(pos, mutable_data_of<T>(query), query.stride(0), q_heads,
                 mutable_data_of<T>(key), key.stride(0), k_heads, data_of<CT>(cos_sin_cache),
                 cos_sin_cache.stride(0), head_size, rotary_dim, neox_style, begin, end);
        };
        switch (chosen) {
#ifdef MAGICDEC_X86
          case Isa::kAvx512: return run(layer_avx512::rotary_rows<T, CT>);
          case Isa::kAvx2: return run(layer_avx2::rotary_rows<T, CT>);
#endif
          default: return run(layer_scalar::rotary_rows<T, CT>);
        }
      });
    });
  });
}

void silu_and_mul(const torch::Tensor& x, torch::Tensor out, const std::string& isa) {
  check_rows(x, "silu_and_mul: x");
  check_rows(out, "silu_and_mul: out");
  const int64_t rows = x.size(0), half = x.size(1) / 2;
  TORCH_CHECK(x.size(1) % 2 == 0, "silu_and_mul: x must have an even number of columns");
  TORCH_CHECK(out.size(0) == rows && out.size(1) == half && out.scalar_type() == x.scalar_type(),
              "silu_and_mul: out must be [rows, columns / 2] in x's dtype");
  const Isa chosen = pick_isa(isa);
  with_element_type(x.scalar_type(), "silu_and_mul: x", [&](auto* t_tag) {
    using T = std::remove_pointer_t<decltype(t_tag)>;
    for_rows(rows, x.size(1), [&](int64_t begin, int64_t end) {
      auto run = [&](auto kernel) {
        kernel(data_of<T>(x), x.stride(0), mutable_data_of<T>(out), out.stride(0), half, begin,
               end);
      };
      switch (chosen) {
#ifdef MAGICDEC_X86
        case Isa::kAvx512: return run(layer_avx512::silu_and_mul_rows<T>);
        case Isa::kAvx2: return run(layer_avx2::silu_and_mul_rows<T>);
#endif
        default: return run(layer_scalar::silu_and_mul_rows<T>);
      }
    });
  });
}

void store_kv(torch::Tensor k_cache, torch::Tensor v_cache, const torch::Tensor& loc,
              const torch::Tensor& k, const torch::Tensor& v) {
  for (const torch::Tensor* t : {&std::as_const(k_cache), &std::as_const(v_cache), &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3, "store_kv: caches, k and v must be 3-D");
    TORCH_CHECK(t->size(2) <= 1 || t->stride(2) == 1, "store_kv: the last dim must be contiguous");
  }
  TORCH_CHECK(loc.device().is_cpu() && loc.dim() == 1 && loc.scalar_type() == at::kLong,
              "store_kv: loc must be a 1-D int64 CPU tensor");
  const int64_t tokens = loc.size(0), slots = k_cache.size(0), heads = k_cache.size(1);
  TORCH_CHECK(k.size(0) == tokens && v.size(0) == tokens, "store_kv: one k and v row per slot");
  TORCH_CHECK(k.size(1) == heads && k.size(2) == k_cache.size(2) && v.size(1) == heads &&
                  v.size(2) == v_cache.size(2) && v_cache.size(0) == slots &&
                  v_cache.size(1) == heads,
              "store_kv: k and v must match the caches' heads and head dims");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() &&
                  v.scalar_type() == v_cache.scalar_type(),
              "store_kv: k and v must have their cache's dtype");
  const torch::Tensor loc_c = loc.contiguous();
  const int64_t* slot = loc_c.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "store_kv: slot ", slot[t],
                " is outside the pool's ", slots);
  }
  for (const auto& [cache, rows] : {std::pair{&k_cache, &k}, std::pair{&v_cache, &v}}) {
    const size_t row_bytes = size_t(rows->size(2)) * rows->element_size();
    char* dst = static_cast<char*>(cache->data_ptr());
    const char* src = static_cast<const char*>(rows->data_ptr());
    const int64_t item = rows->element_size();
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        std::memcpy(dst + (slot[t] * cache->stride(0) + h * cache->stride(1)) * item,
                    src + (t * rows->stride(0) + h * rows->stride(1)) * item, row_bytes);
      }
    }
  }
}

}  // namespace magicdec

#else  // LAYER_OPS_BODY
// ---------------------------------------------------------------------------------------------
// The body, once per instruction set. Plain loops over a row; the compiler vectorises them for
// the target it is compiled under (products and sums rounded separately: fp-contract=off).
namespace {

using magicdec::bf16_bits;

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

// e^x for x in [-87.3, 88.3] (clamped outside), within ~2 ulp: Cody-Waite reduction to
// r = x - n ln 2, |r| <= ln 2 / 2, then Cephes' polynomial for e^r. Branch-free, so it vectorises.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
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
  for (int64_t row = begin; row < end; ++row) {
    const T* gate = x + row * x_stride;
    const T* up = gate + half;
    T* o_row = out + row * out_stride;
    for (int64_t i = 0; i < half; ++i) {
      const float a = widen(gate[i]);
      const float silu = round_as<T>(a / (1.0f + exp_approx(-a)));
      o_row[i] = narrow_to<T>(silu * widen(up[i]));
    }
  }
}

}  // namespace
#endif  // LAYER_OPS_BODY
