// Products of a few rows with a weight matrix on CPU: out = x . W^T, with x [M, K] for up to 64
// rows (decode, the draft step, verification) and W [N, K] as torch's Linear stores it, packed
// once (`cpu_native.pack_rows`) into panels of 16 output rows whose K is walked in order:
// float32 [N / 16][K][16], bf16 [N / 16][K / 2][16][2] (pairs of k: `vdpbf16ps`'s operand). The
// panels stream from memory in one sequential pass per tile of rows. (Python side:
// magicdec_kernels/cpu_native.py.)
//
// With a handful of rows such a product costs one read of W (decode and draft steps); with a few
// dozen (verification) its multiply-adds: each tile keeps 8 rows x 48 outputs in registers, so
// every weight vector loaded feeds 8 FMAs (or bf16 pair dot products) and every broadcast of x 3,
// and no output is ever summed across lanes.
//
// Every output is one dot product in a fixed order (k ascending, in one float32 lane), whatever
// M is and whichever tile it falls in: a row's result does not depend on the rows that share the
// call, so a verify pass computes a token's logits exactly as a decode step would.
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

// Output rows per panel of the packed weight (one AVX-512 vector of float32 outputs).
constexpr int kPanel = 16;
// Multiply-adds below which one thread does the whole product (a parallel region costs more).
constexpr int64_t kMinParallelWork = int64_t(1) << 18;

// Where the operands are: x [M, K] and out [M, N] contiguous, the packed panels panel_stride
// elements apart.
template <typename T>
struct PackedOperands {
  const T* x;
  const T* packed;
  void* out;
  int64_t num_rows, depth, panel_stride, num_out;
};

using ProductFn = void (*)(const void* ops, bool bf16_out, int64_t p_begin, int64_t p_end);

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

torch::Tensor few_rows_linear(const torch::Tensor& x, const torch::Tensor& packed,
                              int64_t num_out, torch::Tensor out, const std::string& isa) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu() && out.device().is_cpu(),
              "few_rows_linear: all tensors must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2, "few_rows_linear: x and out must be 2-D");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "few_rows_linear: x must be float32 or bfloat16");
  TORCH_CHECK(packed.scalar_type() == dtype && out.scalar_type() == dtype,
              "few_rows_linear: x, the packed weight and out must share a dtype");
  const int64_t num_rows = x.size(0), depth = x.size(1);
  const bool bf16 = dtype == at::kBFloat16;
  const int64_t panels = (num_out + kPanel - 1) / kPanel;
  const int64_t padded_depth = bf16 ? (depth + 1) / 2 * 2 : depth;
  TORCH_CHECK(packed.is_contiguous() && packed.numel() == panels * padded_depth * kPanel,
              "few_rows_linear: the packed weight does not hold ", num_out, " rows of ", depth,
              " (pack it with cpu_native.pack_rows)");
  TORCH_CHECK(out.size(0) == num_rows && out.size(1) == num_out,
              "few_rows_linear: out must be [x rows, weight rows]");
  TORCH_CHECK(x.is_contiguous() && out.is_contiguous(),
              "few_rows_linear: x and out must be contiguous");
  const ProductFns chosen =
      pick(resolve_isa(isa, "few_rows_linear"), MAGICDEC_PER_ISA(kProduct));
  if (num_rows == 0 || num_out == 0) return out;
  const ProductFn run = bf16 ? chosen.bf16 : chosen.f32;
  const int64_t panel_stride = padded_depth * kPanel;
  PackedOperands<float> f32_ops{nullptr, nullptr, out.data_ptr(), num_rows,
                                depth, panel_stride, num_out};
  PackedOperands<bf16_bits> bf16_ops{nullptr, nullptr, out.data_ptr(), num_rows,
                                     depth, panel_stride, num_out};
  const void* ops;
  if (bf16) {
    bf16_ops.x = static_cast<const bf16_bits*>(x.data_ptr());
    bf16_ops.packed = static_cast<const bf16_bits*>(packed.data_ptr());
    ops = &bf16_ops;
  } else {
    f32_ops.x = x.data_ptr<float>();
    f32_ops.packed = packed.data_ptr<float>();
    ops = &f32_ops;
  }
  // Panels spread evenly over the threads (each range starting on a whole tile of panels where
  // it can); small products stay on one thread.
  const int64_t work = num_rows * depth * num_out;
  const int64_t grain = work < kMinParallelWork ? panels : 1;
  at::parallel_for(0, panels, grain,
                   [&](int64_t begin, int64_t end) { run(ops, bf16, begin, end); });
  return out;
}

}  // namespace magicdec
