// ISA selection: the AVX-512 paths run when the CPU has every extension they use; on a CPU without them the
// AVX2 paths (AVX2 + FMA + F16C: the qmm block matmul, the portable attention routine) run; set_isa("generic") / ("avx2") force a lower level.
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

bool cpu_has_avx2() {
  static const bool ok = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return ok;
}

namespace {
enum class Level { Auto, Generic, Avx2 };  // Avx2: the AVX2 paths even on an AVX-512 CPU (tests)
Level g_level = Level::Auto;
}  // namespace

bool use_avx512() { return g_level == Level::Auto && cpu_has_avx512(); }

bool use_avx2() { return g_level != Level::Generic && !use_avx512() && cpu_has_avx2(); }

std::string isa() { return use_avx512() ? "avx512_vnni" : use_avx2() ? "avx2" : "generic"; }

void set_isa(const std::string& name) {
  if (name == "auto") {
    g_level = Level::Auto;
  } else if (name == "generic") {
    g_level = Level::Generic;
  } else if (name == "avx2") {
    TORCH_CHECK(cpu_has_avx2(), "this CPU lacks AVX2 (avx2, fma, f16c)");
    g_level = Level::Avx2;
  } else if (name == "avx512_vnni") {
    TORCH_CHECK(cpu_has_avx512(), "this CPU lacks AVX-512 VNNI (avx512f/bw/vl/dq, avx512_vnni, f16c, fma)");
    g_level = Level::Auto;
  } else {
    TORCH_CHECK(false, "unknown ISA '", name, "': choose auto, generic, avx2 or avx512_vnni");
  }
}

}  // namespace kvk
