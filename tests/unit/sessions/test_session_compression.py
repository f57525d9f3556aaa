"""Session compression (kvkeeper.sessions.compress): a session's KV compressed at the end of a turn and continued.

The reference is written here independently of ``kvkeeper.sessions.compress``: transformers runs turn 1 with a
full ``DynamicCache`` (eager attention), the cache is pruned per layer and KV head by a plain rule (StreamingLLM
sinks + window, lowest key L2 norm, or KVzip's reconstruction scores: transformers itself attending from a "repeat
the context" pass over a copy of the cache, ``output_attentions=True``), and turn 2 is fed after the pruned cache
with ``position_ids`` continuing at the true positions.  kvkeeper's turn 2 must append to its compressed KV (the
history's tokens handed over, only the kept entries held) and produce the same greedy tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kvkeeper import SamplingParams
from kvkeeper.errors import InvalidRequestError
from kvkeeper.sessions import SessionManager
from kvkeeper.sessions.compress import REPEAT_PROMPT, SESSION_COMPRESSION_POLICIES, SessionCompression
from tests.utils.engines import make_engine
from tests.utils.tiny_models import tiny_compression_llama

transformers = pytest.importorskip("transformers")

SINKS = 4
N1, N2 = 8, 10  # greedy tokens of turn 1 and turn 2
RATIO = 0.5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder, hf, tok = tiny_compression_llama(tmp_path_factory.mktemp("tiny-session-compress"))
    return folder, hf, tok


def ids_of(n: int, seed: int) -> list[int]:
    return torch.randint(0, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- the reference ---------------------------------------------------------------------------------


def ref_keep(policy: str, keys: torch.Tensor, k: int, scores: torch.Tensor | None) -> torch.Tensor:
    """keys (KVH, T, D) of one layer -> (KVH, k) kept indices, one head at a time by the plain rule."""
    kvh, T, _ = keys.shape
    out = []
    for h in range(kvh):
        if policy == "streaming_llm":
            keep = list(range(min(SINKS, k))) + list(range(T - (k - min(SINKS, k)), T))
        elif policy == "knorm":
            norms = keys[h].norm(dim=-1)
            keep = sorted(range(T), key=lambda t: norms[t].item())[:k]
        else:  # kvzip
            keep = sorted(range(T), key=lambda t: -scores[h, t].item())[:k]
        out.append(sorted(keep))
    return torch.tensor(out)


def _feed(hf, cache, toks: list[int], pos: int, kv_len: int):
    n = len(toks)
    return hf(torch.tensor([toks]), cache=cache, use_cache=True,
              position_ids=torch.arange(pos, pos + n)[None], cache_position=torch.arange(kv_len, kv_len + n),
              attention_mask=torch.ones(1, kv_len + n, dtype=torch.long))


def _greedy(hf, cache, first: list[int], pos: int, kv_len: int, n: int) -> list[int]:
    out = [int(_feed(hf, cache, first, pos, kv_len).logits[0, -1].argmax())]
    pos, kv_len = pos + len(first), kv_len + len(first)
    for _ in range(n - 1):
        out.append(int(_feed(hf, cache, [out[-1]], pos, kv_len).logits[0, -1].argmax()))
        pos, kv_len = pos + 1, kv_len + 1
    return out


def hf_two_turns(hf, tok, ids1: list[int], new2: list[int], policy: str) -> tuple[list[int], list[int], int]:
    """(turn 1's tokens, turn 2's tokens, entries kept) with transformers' cache pruned after turn 1."""
    with torch.inference_mode():
        cache = transformers.DynamicCache()
        t1 = _greedy(hf, cache, ids1, 0, 0, N1)
        T = cache.get_seq_length()  # turn 1's tokens with KV: the prompt and every output but the last
        assert T == len(ids1) + N1 - 1
        k = max(1, int(T * (1 - RATIO)))
        scores = None
        if policy == "kvzip":  # transformers attends from the reconstruction pass over a copy of the cache
            recon = tok.encode(REPEAT_PROMPT, add_special_tokens=False) + (ids1 + t1)[:T]
            o = hf(torch.tensor([recon]), cache=copy.deepcopy(cache), use_cache=True,
                   position_ids=torch.arange(T, T + len(recon))[None], output_attentions=True,
                   cache_position=torch.arange(T, T + len(recon)),
                   attention_mask=torch.ones(1, T + len(recon), dtype=torch.long))
            kvh = cache.layers[0].keys.shape[1]
            scores = [a[0, :, :, :T].reshape(kvh, -1, T).amax(dim=1) for a in o.attentions]  # (KVH, T)
        for i, layer in enumerate(cache.layers):
            idx = ref_keep(policy, layer.keys[0], k, None if scores is None else scores[i])
            gather = idx[None, :, :, None].expand(1, -1, -1, layer.keys.shape[-1])
            layer.keys, layer.values = layer.keys.gather(2, gather), layer.values.gather(2, gather)
        t2 = _greedy(hf, cache, [t1[-1]] + new2, T, k, N2)
    return t1, t2, k


# ---- kvkeeper against the reference ----------------------------------------------------------------


@pytest.mark.parametrize("policy", ["streaming_llm", "knorm", "kvzip"])
def test_turn_two_appends_to_the_compressed_kv_and_matches_transformers(tiny, policy):
    folder, hf, tok = tiny
    eng = make_engine(str(folder), num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    s = SessionManager(eng).open(compression=SessionCompression(policy, RATIO, n_sink=SINKS))
    ids1, new2 = ids_of(41, 7), ids_of(9, 8)
    want1, want2, k = hf_two_turns(hf, tok, ids1, new2, policy)
    p = SamplingParams(max_tokens=N1, ignore_eos=True)
    seq = s.begin_turn(prompt=ids1, params=p)
    eng.run_until_done([seq])
    assert seq.output_token_ids == want1
    T = len(ids1) + N1 - 1
    rep = s.turns[-1].compression
    assert rep["applied"] and rep["tokens"] == T and rep["kept_per_layer"] == [k, k] and rep["before"] == T
    assert s.kv_entries == k and s.kv.kv_offset == T - k and len(s.kv.block_table) == -(-k // 4)
    assert s.info()["compression"]["kv_entries"] == k
    nxt = s.begin_turn(prompt=s.kv.token_ids + new2, params=SamplingParams(max_tokens=N2, ignore_eos=True))
    # the history's T tokens come from the session: only the k kept entries are held, at their true positions
    assert nxt.num_handed_over == T and nxt.num_computed - nxt.kv_offset == k
    eng.run_until_done([nxt])
    assert nxt.num_cached_tokens == T and s.turns[-1].cached_tokens == T
    assert nxt.output_token_ids == want2
    T2 = T + 1 + len(new2) + N2 - 1
    assert s.turns[-1].compression["tokens"] == T2 and s.kv_entries == max(1, int(T2 * (1 - RATIO)))
    s.close()
    assert eng.pool.num_used == 0
    eng.pool.check_invariants()


def test_an_edited_history_recomputes(tiny):
    from tests.utils.tiny_models import hf_greedy

    folder, hf, _ = tiny
    eng = make_engine(str(folder), num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    s = SessionManager(eng).open(compression=SessionCompression("knorm", RATIO))
    seq = s.begin_turn(prompt=ids_of(41, 7), params=SamplingParams(max_tokens=N1, ignore_eos=True))
    eng.run_until_done([seq])
    assert s.kv.kv_offset > 0
    edited = list(s.kv.token_ids) + ids_of(9, 8)
    edited[5] = (edited[5] + 1) % 40000  # the client rewrote an early message
    nxt = s.begin_turn(prompt=edited, params=SamplingParams(max_tokens=N2, ignore_eos=True))
    assert nxt.num_handed_over == 0 and nxt.kv_offset == 0 and nxt.num_computed == 0
    eng.run_until_done([nxt])
    assert nxt.output_token_ids == hf_greedy(hf, edited, N2)  # the whole edited prompt, uncompressed
    s.close()
    assert eng.pool.num_used == 0


def test_offload_to_host_and_disk_and_a_restart_keep_the_compressed_kv_bitwise(tiny, tmp_path):
    folder, hf, tok = tiny
    make = lambda: make_engine(str(folder), num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)  # noqa: E731
    eng = make()
    mgr = SessionManager(eng, data_dir=str(tmp_path), host_offload_bytes=1 << 20)
    s = mgr.open(session_id="c1", compression=SessionCompression("kvzip", RATIO))
    ids1, new2 = ids_of(41, 7), ids_of(9, 8)
    seq = s.begin_turn(prompt=ids1, params=SamplingParams(max_tokens=N1, ignore_eos=True))
    eng.run_until_done([seq])
    nb, off, nc = len(s.kv.block_table), s.kv.kv_offset, s.kv.num_computed
    raw = {key: t.clone() for key, t in eng.kv.store.read_blocks(s.kv.block_table).items()}

    def same_kv(sess, e) -> None:
        assert (sess.kv.kv_offset, sess.kv.num_computed, len(sess.kv.block_table)) == (off, nc, nb)
        got = e.kv.store.read_blocks(sess.kv.block_table)
        assert got.keys() == raw.keys() and all(torch.equal(got[key], raw[key]) for key in raw)

    assert s.offload("host") == nb and s.tier == "host" and eng.pool.num_used == 0
    assert mgr.store.restore(s)
    same_kv(s, eng)
    assert s.offload("disk") == nb and s.tier == "disk"
    del mgr, s, eng  # a restart: a new engine and manager reopen the saved session from the data directory
    eng2 = make()
    mgr2 = SessionManager(eng2, data_dir=str(tmp_path))
    s2 = mgr2.get("c1")
    assert s2.tier == "disk" and s2.compression == SessionCompression("kvzip", RATIO)
    assert mgr2.store.restore(s2)
    same_kv(s2, eng2)
    nxt = s2.begin_turn(prompt=s2.kv.token_ids + new2, params=SamplingParams(max_tokens=N2, ignore_eos=True))
    assert nxt.num_handed_over == nc and nxt.num_computed - nxt.kv_offset == nc - off
    eng2.run_until_done([nxt])
    assert nxt.output_token_ids == hf_two_turns(hf, tok, ids1, new2, "kvzip")[1]
    s2.close()
    assert eng2.pool.num_used == 0


def test_bad_policy_and_ratio_name_the_field():
    with pytest.raises(InvalidRequestError, match="kvzip") as e:
        SessionCompression("zip", 0.5)
    assert e.value.param == "session_compression"
    with pytest.raises(InvalidRequestError, match=r"\[0, 1\)") as e:
        SessionCompression("knorm", 1.0)
    assert e.value.param == "session_compression_ratio"
    assert not SessionCompression().active and SessionCompression("knorm", 0.5).n_keep(41) == 20
    assert set(SESSION_COMPRESSION_POLICIES) == {"none", "streaming_llm", "knorm", "kvzip"}
