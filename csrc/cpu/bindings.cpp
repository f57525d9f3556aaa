// The Python module of the CPU kernels (kvkeeper.kernels.cpu loads it): the kernels of namespace kvk, plus the
// K-quant kernels of kquant.cpp (register_kquant adds their bindings).
#include <torch/extension.h>

#include "common.h"

void register_kquant(pybind11::module_& m);  // kquant.cpp

using namespace kvk;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvkeeper CPU kernels (see csrc/cpu/)";
  m.def("isa", &isa, "the instruction set the kernels use now: avx512_vnni, avx2 or generic");
  m.def("set_isa", &set_isa, "force the kernels' instruction set: auto, generic, avx2 or avx512_vnni (tests)");
  m.def("cpu_has_avx512", &cpu_has_avx512, "whether this CPU has AVX-512 F/BW/VL/DQ + VNNI + F16C + FMA");
  m.def("cpu_has_avx2", &cpu_has_avx2, "whether this CPU has AVX2 + FMA + F16C");
  m.def("qmm", &qmm, "y (M, N) float32 = x (M, K) float32 @ W^T over interleaved 4-/8-bit blocks",
        py::arg("x"), py::arg("qs"), py::arg("sc"), py::arg("bits"), py::arg("n"));
  m.def("quantize_activations", &quantize_activations, "x (M, K) float32 -> (codes int32 (M, K), dx, sx (M, K/32))");
  m.def("activation_bits", &activation_bits, "bits of the activation codes in qmm: 16 (default) or 8");
  m.def("set_activation_bits", &set_activation_bits, "16 (default) or 8: llama.cpp's Q8_1 precision (measurements)");
  m.def("invariant_attention", &invariant_attention,
        "whether decode attention runs the invariant kernel (the prefill kernel's arithmetic, no context splits)");
  m.def("set_invariant_attention", &set_invariant_attention,
        "True (default): invariant decode attention; False: the previous flash-decoding kernel (faster at long "
        "contexts, a decoded token's K/V then differs in the last bits from the same token prefilled)");
  m.def("extend_attention", &extend_attention, "paged causal attention of prefill spans, read in place",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_scale"), py::arg("v_scale"), py::arg("starts"),
        py::arg("q_lens"), py::arg("context_lens"), py::arg("block_tables"), py::arg("scale"), py::arg("kind"),
        py::arg("window") = 0);
  m.def("kivi_attention", &kivi_attention, "paged causal attention over KIVI int4/int2 KV, read in place (decode "
        "tokens are spans of one query)", py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_scale"),
        py::arg("k_min"), py::arg("v_scale"), py::arg("v_min"), py::arg("res_of"), py::arg("res_k"), py::arg("res_v"),
        py::arg("starts"), py::arg("q_lens"), py::arg("context_lens"), py::arg("block_tables"), py::arg("scale"),
        py::arg("bits"), py::arg("window") = 0);
  m.def("rmsnorm", &rmsnorm, "RMSNorm of x (..., N) float32 by w (N,) (the fused step's routine)");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up of gate_up (M, 2I) float32 -> (M, I)");
  m.def("gelu_mul", &gelu_mul, "GELU(tanh)(gate) * up of gate_up (M, 2I) float32 -> (M, I)");
  m.def("rope_qk", &rope_qk, "RoPE in place on the first heads of qkv (T, ...) float32, cos/sin (T, D)");
  m.def("decode_attention", &decode_attention, "paged decode attention read in place (see csrc/cpu/attention.cpp)",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("k_scale"), py::arg("v_scale"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("kind"), py::arg("split_blocks"), py::arg("window") = 0);
  py::class_<DecodeModel>(m, "DecodeModel", "a whole decode step over packed or GGUF weights (kvkeeper.worker.fused_decode)")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, int64_t>(), py::arg("hidden"),
           py::arg("inter"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("eps"),
           py::arg("kind"))
      .def("add_layer", &DecodeModel::add_layer)
      .def("add_layer_gguf", &DecodeModel::add_layer_gguf, "a layer over GGUF matrices in place: each projection a "
           "list of (bytes uint8, ggml type, N, K, perm int64 or empty)")
      .def("step", &DecodeModel::step, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("slots"),
           py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"), py::arg("split_blocks"))
      .def("set_style", &DecodeModel::set_style, py::arg("act"), py::arg("window"))
      .def("set_layer_norms", &DecodeModel::set_layer_norms, py::arg("i"), py::arg("q_norm"), py::arg("k_norm"),
           py::arg("post_attn"), py::arg("post_ffw"), py::arg("sliding"))
      .def("step_hybrid", &DecodeModel::step_hybrid, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("slots"),
           py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"), py::arg("split_blocks"),
           py::arg("cos_local"), py::arg("sin_local"), py::arg("slots_local"), py::arg("block_tables_local"),
           py::arg("context_lens_local"))
      .def("num_layers", &DecodeModel::num_layers);
  register_kquant(m);
}
