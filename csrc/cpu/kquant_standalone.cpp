// Standalone extension of csrc/cpu/kquant.cpp for its tests and benchmark (tests/kernels/test_kquant.py,
// benchmarks/kquant_bench.py); the main extension calls register_kquant from its own PYBIND11_MODULE.
#include <torch/extension.h>

void register_kquant(pybind11::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { register_kquant(m); }
