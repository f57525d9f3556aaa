"""KIVI int4 / int2 KV (kvkeeper.kvcache.formats, KiviPagedKV): the format, the 16-bit window, and the block
invariants under random workloads (a hypothesis state machine: sequences appending, finishing, offloaded and
restored, compacted, over a small pool and a small window, the kernel read beside the reference)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, \
    run_state_machine_as_test

from kvkeeper.attention import cpu, reference
from kvkeeper.attention.metadata import AttentionMetadata
from kvkeeper.kernels import cpu as cpu_kernels
from kvkeeper.kvcache.formats.base import FORMATS, KV_DTYPE_CHOICES, PagedKV, parse_kv_format
from kvkeeper.kvcache.formats.kivi import (KiviPagedKV, kivi_dequantize_keys, kivi_dequantize_values,
                                           kivi_quantize_keys, kivi_quantize_values, pack, unpack)
from kvkeeper.kvcache.store import KVStore


@pytest.mark.parametrize("bits", [4, 2])
def test_pack_unpack_and_error_bounds(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2 ** bits, (5, 3, 64), generator=g, dtype=torch.uint8)
    p = pack(codes, bits)
    assert p.shape == (5, 3, 64 * bits // 8) and torch.equal(unpack(p, bits), codes)
    fmt = FORMATS[f"int{bits}"]
    x = torch.randn(2, 16, 3, 64, generator=g) * 5
    kp, ks, km = kivi_quantize_keys(x, fmt)
    assert ks.shape == km.shape == (2, 3, 64)  # per channel over the block's tokens
    kerr = (kivi_dequantize_keys(kp, ks, km, bits) - x).abs()
    assert bool((kerr <= ks.float().unsqueeze(1) * 0.5 + 1e-2 * x.abs().amax()).all())
    vp, vs, vm = kivi_quantize_values(x, fmt)
    g_v = 64 if bits == 4 else 32
    assert vs.shape == (2, 16, 3, 64 // g_v)  # per token in groups of channels
    verr = (kivi_dequantize_values(vp, vs, vm, bits) - x).abs().view(2, 16, 3, 64 // g_v, g_v)
    assert bool((verr <= vs.float().unsqueeze(-1) * 0.5 + 1e-2 * x.abs().amax()).all())


def test_names_sizes_and_refusals():
    assert "int4" in KV_DTYPE_CHOICES and "int2" in KV_DTYPE_CHOICES
    assert parse_kv_format("INT4").kivi and not parse_kv_format("int8").kivi
    bf16 = parse_kv_format("bf16").bytes_per_token(30, 3, 64)
    assert bf16 == 23040
    assert parse_kv_format("int4").bytes_per_token(30, 3, 64) == 7560  # block 16: 0.328x bf16
    assert parse_kv_format("int4").bytes_per_token(30, 3, 64, block_size=32) == 6840  # 0.297x
    assert parse_kv_format("int2").bytes_per_token(30, 3, 64) == 5040
    c = PagedKV(10, 16, 3, 64, FORMATS["int4"])
    assert isinstance(c, KiviPagedKV) and c.bytes_per_token() * 30 == 7560 and c.head_dim == 64
    with pytest.raises(ValueError, match="latent"):
        PagedKV(4, 16, 1, 64, FORMATS["int4"], values=False)
    with pytest.raises(ValueError, match="multiple of 8"):
        PagedKV(4, 16, 1, 12, FORMATS["int2"])


def test_a_full_blocks_bytes_do_not_depend_on_how_it_was_written():
    """Prefilled at once, in chunks, or token by token: a closed block is the same bytes (what prefix-cache
    sharing relies on), and the open tail is its tokens in bfloat16."""
    g = torch.Generator().manual_seed(0)
    n = 45
    k, v = torch.randn(n, 2, 64, generator=g), torch.randn(n, 2, 64, generator=g)
    table = torch.tensor([3, 0, 5])
    slots = table[torch.arange(n) // 16] * 16 + torch.arange(n) % 16
    caches = [PagedKV(6, 16, 2, 64, FORMATS["int4"]) for _ in range(3)]
    caches[0].write(k, v, slots)
    for a, b in ((0, 7), (7, 30), (30, 45)):
        caches[1].write(k[a:b], v[a:b], slots[a:b])
    for i in torch.randperm(n, generator=g).sort().values.tolist():
        caches[2].write(k[i: i + 1], v[i: i + 1], slots[i: i + 1])
    blobs = [c.read_blocks(table) for c in caches]
    for b in blobs[1:]:
        assert all(torch.equal(blobs[0][p], b[p]) for p in b)
    kd, vd = caches[0].gather(table, n, torch.float32)
    assert torch.equal(kd[32:], k[32:].bfloat16().float()) and torch.equal(vd[32:], v[32:].bfloat16().float())


def test_window_pool_pressure_closes_the_least_recent_block_and_stays_readable():
    g = torch.Generator().manual_seed(1)
    c = PagedKV(8, 16, 1, 64, FORMATS["int4"], residual_blocks=2)
    k = torch.randn(3, 5, 1, 64, generator=g)
    for i, b in enumerate([1, 4, 6]):  # three open blocks, two window blocks: block 1 is closed early
        c.write(k[i], k[i], b * 16 + torch.arange(5))
    assert int(c.res_of[1]) == -1 and int(c.fill[1]) == 5 and int(c.res_of[4]) >= 0 and int(c.res_of[6]) >= 0
    kd, _ = c.gather(torch.tensor([1]), 5, torch.float32)
    assert float((kd - k[0]).abs().max()) < 0.5  # quantized over its 5 tokens
    c.write(k[0][:1], k[0][:1], torch.tensor([16 + 5]))  # appending reopens it (its tokens dequantized)
    assert int(c.res_of[1]) >= 0 and int(c.fill[1]) == 6
    kd2, _ = c.gather(torch.tensor([1]), 6, torch.float32)
    assert torch.equal(kd2[:5], kd.bfloat16().float()) and torch.equal(kd2[5], k[0][0].bfloat16().float())


def test_a_block_closed_in_a_step_keeps_its_16_bit_copy_for_that_step_only():
    """The own-block rule's bookkeeping: blocks closed by a write keep a 16-bit copy (res_of = -2 - window block)
    that the attention of their own queries reads; to everything else they are closed (offload payload, gather);
    the next write releases the copies, a kept block written again reopens from its exact copy, and a pool
    without a free block keeps no copy rather than closing another sequence's open block."""
    g = torch.Generator().manual_seed(2)
    c = PagedKV(8, 16, 2, 64, FORMATS["int4"], residual_blocks=3)
    k, v = torch.randn(40, 2, 64, generator=g), torch.randn(40, 2, 64, generator=g)
    table = torch.tensor([5, 2, 7])
    slots = table[torch.arange(40) // 16] * 16 + torch.arange(40) % 16
    c.write(k, v, slots)  # blocks 5 and 2 closed in this write, 7 open (8 tokens)
    assert c.kept == {5, 2} and int(c.res_of[5]) <= -2 and int(c.res_of[2]) <= -2 and int(c.res_of[7]) >= 0
    blob = c.read_blocks(table)
    assert blob["open"].tolist() == [False, False, True]  # a kept block travels as the closed block it is
    kc, _, kw, _, has = c.gather_for_reference(table, 40, torch.float32)
    assert has.tolist() == [True] * 40 and torch.equal(kw[:32], k[:32].bfloat16().float())
    assert not torch.equal(kc[:32], kw[:32])  # the codes, not the copy, for everyone else
    q = torch.randn(40, 4, 64, generator=g)  # every query of the step over the cache: kernel = reference
    one = cpu.kivi_attention(q, c, torch.tensor([0]), torch.tensor([40]), torch.tensor([40]), table[None], 0.125,
                             None) if cpu_kernels.available() else None
    ref = reference.kivi_span_attention(q, c, table, 40, None, 0.125)
    if one is not None:
        assert float((one - ref).abs().max() / ref.abs().max()) <= 1e-5
    c.write(k[8:9], v[8:9], torch.tensor([2 * 16 + 8]))  # block 2 written again: reopened from its exact copy
    assert c.kept == set() and int(c.res_of[5]) == -1 and int(c.res_of[2]) >= 0 and int(c.fill[2]) == 9
    kd, _ = c.gather(torch.tensor([2]), 9, torch.float32)
    assert torch.equal(kd, torch.cat([k[16:24], k[8:9]]).bfloat16().float())  # exact, not re-quantized
    full = PagedKV(8, 16, 1, 64, FORMATS["int4"], residual_blocks=1)
    full.write(k[:3, :1], v[:3, :1], torch.arange(3) + 16)  # an open block holds the only window block
    full.write(k[:16, :1], v[:16, :1], torch.arange(16) + 48)  # a full block: no free window block, no copy
    assert full.kept == set() and int(full.res_of[3]) == -1 and int(full.res_of[1]) >= 0


def test_store_payload_and_copy_tokens():
    g = torch.Generator().manual_seed(2)
    layers = [PagedKV(6, 16, 2, 64, FORMATS["int2"], layer_idx=i) for i in range(2)]
    for c in layers:
        c.write(torch.randn(40, 2, 64, generator=g), torch.randn(40, 2, 64, generator=g), torch.arange(40))
    store = KVStore(layers)
    assert store.head_dim == 64 and store.bytes_per_token == 2 * layers[0].bytes_per_token()
    blob = store.read_blocks([0, 2])  # block 2 is open (8 tokens)
    assert blob["0.open"].tolist() == [False, True] and blob["0.res_k"].shape == (1, 16, 2, 64)
    other = KVStore([PagedKV(6, 16, 2, 64, FORMATS["int2"], layer_idx=i) for i in range(2)])
    other.write_blocks([4, 1], blob)
    back = other.read_blocks([4, 1])
    assert all(torch.equal(blob[p], back[p]) for p in blob)
    with pytest.raises(ValueError, match="res_k"):
        other.write_blocks([4, 1], {**blob, "1.res_k": blob["1.res_k"][:0]})
    with pytest.raises(ValueError, match="another KV dtype"):
        KVStore([PagedKV(6, 16, 2, 64, FORMATS["int8"])]).write_blocks([0], {"0.k": blob["0.k"]})
    # per-head token copies (KV compression): dequantized, rewritten, so the destination reads back closely
    src = torch.tensor([[3, 5, 7], [4, 6, 8]])
    want = layers[0].read_slots(torch.tensor([3, 5, 7, 4, 6, 8]))
    layers[0].copy_tokens(src, torch.tensor([80, 81, 82]))
    got = layers[0].read_slots(torch.tensor([80, 81, 82]))
    assert torch.allclose(got["k"][:, 0], want["k"][:3, 0], atol=0.05)
    assert torch.allclose(got["k"][:, 1], want["k"][3:, 1], atol=0.05)


# ---- the state machine ----------------------------------------------------------------------------------
class KiviBlocksMachine(RuleBasedStateMachine):
    """Sequences over a small int4 (or int2) pool; a shadow copy of each sequence's tokens.  Invariants: every
    live sequence reads back its tokens (closed blocks: the quantization of their own bfloat16 tokens, bit for
    bit; the open tail: the bfloat16 tokens), the window's bookkeeping is consistent, and the kernel reads what
    the reference reads."""

    FMT = "int4"

    @initialize(nb=st.integers(6, 14), bs=st.sampled_from([16, 32]))
    def setup(self, nb, bs):
        self.bs, self.nb = bs, nb
        self.cache = PagedKV(nb, bs, 2, 32, FORMATS[self.FMT], residual_blocks=nb)
        self.free = list(range(nb))
        self.seqs: dict[int, dict] = {}
        self.gen = torch.Generator().manual_seed(nb * bs)
        self.next_id = 0

    def _blocks_needed(self, n):
        return -(-n // self.bs)

    @rule()
    def start(self):
        if not self.free:
            return
        self.seqs[self.next_id] = {"blocks": [self.free.pop(0)], "k": [], "v": []}
        self.next_id += 1

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(1, 40))
    def append(self, data, n):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        s = self.seqs[sid]
        L = len(s["k"])
        need = self._blocks_needed(L + n) - len(s["blocks"])
        if need > len(self.free):
            return
        s["blocks"] += [self.free.pop(0) for _ in range(need)]
        k = torch.randn(n, 2, 32, generator=self.gen) * 3
        v = torch.randn(n, 2, 32, generator=self.gen)
        pos = torch.arange(L, L + n)
        table = torch.tensor(s["blocks"])
        self.cache.write(k, v, table[pos // self.bs] * self.bs + pos % self.bs)
        s["k"] += list(k.bfloat16().float())
        s["v"] += list(v.bfloat16().float())

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        self.free += self.seqs.pop(sid)["blocks"]  # freed blocks keep their bytes (and a stale window)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def offload_and_restore(self, data):
        """Host tier: read the blocks raw, free them, scribble, restore into other blocks."""
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        s = self.seqs[sid]
        blob = self.cache.read_blocks(s["blocks"])
        self.free += s["blocks"]
        for name, t in self.cache._parts().items():
            t[torch.tensor(self.free)] = 7 if t.dtype == torch.uint8 else 0.5
        s["blocks"] = [self.free.pop(-1) for _ in range(len(blob["fill"]))]
        self.cache.write_blocks(s["blocks"], blob)
        back = self.cache.read_blocks(s["blocks"])
        assert all(torch.equal(blob[p], back[p]) for p in blob)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def compact(self, data):
        """Move one sequence's blocks to the lowest free ids (pool compaction)."""
        sid = data.draw(st.sampled_from(sorted(self.seqs)))
        s = self.seqs[sid]
        self.free.sort()
        if len(self.free) < len(s["blocks"]):
            return
        dst = [self.free.pop(0) for _ in s["blocks"]]
        self.cache.move_blocks(torch.tensor(s["blocks"]), torch.tensor(dst))
        self.free += s["blocks"]
        s["blocks"] = dst

    def _expected(self, s):
        n = len(s["k"])
        k, v = torch.stack(s["k"]), torch.stack(s["v"])
        out_k, out_v = k.clone(), v.clone()
        fmt = FORMATS[self.FMT]
        for i in range(n // self.bs):  # closed blocks: their own tokens quantized
            a, b = i * self.bs, (i + 1) * self.bs
            kp, ks, km = kivi_quantize_keys(k[None, a:b], fmt)
            out_k[a:b] = kivi_dequantize_keys(kp, ks, km, fmt.bits)[0]
            vp, vs, vm = kivi_quantize_values(v[a:b], fmt)
            out_v[a:b] = kivi_dequantize_values(vp, vs, vm, fmt.bits)
        return out_k, out_v

    @invariant()
    def sequences_read_back(self):
        if not hasattr(self, "cache"):
            return
        for s in self.seqs.values():
            n = len(s["k"])
            if not n:
                continue
            table = torch.tensor(s["blocks"])
            kd, vd = self.cache.gather(table, n, torch.float32)
            ek, ev = self._expected(s)
            assert torch.equal(kd, ek) and torch.equal(vd, ev)

    @invariant()
    def window_bookkeeping(self):
        if not hasattr(self, "cache"):
            return
        c = self.cache
        owned = {i: b for i, b in enumerate(c._owner) if b >= 0}
        assert len(owned) + len(c._free) == c.res_k.shape[0] and not set(owned) & set(c._free)
        for i, b in owned.items():  # an open block's window index, or a kept copy's (-2 - index: closed block)
            assert int(c.res_of[b]) == (-2 - i if b in c.kept else i)
        assert int((c.res_of != -1).sum()) == len(owned) and c.kept <= set(owned.values())
        for s in self.seqs.values():  # a live sequence's partial last block is open
            n = len(s["k"])
            if n % self.bs:
                assert int(c.res_of[s["blocks"][n // self.bs]]) >= 0

    @invariant()
    def kernel_reads_what_the_reference_reads(self):
        if not hasattr(self, "cache") or not cpu_kernels.available():
            return
        live = [s for s in self.seqs.values() if s["k"]]
        if not live:
            return
        width = max(len(s["blocks"]) for s in live)
        bt = torch.zeros(len(live), width, dtype=torch.int64)
        for i, s in enumerate(live):
            bt[i, : len(s["blocks"])] = torch.tensor(s["blocks"])
        lens = torch.tensor([len(s["k"]) for s in live])
        meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), decode_indices=torch.arange(len(live)),
                                 decode_block_tables=bt, decode_context_lens=lens, decode_max_len=int(lens.max()))
        q = torch.randn(len(live), 4, 32, generator=self.gen)
        ref = reference.decode_attention(q, self.cache, meta, 0.2)
        got = cpu.decode_attention(q, self.cache, meta, 0.2)
        assert float((ref - got).abs().max()) <= 1e-5 * float(ref.abs().max())


class KiviInt2Machine(KiviBlocksMachine):
    FMT = "int2"


@pytest.mark.parametrize("machine", [KiviBlocksMachine, KiviInt2Machine], ids=["int4", "int2"])
def test_kivi_block_state_machine(machine):
    run_state_machine_as_test(machine, settings=settings(max_examples=40, stateful_step_count=25, deadline=None,
                                                         suppress_health_check=[HealthCheck.too_slow]))


# ---- the engine on the real embedded model -------------------------------------------------------------
PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


@pytest.fixture(scope="module")
def bf16_reply():
    from kvkeeper import SamplingParams
    from tests.utils.engines import make_engine

    eng = make_engine(num_kv_blocks=64, kv_dtype="bf16", quantization="gguf")
    return eng.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0))[0]


@pytest.mark.parametrize("kv_dtype", ["int4", "int2"])
def test_engine_generates_with_kivi_kv_and_reuses_its_prefix(kv_dtype, bf16_reply):
    """Greedy text with int4 / int2 KV through the C++ kernels is coherent (int4: the bf16 KV reply's first
    tokens; int2: words), and a repeated prompt hits the prefix cache and gives the same reply, logprobs bit for bit.

    On the engine's default weights (GGUF blocks in place, the batch-invariant path): a token's K/V and logits do
    not depend on how many rows a step computes.  The float32 weights the suite uses elsewhere are not invariant
    (``ModelRunner.invariant``: ``layers.linear.Linear`` picks a BLAS layout by the row count and MKL's sums
    depend on it), so a prefix hit there computes the uncached tokens' K/V a few float32 ulps apart from the cold
    run; a 2-bit KV quantizes those ulps into whole codes, and this reply's 8th token is a near-tie (2306 against
    3906) that flipped on one CPU and not on another (tests/unit/kvcache/test_kivi_reuse.py shows both)."""
    from kvkeeper import SamplingParams
    from kvkeeper.kvcache.validate import check_engine
    from tests.utils.engines import make_engine

    assert make_engine(num_kv_blocks=64, kv_dtype=kv_dtype).block_size == 32  # KIVI's default block
    eng = make_engine(num_kv_blocks=64, kv_dtype=kv_dtype, block_size=16, quantization="gguf")
    assert eng.runner.kv_format.name == kv_dtype and eng.runner.attention_backend in ("cpu", "torch")
    greedy = SamplingParams(max_tokens=12, temperature=0, logprobs=2)
    first = eng.generate([PROMPT], greedy)[0]
    words = first.text.split()
    assert len(first.token_ids) >= 8 and len(words) >= 4 and sum(w.strip(".,!?'\"").isalpha() for w in words) >= 3
    if kv_dtype == "int4":
        assert first.token_ids[:8] == bf16_reply.token_ids[:8], (first.text, bf16_reply.text)
    again = eng.generate([PROMPT], greedy)[0]
    assert again.cached_tokens >= 16 and again.token_ids == first.token_ids and again.logprobs == first.logprobs
    assert not check_engine(eng)
