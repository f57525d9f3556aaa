"""KV compression policies: the tokens kept, the blocks freed, positions, and decoding against a reference.

The reference is written here independently of ``kvkeeper.kvcache.compression``:
plain rules over transformers' own keys and attention probabilities (eager
attention, ``output_attentions=True``) on a tiny random Llama; transformers'
``DynamicCache`` is pruned per KV head with the reference's indices and greedy
decoding continues from the original positions.  kvkeeper must produce the same
tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvkeeper import SamplingParams
from kvkeeper.errors import InvalidRequestError
from kvkeeper.kvcache.compression import PREFILL_COMPRESSION_POLICIES, KVCompression, PrefillObserver, select
from kvkeeper.sessions import SessionManager
from tests.utils.engines import make_engine
from tests.utils.tiny_models import tiny_compression_llama

transformers = pytest.importorskip("transformers")

SINKS, WINDOW, KERNEL = 4, 8, 5


def comp(policy: str, ratio: float = 0.5) -> KVCompression:
    return KVCompression(policy, ratio, n_sink=SINKS, window=WINDOW, kernel=KERNEL)


# ---- the reference rules (plain, one head at a time) -----------------------------------------


def ref_indices(policy: str, ratio: float, keys: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """keys (KVH, L, D); probs (H, L, L) causal attention probabilities of the prompt -> (KVH, k) kept indices."""
    kvh, L, _ = keys.shape
    g = probs.shape[0] // kvh
    k = max(1, int(L * (1 - ratio)))
    out = []
    for h in range(kvh):
        p = probs[h * g:(h + 1) * g]  # (g, L, L) the query heads of this KV head
        if policy == "streaming_llm":
            keep = list(range(min(SINKS, k))) + list(range(L - (k - min(SINKS, k)), L))
        elif policy == "knorm":
            norms = keys[h].norm(dim=-1)
            keep = sorted(range(L), key=lambda t: norms[t].item())[:k]
        elif policy == "h2o":
            recent = k // 2
            received = p.sum(dim=(0, 1))  # attention each key got from every query
            old = sorted(range(L - recent), key=lambda t: -received[t].item())[: k - recent]
            keep = old + list(range(L - recent, L))
        else:  # snapkv
            w = min(WINDOW, L)
            if k <= w:
                keep = list(range(L - k, L))
            else:
                votes = p[:, L - w:, : L - w].sum(dim=(0, 1))  # window queries' attention to the prefix
                pooled = [votes[max(0, t - KERNEL // 2): t + KERNEL // 2 + 1].mean().item() for t in range(L - w)]
                old = sorted(range(L - w), key=lambda t: -pooled[t])[: k - w]
                keep = old + list(range(L - w, L))
        out.append(sorted(keep))
    return torch.tensor(out)


# ---- rules and observer in isolation ---------------------------------------------------------


def _random_attention(L=40, H=4, kvh=2, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(L, H, D, generator=g), torch.randn(L, kvh, D, generator=g)
    s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(H // kvh, dim=1)) * D ** -0.5
    s.masked_fill_(torch.triu(torch.ones(L, L, dtype=torch.bool), 1), float("-inf"))
    return q, k, torch.softmax(s, -1)


@pytest.mark.parametrize("policy", PREFILL_COMPRESSION_POLICIES)
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.9])
def test_select_matches_the_reference_rule(policy, ratio):
    q, k, probs = _random_attention()
    c = comp(policy, ratio)
    obs = PrefillObserver(c, 40, 1, 2)
    for a, b in ((0, 17), (17, 40)):  # observed in two chunks, as chunked prefill does
        obs.observe(0, q[a:b], k[:b], a, 8 ** -0.5)
    got = select(c, obs, 0, k)
    assert got.shape == (2, c.n_keep(40))
    assert torch.equal(got, ref_indices(policy, ratio, k.transpose(0, 1), probs))


def test_observer_accumulates_exact_attention():
    q, k, probs = _random_attention(L=30)
    obs = PrefillObserver(comp("h2o"), 30, 1, 2)
    obs.observe(0, q[:11], k[:11], 0, 8 ** -0.5)
    obs.observe(0, q[11:], k, 11, 8 ** -0.5)
    want = probs.view(2, 2, 30, 30).sum(dim=(1, 2))
    assert torch.allclose(obs.acc[0], want, atol=1e-5)


def test_bad_policy_and_ratio_are_clear_errors():
    with pytest.raises(InvalidRequestError, match="snapkv"):
        KVCompression("random", 0.5)
    with pytest.raises(InvalidRequestError, match=r"\[0, 1\)"):
        KVCompression("knorm", 1.0)


# ---- end to end on a tiny random Llama --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder, hf, tok = tiny_compression_llama(tmp_path_factory.mktemp("tiny-compress"))
    return folder, hf


def hf_decode_after_pruning(hf, ids: list[int], policy: str, ratio: float, n: int) -> list[int]:
    """Greedy tokens from transformers with its cache pruned per KV head by the reference rule."""
    L = len(ids)
    with torch.inference_mode():
        out = hf(torch.tensor([ids]), use_cache=True, output_attentions=True)
        cache = out.past_key_values
        for i, layer in enumerate(cache.layers):
            idx = ref_indices(policy, ratio, layer.keys[0], out.attentions[i][0])  # (KVH, k)
            gather = idx[None, :, :, None].expand(1, -1, -1, layer.keys.shape[-1])
            layer.keys = layer.keys.gather(2, gather)
            layer.values = layer.values.gather(2, gather)
        toks = [int(out.logits[0, -1].argmax())]
        kept = cache.get_seq_length()
        for step in range(n - 1):
            o = hf(torch.tensor([[toks[-1]]]), cache=cache, use_cache=True,
                   position_ids=torch.tensor([[L + step]]), cache_position=torch.tensor([kept + step]),
                   attention_mask=torch.ones(1, kept + step + 1, dtype=torch.long))
            toks.append(int(o.logits[0, -1].argmax()))
    return toks


@pytest.mark.parametrize("policy", PREFILL_COMPRESSION_POLICIES)
def test_decoding_after_compression_matches_the_reference(tiny, policy):
    folder, hf = tiny
    eng = make_engine(str(folder), num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)  # prefill in 4 chunks
    ids = torch.randint(0, 40000, (61,), generator=torch.Generator().manual_seed(7)).tolist()
    c = comp(policy, 0.5)
    seq = eng.add_request(ids, SamplingParams(max_tokens=12, ignore_eos=True), compression=c)
    while seq.observer is not None or not seq.compressed:  # until the prefill completes and compression ran
        eng.step()
    k = c.n_keep(61)
    assert seq.kv_offset == 61 - k and seq.num_kv_dropped == 61 - k
    assert len(seq.block_table) == -(-k // 4)  # whole blocks freed: the KV now fills ceil(k / 4) blocks
    assert eng.pool.num_used == len(seq.block_table)  # the prompt's old blocks went back to the pool
    eng.run_until_done([seq])
    assert seq.output_token_ids == hf_decode_after_pruning(hf, ids, policy, 0.5, 12)
    assert eng.pool.num_used == 0  # every block back once the request finished
    eng.pool.check_invariants()


def test_compressed_kv_is_never_reused_as_a_full_prefix(tiny):
    folder, _ = tiny
    eng = make_engine(str(folder), num_kv_blocks=64, block_size=4)
    ids = torch.randint(0, 40000, (50,), generator=torch.Generator().manual_seed(9)).tolist()
    p = SamplingParams(max_tokens=10, ignore_eos=True)
    full = eng.generate([ids], p)[0]
    squeezed = eng.generate([ids], p, compression=comp("streaming_llm", 0.6))[0]
    assert squeezed.token_ids != full.token_ids  # the compression changed the continuation
    again = eng.generate([ids], p)[0]  # a request expecting the full cache after the compressed one
    assert again.token_ids == full.token_ids and again.cached_tokens > 0
    # a session never hands compressed KV to its next request
    s = SessionManager(eng).open()
    seq = s.begin_turn(prompt=ids, params=p, compression=comp("knorm", 0.5))
    eng.run_until_done([seq])
    nxt = s.begin_turn(prompt=ids + seq.output_token_ids + [5, 6], params=p)
    assert nxt.num_handed_over == 0 and nxt.num_computed == 0
    eng.run_until_done([nxt])
    s.close()
    assert eng.pool.num_used == 0
    eng.pool.check_invariants()


def test_preempted_compressed_request_recompresses_and_frees(tiny):
    folder, _ = tiny
    eng = make_engine(str(folder), num_kv_blocks=14, block_size=4, max_num_batched_tokens=64)
    prompts = [torch.randint(0, 40000, (30,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(3)]
    outs = eng.generate(prompts, SamplingParams(max_tokens=14, ignore_eos=True), compression=comp("h2o", 0.5))
    assert all(len(o.token_ids) == 14 and o.finish_reason == "length" for o in outs)
    assert eng.pool.num_used == 0
    eng.pool.check_invariants()


def test_pooling_helper_matches_reference_edges():
    # the kernel pooling at the sequence edges averages only real tokens (count_include_pad=False)
    x = torch.arange(10, dtype=torch.float32)[None, None]
    y = F.avg_pool1d(x, KERNEL, stride=1, padding=KERNEL // 2, count_include_pad=False)[0, 0]
    want = torch.tensor([x[0, 0, max(0, t - 2): t + 3].mean() for t in range(10)])
    assert torch.allclose(y, want)


def test_continuation_perplexity_with_and_without_compression(tiny):
    from kvkeeper.eval.perplexity import perplexity

    folder, hf = tiny
    eng = make_engine(str(folder), num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    ids = torch.randint(0, 40000, (80,), generator=torch.Generator().manual_seed(11)).tolist()
    base = perplexity(eng, ids, chunk=16, score_tokens=20)
    assert base["scored_tokens"] == 20 and base["kv_tokens"] == 60
    with torch.inference_mode():  # the same 20 predictions, from transformers over the whole text
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, 59:79].float(), -1)
        want = -lp.gather(1, torch.tensor(ids[60:80])[:, None]).mean().item()
    assert abs(base["nll_mean"] - want) < 1e-4
    zero = perplexity(eng, ids, chunk=16, compression=comp("snapkv", 0.0), score_tokens=20)
    assert zero["nll_mean"] == base["nll_mean"] and zero["kv_tokens"] == 60
    for policy in PREFILL_COMPRESSION_POLICIES:
        r = perplexity(eng, ids, chunk=16, compression=comp(policy, 0.5), score_tokens=20)
        assert r["kv_tokens"] == 30 and r["policy"] == policy and r["nll_mean"] != base["nll_mean"]
    assert eng.pool.num_used == 0
    with pytest.raises(InvalidRequestError, match="score_tokens"):
        perplexity(eng, ids, compression=comp("knorm"))


@pytest.mark.parametrize("policy", ["streaming_llm", "knorm"])
@pytest.mark.parametrize("length, ratio", [(1, 0.5), (7, 0.5), (40, 0.25), (40, 0.9), (130, 0.5)])
def test_a_request_and_a_session_policy_keep_the_same_entries(policy, length, ratio):
    """streaming_llm and knorm exist for a request (kvcache.compression.select) and for a session
    (sessions.compress.select_entries): one rule, so the same keys, ratio and sinks keep the same entries."""
    from kvkeeper.sessions.compress import SessionCompression, select_entries

    keys = torch.randn(length, 3, 16, generator=torch.Generator().manual_seed(length))
    request, session = comp(policy, ratio), SessionCompression(policy, ratio, n_sink=SINKS)
    k = session.n_keep(length)
    assert k == request.n_keep(length) == max(1, int(length * (1 - ratio)))
    kept = select(request, None, 0, keys)
    assert kept.shape == (3, k) and torch.equal(kept, select_entries(session, keys, k))
