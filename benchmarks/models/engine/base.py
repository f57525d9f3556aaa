"""Shared pieces of the engine benchmark: the run's settings (BenchConfig), the targets stated in the report,
logging, ratios and the machine's description."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch


ROOT = Path(__file__).resolve().parents[3]

GB = 1e9

# Targets (kvkeeper / peer), stated in the report next to the measured ratio.
TARGET_MULTITURN_LAST_TURN = 20.0   # transformers TTFT / kvkeeper TTFT at the last (10th) turn
TARGET_BATCHED_VS_GENERATE_BATCH = 2.0  # kvkeeper total tok/s / transformers generate_batch tok/s
TARGET_SINGLE_STREAM = 1.5          # kvkeeper decode tok/s / transformers generate decode tok/s
# against llama.cpp on the same GGUF (issue 11)
TARGET_DECODE_VS_LLAMA = 1.0        # kvkeeper decode tok/s / llama.cpp decode tok/s (short prompt; after 7k tokens)
TARGET_PREFILL_VS_LLAMA = 1.5       # llama.cpp prefill time / kvkeeper prefill time, 7k-token prompt
TARGET_TTFT_VS_LLAMA = 0.5          # kvkeeper TTFT / llama.cpp TTFT at turn 10 (at most)
TARGET_BATCHED_TOK_S = 300.0        # kvkeeper total tok/s, 16 streams x 64 tokens (at least)
TARGET_PPL_REL = 0.01               # |ppl(format) / ppl(none) - 1| at 4k tokens, default format
TARGET_AGREEMENT = 0.99             # per-position top-1 agreement with the float32 path, default format


@dataclass
class BenchConfig:
    quick: bool
    turns: int
    reply_tokens: int
    batch: int
    batch_new_tokens: int
    single_new_tokens: int
    copy_mib: int
    mm_n: int
    mm_reps: int
    copy_reps: int
    gemv_reps: int
    long_prompt_tokens: int = 7000
    long_new_tokens: int = 64
    short_turns: int = 10
    short_reply_tokens: int = 24
    ppl_context: int = 4096
    agree_prompts: int = 24
    agree_tokens: int = 64

    @classmethod
    def make(cls, quick: bool) -> "BenchConfig":
        if quick:
            return cls(True, turns=3, reply_tokens=32, batch=4, batch_new_tokens=16, single_new_tokens=16,
                       copy_mib=128, mm_n=1024, mm_reps=3, copy_reps=3, gemv_reps=2, long_prompt_tokens=600,
                       long_new_tokens=8, short_turns=3, ppl_context=512, agree_prompts=4, agree_tokens=16)
        return cls(False, turns=10, reply_tokens=160, batch=16, batch_new_tokens=64, single_new_tokens=128,
                   copy_mib=512, mm_n=2048, mm_reps=10, copy_reps=10, gemv_reps=10)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip()[:2000]


def _ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def machine_info() -> dict:
    from common import cpu_model

    cpu = cpu_model()
    import transformers

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu_model": cpu,
        "os_cpu_count": os.cpu_count(),
        "sched_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_start": load,
        "torch_blas": next((part.split("=", 1)[1] for part in torch.__config__.show().replace(",", " ").split()
                            if part.startswith("BLAS_INFO=")), None),
    }
