// The Python module: the native CPU kernels of magicdec_kernels/cpu_native.py (built and loaded by
// magicdec_kernels/native.py).

#include <torch/extension.h>

#include <optional>
#include <string>
#include <vector>

#include "isa.h"

namespace magicdec {
// slot_attention.cpp
torch::Tensor slot_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                             const torch::Tensor& v_cache, const torch::Tensor& q_indptr,
                             const torch::Tensor& head_slots, const torch::Tensor& kv_lens,
                             double scale, torch::Tensor out, const std::string& isa);
// few_rows_linear.cpp
torch::Tensor few_rows_linear(const torch::Tensor& x, const torch::Tensor& packed,
                              int64_t num_out, torch::Tensor out, const std::string& isa);
// layer_ops.cpp
void rms_norm(const torch::Tensor& x, const std::optional<torch::Tensor>& residual,
              const torch::Tensor& weight, double eps, bool cast_before_weight, torch::Tensor out,
              std::optional<torch::Tensor> residual_out, const std::string& isa);
void rotary_embedding(const torch::Tensor& positions, torch::Tensor query, torch::Tensor key,
                      const torch::Tensor& cos_sin_cache, int64_t head_size, bool neox_style,
                      const std::string& isa);
void silu_and_mul(const torch::Tensor& x, torch::Tensor out, const std::string& isa);
void store_kv(torch::Tensor k_cache, torch::Tensor v_cache, const torch::Tensor& loc,
              const torch::Tensor& k, const torch::Tensor& v);
}  // namespace magicdec

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace magicdec;
  m.doc() = "MagicDec's CPU kernels: attention over lists of KV-pool slots, few-row products, "
            "a decoder layer's per-token ops.";
  m.def("slot_attention", &slot_attention, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("q_indptr"), py::arg("head_slots"), py::arg("kv_lens"), py::arg("scale"),
        py::arg("out"), py::arg("isa") = "auto", py::call_guard<py::gil_scoped_release>(),
        "Writes softmax(q k^T scale + causal) v into out and returns it; isa: 'auto', "
        "'avx512bf16', 'avx512', 'avx2' or 'scalar'.");
  m.def("few_rows_linear", &few_rows_linear, py::arg("x"), py::arg("packed"),
        py::arg("num_out"), py::arg("out"), py::arg("isa") = "auto",
        py::call_guard<py::gil_scoped_release>(),
        "Writes x . W^T into out ([rows, num_out], x's dtype) and returns it, W packed by "
        "cpu_native.pack_rows; isa as for slot_attention.");
  // The layer ops are a few microseconds each: they keep the GIL (releasing it costs as much).
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("residual"), py::arg("weight"),
        py::arg("eps"), py::arg("cast_before_weight"), py::arg("out"), py::arg("residual_out"),
        py::arg("isa") = "auto",
        "out = RMSNorm(x (+ residual)) times weight; residual_out = x + residual.");
  m.def("rotary_embedding", &rotary_embedding, py::arg("positions"), py::arg("query"),
        py::arg("key"), py::arg("cos_sin_cache"), py::arg("head_size"), py::arg("neox_style"),
        py::arg("isa") = "auto", "Rotates query and key rows in place.");
  m.def("silu_and_mul", &silu_and_mul, py::arg("x"), py::arg("out"), py::arg("isa") = "auto",
        "out = silu(x[:, :d]) * x[:, d:].");
  m.def("store_kv", &store_kv, py::arg("k_cache"), py::arg("v_cache"), py::arg("loc"),
        py::arg("k"), py::arg("v"), "k_cache[loc] = k; v_cache[loc] = v.");
  m.def(
      "best_isa", [] { return std::string(isa_name(available_isas().front())); },
      "The instruction set 'auto' picks on this CPU.");
  m.def(
      "capabilities",
      [] {
        py::dict found;
        found["isa"] = std::string(isa_name(available_isas().front()));
        found["avx512_bf16"] = cpu_runs(Isa::kAvx512Bf16);
        found["amx_bf16"] = cpu_has_amx_bf16();
        return found;
      },
      "What this CPU runs: the widest instruction set ('isa'), and whether it has AVX512-BF16 "
      "('avx512_bf16') and usable AMX bf16 tiles ('amx_bf16').");
  m.def(
      "isas",
      [] {
        std::vector<std::string> names;
        for (const Isa isa : available_isas()) names.emplace_back(isa_name(isa));
        return names;
      },
      "The instruction sets this CPU runs, widest first.");
}
