// The Python module: the native CPU kernels of magicdec_kernels/cpu_native.py.

#include <torch/extension.h>

#include <string>
#include <vector>

namespace magicdec {
// slot_attention.cpp
torch::Tensor slot_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                             const torch::Tensor& v_cache, const torch::Tensor& q_indptr,
                             const torch::Tensor& head_slots, const torch::Tensor& kv_lens,
                             double scale, torch::Tensor out, const std::string& isa);
std::string best_isa();
std::vector<std::string> isa_names();
// few_rows_linear.cpp
torch::Tensor few_rows_linear(const torch::Tensor& x, const torch::Tensor& weight,
                              torch::Tensor out, const std::string& isa);
}  // namespace magicdec

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace magicdec;
  m.doc() = "MagicDec's CPU kernels: attention over lists of KV-pool slots, few-row products.";
  m.def("slot_attention", &slot_attention, py::arg("q"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("q_indptr"), py::arg("head_slots"), py::arg("kv_lens"), py::arg("scale"),
        py::arg("out"), py::arg("isa") = "auto", py::call_guard<py::gil_scoped_release>(),
        "Writes softmax(q k^T scale + causal) v into out and returns it; isa: 'auto', "
        "'avx512', 'avx2' or 'scalar'.");
  m.def("few_rows_linear", &few_rows_linear, py::arg("x"), py::arg("weight"), py::arg("out"),
        py::arg("isa") = "auto", py::call_guard<py::gil_scoped_release>(),
        "Writes x . weight^T into out ([rows, weight rows], x's dtype) and returns it; isa as "
        "for slot_attention.");
  m.def("best_isa", &best_isa, "The instruction set 'auto' picks on this CPU.");
  m.def("isas", &isa_names, "The instruction sets this CPU can run, widest first.");
}
