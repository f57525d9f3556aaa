"""KV reuse on a KIVI int4 / int2 cache gives the cold run's logprobs bit for bit (a tiny random Llama).

A prefix-cache hit at a block boundary and a session turn that resumes mid-block are compared with the same prompt
computed from scratch, on each instruction set the C++ kernels can dispatch to on this CPU (attention and the
weight kernels both forced).  The weights are int8 (the kernels' block path: integer sums, row-independent
activation codes), on which a token's K/V does not depend on how many rows its step computed.  Float32 weights
are not that path (``ModelRunner.invariant``): there ``layers.linear.Linear``'s BLAS product sums a row
differently for a different row count, and these comparisons fail (measured on the 2-core AMD EPYC, 2026-12-07:
layer 0's K of the uncached tokens up to 9e-8 apart, the logprobs unequal for bf16, int4 and int2 KV alike).
"""

from __future__ import annotations

import pytest
import torch

from kvkeeper import SamplingParams
from kvkeeper.kernels import cpu as cpu_kernels
from kvkeeper.sessions import SessionManager

from tests.utils.engines import make_engine
from tests.utils.tiny_models import tiny_llama_folder

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the C++ kernels are not built")

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=5)
# (attention set_isa, weight kernels kq_set_isa)
# (avx2: the qmm block matmul of these int8 weights and the K-quant kernels in AVX2; attention generic)
ISAS = {"generic": ("generic", "generic"), "avx2": ("avx2", "avx2"), "avx512": ("avx512_vnni", "avx512")}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_llama_folder(tmp_path_factory.mktemp("tiny-kivi-reuse"), hidden_size=64, head_dim=16, num_heads=4,
                             num_kv_heads=2, vocab_size=512)


@pytest.fixture(params=sorted(ISAS))
def isa(request):
    mod = cpu_kernels.load()
    if request.param == "avx512" and not mod.cpu_has_avx512():
        pytest.skip("this CPU has no AVX-512 VNNI")
    if request.param == "avx2" and not mod.cpu_has_avx2():
        pytest.skip("this CPU has no AVX2 + FMA + F16C")
    attention, weights = ISAS[request.param]
    mod.set_isa(attention)
    mod.kq_set_isa(weights)
    yield request.param
    mod.set_isa("auto")
    mod.kq_set_isa("auto")


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(folder, kv_dtype: str):
    eng = make_engine(str(folder), quantization="int8", kv_dtype=kv_dtype, block_size=16, num_kv_blocks=64)
    assert eng.runner.kv_format.name == kv_dtype and eng.runner.attention_backend == "cpu"
    return eng


def _cold(eng, prompt: list[int]):
    return eng.generate([prompt], GREEDY, namespace=eng.isolated_namespace())[0]


@pytest.mark.parametrize("kv_dtype", ["int4", "int2"])
def test_a_prefix_hit_at_a_block_boundary_gives_the_cold_logprobs(folder, kv_dtype, isa):
    eng = _engine(folder, kv_dtype)
    prompt = _ids(41, seed=1)
    cold = _cold(eng, prompt)
    ns = eng.isolated_namespace()
    eng.generate([prompt[:35]], SamplingParams(max_tokens=1, temperature=0.0), namespace=ns)
    hit = eng.generate([prompt], GREEDY, namespace=ns)[0]
    assert hit.cached_tokens == 32  # two full blocks of 16
    assert hit.token_ids == cold.token_ids and hit.logprobs == cold.logprobs


@pytest.mark.parametrize("kv_dtype", ["int4", "int2"])
def test_a_session_turn_resuming_mid_block_gives_the_cold_logprobs(folder, kv_dtype, isa):
    eng = _engine(folder, kv_dtype)
    first = _ids(20, seed=2)
    sessions = SessionManager(eng)
    s = sessions.open()
    try:
        a = s.begin_turn(prompt=first, params=SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        eng.run_until_done([a])
        b = s.begin_turn(prompt=list(a.token_ids) + _ids(10, seed=3), params=GREEDY)
        eng.run_until_done([b])
    finally:
        s.close()
    reused = b.num_cached_tokens
    assert reused % 16 and reused >= 20  # resumed inside a block (the turn's own KV, not only full blocks)
    cold = _cold(eng, list(b.token_ids[: b.num_prompt_tokens]))
    assert list(b.output_token_ids) == cold.token_ids and b.logprobs == cold.logprobs
