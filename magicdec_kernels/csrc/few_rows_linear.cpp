// Products of a few rows with a weight matrix on CPU: out = x . weight^T, with x [M, K] for a
// few dozen rows at most (decode, the draft step, verification) and weight [N, K] as torch's
// Linear stores it. (Python side: magicdec_kernels/cpu_ops.py.)
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
// The body (few_rows_linear_body.h) is compiled once per instruction set by multiversion.h.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "isa.h"

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

// Where the operands are: x [M, K] and out [M, N] contiguous, weight rows weight_stride apart.
template <typename T>
struct Operands {
  const T* x;
  const T* weight;
  void* out;
  int64_t num_rows, depth, weight_stride, num_out;
};

using ProductFn = void (*)(const void* ops, bool bf16_out, int64_t n_begin, int64_t n_end);

// One instruction set's product for float32 and for bf16 operands.
struct ProductFns {
  ProductFn f32;
  ProductFn bf16;
};

}  // namespace

#define MAGICDEC_KERNEL_BODY "few_rows_linear_body.h"
#include "multiversion.h"

// ---------------------------------------------------------------------------------------------
// The entry point: checks, threads, and the version `resolve_isa` picks.

namespace magicdec {

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

  const ProductFns chosen =
      pick(resolve_isa(isa, "few_rows_linear"), MAGICDEC_PER_ISA(kProduct));
  if (num_rows == 0 || num_out == 0) return out;
  const bool bf16 = dtype == at::kBFloat16;
  const ProductFn run = bf16 ? chosen.bf16 : chosen.f32;
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
