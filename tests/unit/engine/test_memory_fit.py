"""A model that cannot fit is refused before loading (kvkeeper.engine.memory_fit, kvkeeper.weights.footprint).

* the estimate's parts against the sizes an engine built from the same settings really holds: the KV pool
  (KVStore bytes, exactly), the weights as held (bytes of the mapped GGUF blocks, the repacked blocks, the dense
  tensors and transposed copies, exactly), the logits buffer (vocabulary x batch tokens x 4);
* :func:`available_memory` reads MemAvailable and a cgroup v2 limit (files written here);
* a model whose estimate exceeds a (monkeypatched) available memory is refused with InsufficientMemoryError naming
  both numbers and the flags, before the loader runs; ``memory_check=False`` loads it anyway;
* the CLI prints the refusal as one ``error:`` line, exit code 2, no traceback.
"""

import re
import shutil

import pytest
import torch

from kvkeeper.engine import memory_fit as mf
from kvkeeper.engine.config import EngineConfig
from kvkeeper.errors import InsufficientMemoryError
from kvkeeper.layers.gguf_linear import GGUFEmbedding, GGUFLinear
from kvkeeper.layers.linear import Linear
from kvkeeper.layers.quantized import QuantEmbedding, QuantLinear
from kvkeeper.weights.footprint import packed_bytes
from kvkeeper.weights import synth_gguf
from tests.utils.engines import make_engine
from tests.utils.tiny_models import tiny_llama_folder

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return synth_gguf.write_synthetic_gguf(tmp_path_factory.mktemp("synth") / "tiny-q4_k_m.gguf", "tiny", seed=0)


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_gguf, tmp_path_factory):
    """The tiny file's tokenizer as kvkeeper's cache keeps it (``tokenizers/<key>``), converted once: transformers'
    conversion of a GGUF tokenizer costs about 8 s of CPU, which every test here paid again in its own cache."""
    from kvkeeper.text.tokenizer import load_tokenizer

    folder = tmp_path_factory.mktemp("tokenizer-cache")
    load_tokenizer(tiny_gguf, folder)
    return folder / "tokenizers"


@pytest.fixture
def cache(tmp_path, tiny_tokenizer):
    """A fresh cache folder for one test (no packed or dequantized weights: the estimate sees a cold cache) with
    the tiny file's converted tokenizer already in it."""
    shutil.copytree(tiny_tokenizer, tmp_path / "tokenizers")
    return tmp_path


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("tiny-hf"))


def held_bytes(model) -> dict[str, int]:
    """What a built model holds: mapped GGUF blocks, repacked blocks, dense tensors (parameters and transposed
    copies; not the RoPE tables, counted as working buffers)."""
    out = {"mapped": 0, "repacked": 0, "dense": 0}
    for m in model.modules():
        if isinstance(m, GGUFLinear):
            out["mapped"] += m.nbytes
        elif isinstance(m, GGUFEmbedding):
            out["mapped"] += m.weight_gguf.nbytes
        elif isinstance(m, (QuantLinear, QuantEmbedding)):
            out["repacked"] += m.packed.nbytes
        if isinstance(m, Linear) and m.transposed is not None:
            out["dense"] += m.transposed.numel() * m.transposed.element_size()
    out["dense"] += sum(p.numel() * p.element_size() for p in model.parameters())
    lm_t = getattr(model, "_lm_t", None)
    out["dense"] += 0 if lm_t is None else lm_t.numel() * lm_t.element_size()
    return out


def test_packed_bytes():
    assert packed_bytes(16, 32, 4) == 16 * 20  # 16 bytes of 4-bit codes + 4 of scales per row and block
    assert packed_bytes(17, 64, 8) == 32 * 2 * 36  # rows padded to 32, two blocks of 32 + 4 bytes


@pytest.mark.parametrize("quantization", ["auto", "none", "int8", "int4"])
def test_estimate_parts_match_the_engine(tiny_gguf, cache, quantization):
    settings = dict(quantization=quantization, cache_dir=str(cache), kv_cache_bytes=3 << 20,
                    max_num_batched_tokens=64)
    est = mf.estimate(EngineConfig(model=str(tiny_gguf), **settings), tiny_gguf, CPU, torch.float32)
    eng = make_engine(str(tiny_gguf), **settings)
    r = eng.runner
    assert est.weights.format == r.weight_format
    assert est.kv_pool == r.kv_cache_bytes and est.notes["kv_blocks"] == r.num_blocks
    held = held_bytes(r.model)
    assert (est.weights.mapped, est.weights.repacked, est.weights.dense) == (held["mapped"], held["repacked"],
                                                                             held["dense"])
    mcfg = eng.model_config
    assert est.logits == mcfg.vocab_size * 64 * 4
    assert est.rope == r.model.rope.cos.numel() * 4 * 2
    if quantization in ("int8", "int4"):  # quantized from the float32 state: it is alive while loading
        assert est.weights.load_extra > est.weights.repacked
    assert est.total == est.weights.peak + est.kv_pool + est.logits + est.activations + est.attention + est.rope


def test_estimate_of_a_hf_folder(tiny_hf, tmp_path):
    settings = dict(quantization="none", cache_dir=str(tmp_path), kv_cache_bytes=1 << 20)
    est = mf.estimate(EngineConfig(model=str(tiny_hf), **settings), tiny_hf, CPU, torch.float32)
    eng = make_engine(str(tiny_hf), **settings)
    assert est.weights.dense == held_bytes(eng.runner.model)["dense"]  # float32 weights plus transposed copies
    assert est.kv_pool == eng.runner.kv_cache_bytes


V2_MOUNT = "30 25 0:26 {root} {point} rw,nosuid - cgroup2 cgroup2 rw"
V1_MEM_MOUNT = "35 30 0:31 {root} {point} rw,nosuid - cgroup cgroup rw,memory"


def test_available_memory_reads_meminfo_and_the_own_cgroup(tmp_path, monkeypatch):
    (tmp_path / "meminfo").write_text("MemTotal:  24000000 kB\nMemAvailable:    2000000 kB\n")
    monkeypatch.setattr(mf, "MEMINFO", tmp_path / "meminfo")
    # the limit sits on the process's own cgroup below the mount's root (a systemd service's MemoryMax=)
    (tmp_path / "proc-cgroup").write_text("0::/system.slice/kvk.service\n")
    (tmp_path / "mountinfo").write_text(V2_MOUNT.format(root="/", point=tmp_path / "cg") + "\n")
    cg = tmp_path / "cg" / "system.slice" / "kvk.service"
    cg.mkdir(parents=True)
    (cg / "memory.max").write_text("max\n")
    (cg / "memory.current").write_text("123\n")
    paths = (tmp_path / "proc-cgroup", tmp_path / "mountinfo")
    assert mf.available_memory(*paths) == (2000000 * 1024, "MemAvailable in /proc/meminfo")
    (cg / "memory.max").write_text(f"{1 << 30}\n")
    (cg / "memory.current").write_text(f"{256 << 20}\n")
    got, where = mf.available_memory(*paths)
    assert got == (1 << 30) - (256 << 20) and "cgroup" in where and "kvk.service" in where
    # a parent's lower limit binds
    (tmp_path / "cg" / "system.slice" / "memory.max").write_text(f"{512 << 20}\n")
    (tmp_path / "cg" / "system.slice" / "memory.current").write_text(f"{256 << 20}\n")
    assert mf.available_memory(*paths)[0] == 256 << 20
    monkeypatch.setattr(mf, "MEMINFO", tmp_path / "missing")
    assert mf.available_memory(tmp_path / "missing", tmp_path / "missing") == (0, "unknown")


def test_available_memory_reads_a_v1_memory_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(mf, "MEMINFO", tmp_path / "missing")
    (tmp_path / "proc-cgroup").write_text("5:cpu,cpuacct:/kvk\n4:memory:/kvk\n0::/\n")
    (tmp_path / "mountinfo").write_text(V1_MEM_MOUNT.format(root="/", point=tmp_path / "memory") + "\n")
    cg = tmp_path / "memory" / "kvk"
    cg.mkdir(parents=True)
    (cg / "memory.limit_in_bytes").write_text(str(9223372036854771712))  # v1's "no limit"
    (cg / "memory.usage_in_bytes").write_text(str(100 << 20))
    paths = (tmp_path / "proc-cgroup", tmp_path / "mountinfo")
    assert mf.available_memory(*paths) == (0, "unknown")
    (cg / "memory.limit_in_bytes").write_text(str(1 << 30))
    assert mf.available_memory(*paths)[0] == (1 << 30) - (100 << 20)


def _too_little(monkeypatch, available: int = 1 << 20):
    monkeypatch.setattr(mf, "available_memory", lambda: (available, "MemAvailable in /proc/meminfo"))


def test_a_model_that_does_not_fit_is_refused_before_loading(tiny_gguf, cache, monkeypatch):
    _too_little(monkeypatch)
    monkeypatch.setattr(mf, "load_model", lambda *a, **k: pytest.fail("the loader ran"))
    with pytest.raises(InsufficientMemoryError) as e:
        make_engine(str(tiny_gguf), cache_dir=str(cache))
    msg = str(e.value)
    assert e.value.available == 1 << 20 and e.value.needed > e.value.available
    assert f"{e.value.needed / (1 << 30):.2f} GiB" in msg and "0.00 GiB is available" in msg
    for flag in ("--kv-cache-bytes", "--max-model-len", "--quantization", "--no-memory-check"):
        assert flag in msg


def test_memory_check_off_loads_anyway(tiny_gguf, cache, monkeypatch):
    _too_little(monkeypatch)
    eng = make_engine(str(tiny_gguf), cache_dir=str(cache), kv_cache_bytes=1 << 20, memory_check=False)
    assert eng.memory_estimate is None and eng.pool.num_blocks > 0


def test_a_model_that_fits_is_accepted(tiny_gguf, cache, monkeypatch):
    _too_little(monkeypatch, 64 << 30)
    eng = make_engine(str(tiny_gguf), cache_dir=str(cache), kv_cache_bytes=1 << 20)
    assert 0 < eng.memory_estimate.total < 64 << 30


def test_cli_refusal_is_one_error_line(tiny_gguf, cache, monkeypatch, capsys):
    from kvkeeper.cli import main

    _too_little(monkeypatch)
    rc = main(["generate", "--model", str(tiny_gguf), "--prompt", "Hi", "--max-tokens", "1",
               "--cache-dir", str(cache)])
    err = capsys.readouterr().err
    assert rc == 2
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err
    assert re.search(r"needs about [\d.]+ GiB of memory but 0\.00 GiB is available", lines[0])
    assert "--kv-cache-bytes" in lines[0] and "--max-model-len" in lines[0]
