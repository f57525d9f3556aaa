"""Passkey retrieval over context lengths and needle depths (Mohtashami and Jaggi, 2023, "Landmark Attention").

A prompt of about ``length`` tokens repeats a filler paragraph; at ``depth`` (0 = start,
1 = end of the filler) it holds "The pass key is NNNNN. Remember it. NNNNN is the pass key.";
it ends with the question.  The model answers greedily (raw completion, no chat
template: the 135M instruct model solves it more often that way); a trial counts as
solved when the first five-digit number in the answer is the key.  Every trial of a
grid runs in one batch through the engine, with the given KV dtype (the engine's) and
compression policy (per request).
"""

from __future__ import annotations

import random
import time

from ..sampling.params import SamplingParams
from ..engine.handle import EngineHandle

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
         "memorize it. I will quiz you about it.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "\nWhat is the pass key? The pass key is"


def needle(key: int) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key. "


def build_prompt(tokenizer, length: int, depth: float, key: int) -> list[int]:
    """Token ids of one passkey prompt of about ``length`` tokens with the needle at ``depth`` in [0, 1]."""
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    fixed = len(enc(INTRO)) + len(enc(needle(key))) + len(enc(QUESTION))
    per = len(enc(FILLER * 8)) / 8
    n = max(0, int((length - fixed) / per))
    before = int(round(n * depth))
    text = INTRO + FILLER * before + needle(key) + FILLER * (n - before) + QUESTION
    return enc(text)


def answer_key(text: str) -> int | None:
    digits = ""
    for ch in text:
        if ch.isdigit():
            digits += ch
            if len(digits) == 5:
                return int(digits)
        elif digits:
            break
    return None


def passkey_grid(engine: EngineHandle, lengths: list[int], depths: list[float], trials: int = 3, seed: int = 0,
                 compression=None, max_tokens: int = 8) -> dict:
    """Accuracy per (length, depth) cell and overall.

    Returns ``{"cells": [{"length", "depth", "prompt_tokens", "solved", "trials", "accuracy"}], "accuracy",
    "trials", "kv_dtype", "policy", "ratio", "seconds"}``.
    """
    rng = random.Random(seed)
    jobs = []
    for L in lengths:
        for d in depths:
            for _ in range(trials):
                key = rng.randint(10000, 99999)
                jobs.append((L, d, key, build_prompt(engine.tokenizer, L, d, key)))
    t0 = time.perf_counter()
    outs = engine.generate([j[3] for j in jobs], SamplingParams(max_tokens=max_tokens), compression=compression)
    cells: dict[tuple[int, float], dict] = {}
    for (L, d, key, ids), o in zip(jobs, outs):
        c = cells.setdefault((L, d), {"length": L, "depth": d, "prompt_tokens": len(ids), "solved": 0, "trials": 0})
        c["trials"] += 1
        c["solved"] += int(answer_key(o.text) == key)
    for c in cells.values():
        c["accuracy"] = c["solved"] / c["trials"]
    solved = sum(c["solved"] for c in cells.values())
    return {"cells": list(cells.values()), "accuracy": solved / len(jobs), "trials": len(jobs),
            "kv_dtype": engine.kv.store.format.name, "policy": compression.policy if compression else None,
            "ratio": compression.ratio if compression else 0.0, "seconds": time.perf_counter() - t0}
