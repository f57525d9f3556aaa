"""The cache of GGUF tokenizer conversions (kvkeeper.text.tokenizer): keyed by what transformers converts
(``tokenizer.*`` and ``general.architecture`` as stored), not by the file's path, and converted once per process
whatever cache folders are asked for.

* Files that differ only in tensors and other metadata share a key; a changed token or architecture changes it.
* Two synthetic files with SmolLM2's tokenizer (other seeds: other weights) share one folder of a cache.
* A second cache folder gets a copy of the first one's conversion: transformers' GGUF conversion is not called.
"""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from kvkeeper.text import tokenizer as tokenizer_mod  # noqa: E402
from kvkeeper.weights import synth_gguf  # noqa: E402


def _write(path, arch: str = "llama", tokens=("<s>", "a", "b"), other: int = 7, tensor: bool = False):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(list(tokens))
    w.add_uint32(f"{arch}.context_length", other)
    if tensor:
        w.add_tensor("token_embd.weight", np.ones((len(tokens), 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_key_follows_the_tokenizer_fields_not_the_path_tensors_or_other_metadata(tmp_path):
    key = tokenizer_mod._gguf_key
    base = key(_write(tmp_path / "a.gguf"))
    assert key(_write(tmp_path / "b.gguf", other=4096, tensor=True)) == base
    assert key(_write(tmp_path / "c.gguf", tokens=("<s>", "a", "c"))) != base
    assert key(_write(tmp_path / "d.gguf", arch="qwen3")) != base
    (tmp_path / "e.gguf").write_bytes(b"not a gguf file")  # unreadable here: keyed by path (transformers says why)
    assert key(tmp_path / "e.gguf") != key(tmp_path / "a.gguf")


def test_files_with_one_tokenizer_share_a_folder_and_a_second_cache_gets_a_copy(tmp_path, monkeypatch):
    a = synth_gguf.write_synthetic_gguf(tmp_path / "a.gguf", "tiny", seed=0)
    b = synth_gguf.write_synthetic_gguf(tmp_path / "b.gguf", "tiny", seed=1)
    assert a.read_bytes() != b.read_bytes()
    first = tokenizer_mod.load_tokenizer(a, tmp_path / "cache1")
    assert [p.name for p in (tmp_path / "cache1" / "tokenizers").iterdir()] == [tokenizer_mod._gguf_key(b)]

    from transformers import AutoTokenizer

    convert = AutoTokenizer.from_pretrained

    def no_conversion(*args, **kw):
        assert "gguf_file" not in kw, "converted the GGUF tokenizer again"
        return convert(*args, **kw)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", no_conversion)
    second = tokenizer_mod.load_tokenizer(b, tmp_path / "cache2")
    assert (tmp_path / "cache2" / "tokenizers" / tokenizer_mod._gguf_key(b) / "tokenizer.json").exists()
    text = "<|im_start|>user\nnaïve café 東京<|im_end|>"
    assert second.encode(text) == first.encode(text) and len(second) == len(first)
