// ISA selection: the AVX-512 paths run when the CPU has every extension they use, unless set_isa("generic").
#include "common.h"

namespace kvk {

bool cpu_has_avx512() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  }();
  return ok;
}

namespace {
bool g_force_generic = false;
}  // namespace

bool use_avx512() { return !g_force_generic && cpu_has_avx512(); }

std::string isa() { return use_avx512() ? "avx512_vnni" : "generic"; }

void set_isa(const std::string& name) {
  if (name == "auto") {
    g_force_generic = false;
  } else if (name == "generic") {
    g_force_generic = true;
  } else if (name == "avx512_vnni") {
    TORCH_CHECK(cpu_has_avx512(), "this CPU lacks AVX-512 VNNI (avx512f/bw/vl/dq, avx512_vnni, f16c, fma)");
    g_force_generic = false;
  } else {
    TORCH_CHECK(false, "unknown ISA '", name, "': choose auto, generic or avx512_vnni");
  }
}

}  // namespace kvk
