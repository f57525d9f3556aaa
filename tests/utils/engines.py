"""``make_engine``: an in-process ``LLMEngine`` with the suite's two defaults, as the CLI applies them at its edge.

* weight format: ``$KVKEEPER_QUANTIZATION`` if set, else the library's default (a GGUF file's blocks in place, bf16
  KV), unless the test names ``quantization`` (``"none"``: float32 weights, the exact path and the parity reference)
  or passes an ``EngineConfig``;
* ``validate_every``: ``$KVKEEPER_VALIDATE`` (default 1: the KV integrity validators before every engine step)
  unless the test names its own.

Every test that builds an engine in process builds it here; servers and CLI runs started by the tests read the same
two variables at their own edge.
"""

from __future__ import annotations

import os

from kvkeeper import LLMEngine
from kvkeeper.engine.config import EngineConfig


def default_quantization() -> str | None:
    """The weight format of the suite's engines: ``$KVKEEPER_QUANTIZATION``, None (the library's default) if unset or
    empty."""
    return os.environ.get("KVKEEPER_QUANTIZATION") or None


def default_validate_every() -> int:
    """Run the KV integrity validators before every N-th step: ``$KVKEEPER_VALIDATE``, 1 if unset."""
    return int(os.environ.get("KVKEEPER_VALIDATE", "1"))


def worker_threads(workers: int) -> int:
    """Threads for one of ``workers`` pytest-xdist workers, or for a server one of them starts: its share of the
    CPUs this process may use, at least 1 (tests/conftest.py's ``pytest_configure`` says why)."""
    from kvkeeper.worker.cpu_threads import available_cpus

    return max(1, available_cpus() // workers)


def make_engine(*args, **settings) -> LLMEngine:
    """``LLMEngine(*args, **settings)`` with the suite's defaults for ``quantization`` and ``validate_every``.

    Arguments are ``LLMEngine``'s: a model (id, path or folder) or an ``EngineConfig`` (whose weight format is
    kept), then settings by keyword.  Raises what ``LLMEngine`` raises (InvalidRequestError, ModelNotFoundError, ...).
    """
    if "quantization" not in settings and not (args and isinstance(args[0], EngineConfig)):
        settings["quantization"] = default_quantization()
    settings.setdefault("validate_every", default_validate_every())
    return LLMEngine(*args, **settings)


def alone_and_mixed(eng: LLMEngine, first: list[int], second: list[int], params, steps: int = 4):
    """Run ``first`` alone, then again with ``second``'s prefill landing after ``steps`` of its decode (so some of
    its steps are mixed prefill + decode); each in a namespace of its own (no prefix hits between the runs).

    Returns (the alone ``RequestOutput``, the mixed run's two ``Sequence`` objects); the batch-invariance tests
    compare the first's tokens and logprobs in both.
    """
    alone = eng.generate([first], params, namespace=eng.isolated_namespace())[0]
    s1 = eng.add_request(first, params, namespace=eng.isolated_namespace())
    for _ in range(steps):
        eng.step()
    s2 = eng.add_request(second, params, namespace=eng.isolated_namespace())
    eng.run_until_done([s1, s2])
    return alone, s1, s2


def assert_fused_equals_mixed(eng: LLMEngine, p1: list[int], p2: list[int], max_tokens: int = 12) -> None:
    """A decode token of ``eng`` (its fused C++ decode step on) gets the same tokens and logprobs, bit for bit,
    whether its steps are decode-only (fused) or mixed with ``p2``'s prefill (layer by layer)."""
    from kvkeeper import SamplingParams

    assert eng.runner.fused_decode is not None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=2)
    alone, s1, _ = alone_and_mixed(eng, p1, p2, params)
    assert list(s1.output_token_ids) == alone.token_ids
    assert [lp["top"] for lp in s1.logprobs] == [lp["top"] for lp in alone.logprobs]
