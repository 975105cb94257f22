// A decoder layer's small per-token operations on CPU, one native call each: RMSNorm (with the
// residual add), rotary embedding, SiLU-and-mul and the KV-pool write. (Python side and the
// exact semantics: magicdec_kernels/cpu_native.py; torch references: test/references.py; how
// SGLang reaches them: sglang_magicdec/platforms/torch_ops.py.)
//
// SGLang's torch versions of these are 5 to 20 small torch ops each. At decode sizes (a few
// rows) every op costs its dispatch, not its arithmetic, which over a 30-layer forward weighs as
// much as reading a 135M model's weights (benchmark/results/HISTORY.md, block 1). Here a call
// costs a few microseconds.
//
// Every result is computed row by row in a fixed order with the roundings of the torch version
// (products and sums rounded separately: no FMA contraction; a bf16 result rounded wherever torch
// rounds one), so a row's result never depends on the rows beside it or on the instruction set:
// rotary embedding, SiLU's product and the KV write are bit-identical to torch; RMSNorm's mean
// of squares and SiLU's exp differ from torch's in the last bits (summation order, exp).
//
// The body (layer_ops_body.h) is compiled once per instruction set by multiversion.h, like every
// kernel here, and left to the compiler to vectorise.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "isa.h"

namespace {

using magicdec::bf16_bits;

// Elements below which one thread does a whole call (a parallel region costs more): decode and
// verify run inline, prefill chunks split over the cores by rows.
constexpr int64_t kMinParallelElements = int64_t(1) << 16;

// The rows [begin, end) of a call, on all threads when the call is large.
template <typename F>
void for_rows(int64_t rows, int64_t row_elements, F&& f) {
  const int64_t grain =
      std::max<int64_t>(1, kMinParallelElements / std::max<int64_t>(1, row_elements));
  if (rows <= grain) {
    f(int64_t(0), rows);
  } else {
    at::parallel_for(0, rows, grain, f);
  }
}

}  // namespace

#define MAGICDEC_KERNEL_BODY "layer_ops_body.h"
#define MAGICDEC_KERNEL_NO_FP_CONTRACT 1
#include "multiversion.h"

// ---------------------------------------------------------------------------------------------
// Checks, dtype dispatch and the entry points (instruction-set independent; the Python binding
// is in module.cpp).

namespace {

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
  const Isa chosen = resolve_isa(isa, "rms_norm");
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
        run(pick(chosen, MAGICDEC_PER_ISA(rms_norm_rows<T, WT>)));
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
  const Isa chosen = resolve_isa(isa, "rotary_embedding");
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
        run(pick(chosen, MAGICDEC_PER_ISA(rotary_rows<T, CT>)));
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
  const Isa chosen = resolve_isa(isa, "silu_and_mul");
  with_element_type(x.scalar_type(), "silu_and_mul: x", [&](auto* t_tag) {
    using T = std::remove_pointer_t<decltype(t_tag)>;
    for_rows(rows, x.size(1), [&](int64_t begin, int64_t end) {
      auto run = [&](auto kernel) {
        kernel(data_of<T>(x), x.stride(0), mutable_data_of<T>(out), out.stride(0), half, begin,
               end);
      };
      run(pick(chosen, MAGICDEC_PER_ISA(silu_and_mul_rows<T>)));
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
