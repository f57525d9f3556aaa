"""Compile kvkeeper's Triton kernels for an NVIDIA target without a GPU (used by test_triton_compile.py).

Run as ``python tests/utils/triton_aot.py ARCH`` (e.g. 90 for H100/H200) with TRITON_INTERPRET unset: each
kernel variant the CUDA path launches (bf16/fp16/fp32 compute; bf16, int8 and fp8 caches; GPU tile
sizes, head_dim 128) goes through Triton's NVIDIA backend down to a cubin with the bundled ptxas.
Prints one ``ok NAME`` line per variant; any compile error ends the run with a traceback.
"""

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvkeeper.attention import triton_backend as tk  # noqa: E402


def build(target, fn, types, constexprs, name):
    sig = {n: ("constexpr" if n in constexprs else types[n]) for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, constexprs), target=target, options={"num_warps": 4})
    assert k.asm.get("cubin"), name
    print(f"ok {name} shared={k.metadata.shared}", flush=True)


def main(arch: int) -> None:
    target = GPUTarget("cuda", arch, 32)
    i32 = "i32"
    variants = [("bf16", "*bf16", "*bf16", False), ("int8", "*bf16", "*i8", True), ("fp8", "*bf16", "*fp8e4nv", True),
                ("fp16", "*fp16", "*fp16", False), ("fp32", "*fp32", "*fp32", False)]
    for name, cdt, ct, scales in variants:
        sc = "*fp16" if scales else ct
        build(target, tk._decode_split_kernel,
              dict(q_ptr=cdt, kc_ptr=ct, vc_ptr=ct, ksc_ptr=sc, vsc_ptr=sc, bt_ptr="*i64", len_ptr="*i64",
                   acc_ptr="*fp32", ml_ptr="*fp32", scale="fp32", stride_qb=i32, stride_qh=i32, stride_bt=i32,
                   num_splits=i32, KVH=i32, D=i32, G=i32, BS=i32),
              dict(HAS_SCALES=scales, BLOCK_G=16, BLOCK_N=64, BLOCK_D=128, BT_FAULT=0, DOT_F32=False), f"decode/{name}")
        build(target, tk._extend_kernel,
              dict(q_ptr=cdt, o_ptr=cdt, kc_ptr=ct, vc_ptr=ct, ksc_ptr=sc, vsc_ptr=sc, bt_ptr="*i64",
                   qstart_ptr="*i64", qlen_ptr="*i64", ctx_ptr="*i64", scale="fp32", stride_qt=i32, stride_qh=i32,
                   stride_ot=i32, stride_oh=i32, stride_bt=i32, KVH=i32, D=i32, G=i32, BS=i32),
              dict(HAS_SCALES=scales, BLOCK_M=64, BLOCK_N=64, BLOCK_D=128, BT_FAULT=0, DOT_F32=False), f"extend/{name}")
    build(target, tk._decode_reduce_kernel,
          dict(acc_ptr="*fp32", ml_ptr="*fp32", o_ptr="*bf16", stride_ob=i32, stride_oh=i32, num_splits=i32, H=i32, D=i32),
          dict(BLOCK_S=64, BLOCK_D=128), "reduce")
    for name, vt, scales in (("bf16", "*bf16", False), ("int8", "*i8", True), ("fp8-bytes", "*u8", True)):
        build(target, tk._store_kv_kernel,
              dict(k_ptr=vt, v_ptr=vt, kc_ptr=vt, vc_ptr=vt, ksn_ptr="*fp16", vsn_ptr="*fp16", ksc_ptr="*fp16",
                   vsc_ptr="*fp16", slot_ptr="*i64", stride_kt=i32, stride_kh=i32, stride_vt=i32, stride_vh=i32,
                   KVH=i32, D=i32),
              dict(HAS_SCALES=scales, BLOCK_D=128), f"store/{name}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
