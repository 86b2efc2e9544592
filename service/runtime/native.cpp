// The C++ kernels' Python module (service/runtime/native.py builds it): packed_blocks.cpp, decode_attention.cpp.
#include <torch/extension.h>

at::Tensor blocks_mm(at::Tensor x, at::Tensor q, at::Tensor d, at::Tensor m, bool q4);
at::Tensor decode_attention(at::Tensor q, at::Tensor k, at::Tensor v, const std::optional<at::Tensor>& mask,
                            double scale, const std::optional<at::Tensor>& sources, int64_t chunk);

// Which of the kernels' vector paths this build holds (-march=native: the CPU it was built on). The portable path is
// slower than torch's own ops (docs/BENCHMARKS.md, "Kernels by instruction set"), so the callers keep torch's there.
std::string isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "portable";
#endif
}

// Both let go of the GIL while they run, as torch's own ops do: the service's event loop (streaming the deltas of
// the step before) runs beside the model's thread instead of waiting for the kernel to return.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  namespace py = pybind11;
  mod.def("isa", &isa, "the kernels' vector path: avx512, avx2 or portable");
  mod.def("blocks_mm", &blocks_mm, "x W^T on GGUF blocks, float32", py::call_guard<py::gil_scoped_release>());
  mod.def("decode_attention", &decode_attention, "one query token's grouped-query attention, float32",
          py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("scale"), py::arg("sources") = py::none(),
          py::arg("chunk") = 0, py::call_guard<py::gil_scoped_release>());
}
