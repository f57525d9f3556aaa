"""The dequantised-weights cache of a GGUF file (kvkeeper.weights.loader): built once when processes start on it
together.  A loader that finds no cache waits on the lock beside the cache file while another holds it, then reads
what that one wrote instead of dequantising the file again."""

from __future__ import annotations

import shutil
import threading

import torch

from kvkeeper.weights import loader


def test_a_loader_that_waited_on_the_lock_reads_the_cache_instead_of_dequantising(tiny_gguf, tmp_path, monkeypatch):
    want_cfg, want = loader.load_weights(tiny_gguf, tmp_path / "built")  # the cache another process would write
    built = sorted((tmp_path / "built" / "weights").glob(f"{want_cfg.revision}.*"))
    assert {p.suffix for p in built} >= {".safetensors", ".json"}

    def dequantise_again(*a, **kw):
        raise AssertionError("dequantised the file again")

    monkeypatch.setattr(loader, "load_gguf", dequantise_again)
    read, missed = loader._read_cached_gguf, threading.Event()

    def read_and_signal(*a):
        got = read(*a)
        if got is None:
            missed.set()
        return got

    monkeypatch.setattr(loader, "_read_cached_gguf", read_and_signal)
    folder = tmp_path / "cache" / "weights"
    out: dict = {}

    def load():
        try:
            out["got"] = loader.load_weights(tiny_gguf, tmp_path / "cache")
        except BaseException as e:  # noqa: BLE001  (handed to the test's thread)
            out["error"] = e

    with loader._exclusive(folder / f"{want_cfg.revision}.safetensors"):  # another process is building it
        t = threading.Thread(target=load)
        t.start()
        assert missed.wait(120), "the loader never looked for the cache"
        for p in built:  # ... and writes it while the loader waits
            shutil.copy(p, folder / p.name)
    t.join(120)
    assert "error" not in out, out.get("error")
    cfg, state = out["got"]
    assert cfg == want_cfg and set(state) == set(want)
    assert all(torch.equal(state[k], want[k]) for k in want)
