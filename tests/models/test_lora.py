"""LoRA adapters (kvkeeper.layers.lora): parity with transformers + peft, per-request adapters in one batch, and
the adapter's identity in the KV cache namespace.

Adapters are made here with ``peft`` (``get_peft_model`` + ``save_pretrained``) with random A and B large enough
that the adapted model's greedy tokens differ from the base model's; peft applied to the transformers model is the
reference.  Tiny random Llama / Qwen2 checkpoints give exact fp32 parity; the embedded SmolLM2 model is checked
against transformers (its GGUF loaded by transformers) + peft.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from kvkeeper import SamplingParams
from kvkeeper.diagnostics.audit import audit_sequence
from kvkeeper.errors import InvalidRequestError
from kvkeeper.sessions.manager import SessionManager

from tests.utils.tiny_models import _one_thread, randomise_weights, tokenizer  # noqa: F401 - fixtures
from tests.utils.engines import make_engine

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)

# id -> (transformers config class, adapter options)
CASES = {
    "llama-all-rslora": ("LlamaConfig", dict(r=4, lora_alpha=8, target_modules=ALL, use_rslora=True)),
    "qwen2-bias-qv": ("Qwen2Config", dict(r=2, lora_alpha=16, target_modules=["q_proj", "v_proj"])),
    # Qwen3: the adapters' q/k deltas land before the per-head q/k norms, as in peft
    "qwen3-all": ("Qwen3Config", dict(r=4, lora_alpha=8, target_modules=ALL)),
}


def make_adapter(model: torch.nn.Module, out, seed: int, std: float = 0.3, in_place: bool = False, **options):
    """Save a peft LoRA adapter of ``model`` with random A and B (std ``std``) to ``out``; returns the peft model
    (on a copy of ``model`` unless ``in_place``: then call ``.unload()`` to restore the model)."""
    cfg = peft.LoraConfig(lora_dropout=0.0, init_lora_weights=False, **options)
    pm = peft.get_peft_model(model if in_place else copy.deepcopy(model), cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(std * torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    pm.save_pretrained(out)
    return pm.eval()


def _prompt(vocab: int, n: int = 21, seed: int = 7) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def _ref(model, ids: list[int], n: int) -> tuple[torch.Tensor, list[int]]:
    """(last-position logits, ``n`` greedy tokens) of a transformers (or peft) model, recomputed each step."""
    seq, first = list(ids), None
    for _ in range(n):
        logits = model(input_ids=torch.tensor([seq])).logits[0, -1].float()
        first = logits if first is None else first
        seq.append(int(logits.argmax()))
    return first, seq[len(ids):]


def _run(eng, prompt, lora=None, **kw):
    seq = eng.add_request(prompt, GREEDY, lora=lora, **kw)
    eng.run_until_done([seq])
    return seq


# ---- tiny random checkpoints: exact parity ----------------------------------------------------------------


@pytest.fixture(scope="module", params=list(CASES))
def tiny(request, tmp_path_factory, tokenizer):
    """(case, engine with adapters "a" and "b" loaded, hf base, peft model of a, peft model of b, folder)."""
    name = request.param
    cls_name, opts = CASES[name]
    cfg = getattr(transformers, cls_name)(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                          head_dim=16, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, tie_word_embeddings=False,
                                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    randomise_weights(hf, 3)
    folder = tmp_path_factory.mktemp(name)
    hf.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    pa = make_adapter(hf, folder / "lora-a", seed=1, **opts)
    pb = make_adapter(hf, folder / "lora-b", seed=2, **opts)
    eng = make_engine(model=str(folder), num_kv_blocks=96, block_size=4)
    eng.capture_first_logits = True
    eng.load_lora("a", folder / "lora-a")
    eng.load_lora("b", folder / "lora-b")
    return name, eng, hf, pa, pb, folder


def test_tiny_parity_with_peft(tiny):
    """First-token logits within 1e-4 and 10 greedy tokens identical to transformers + peft, for both adapters and
    the base model; and the adapters do change the output (a test that can fail)."""
    _, eng, hf, pa, pb, _ = tiny
    ids = _prompt(eng.model_config.vocab_size)
    outs = {}
    for lora, ref_model in ((None, hf), ("a", pa), ("b", pb)):
        seq = _run(eng, ids, lora, namespace=eng.isolated_namespace("parity"))
        ref_logits, ref_tokens = _ref(ref_model, ids, GREEDY.max_tokens)
        assert seq.output_token_ids == ref_tokens, lora
        torch.testing.assert_close(seq.first_logits, ref_logits, atol=1e-4, rtol=0)
        outs[lora] = seq
    assert (outs["a"].first_logits - outs[None].first_logits).abs().max() > 0.1
    assert outs["a"].output_token_ids != outs[None].output_token_ids != outs["b"].output_token_ids


def test_prompt_logprobs_under_adapter(tiny):
    """prompt_logprobs (the engine's every-position logits path) under an adapter: peft's log-softmax."""
    _, eng, _, pa, _, _ = tiny
    ids = _prompt(eng.model_config.vocab_size, n=9, seed=5)
    seq = eng.add_request(ids, SamplingParams(max_tokens=1, prompt_logprobs=0), lora="a",
                          namespace=eng.isolated_namespace("plp"))
    eng.run_until_done([seq])
    with torch.no_grad():
        ref = torch.log_softmax(pa(input_ids=torch.tensor([ids])).logits[0].float(), -1)
    got = torch.tensor([e["logprob"] for e in seq.prompt_logprobs[1:]])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_server_wiring_in_process(tiny):
    """build_server: --lora-modules entries load (a malformed one or the served name is refused), /v1/models lists
    them, and the load/unload endpoints answer 403 without --allow-runtime-lora."""
    from fastapi.testclient import TestClient
    from kvkeeper.api.server import ServerConfig, build_server

    _, _, _, _, _, folder = tiny
    eng = make_engine(model=str(folder), num_kv_blocks=32, block_size=4)
    for bad in ("noequals", f"={folder / 'lora-a'}", f"base={folder / 'lora-a'}"):
        with pytest.raises(ValueError, match="--lora-modules"):
            build_server(eng, ServerConfig(served_model_name="base", lora_modules=[bad]))
    app = build_server(eng, ServerConfig(lora_modules=[f"x={folder / 'lora-a'}"]))
    with TestClient(app) as c:
        data = c.get("/v1/models").json()["data"]
        assert [m["id"] for m in data][1:] == ["x"] and data[1]["parent"] == data[0]["id"]
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": str(folder / "lora-b")})
        assert r.status_code == 403 and "--allow-runtime-lora" in r.json()["error"]["message"]
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 403
        r = c.post("/v1/completions", json={"model": "x", "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["model"] == "x"
        r = c.post("/v1/completions", json={"model": "z", "prompt": [5, 6, 7], "max_tokens": 2})
        assert r.status_code == 404 and "'z' does not exist" in r.json()["error"]["message"]


def test_mixed_batch_equals_each_alone(tiny):
    """A, B and the base model in one batch (prefill and decode steps packed together) give each one's tokens
    and first logits as when run alone."""
    _, eng, *_ = tiny
    ids = _prompt(eng.model_config.vocab_size, n=13, seed=3)
    alone = {lora: _run(eng, ids, lora, namespace=eng.isolated_namespace("alone")) for lora in (None, "a", "b")}
    ns = eng.isolated_namespace("mixed")
    seqs = [eng.add_request(ids, GREEDY, lora=lora, namespace=ns) for lora in ("a", None, "b", "a")]
    eng.run_until_done(seqs)
    for seq, lora in zip(seqs, ("a", None, "b", "a")):
        assert seq.output_token_ids == alone[lora].output_token_ids, lora
        torch.testing.assert_close(seq.first_logits, alone[lora].first_logits, atol=1e-5, rtol=0)


def _cached_blocks(eng, seq_ns) -> set[int]:
    return {bid for bid, b in enumerate(eng.pool.blocks) if b.hash is not None and b.namespace == seq_ns}


def test_same_prompt_under_a_b_base_shares_no_block(tiny):
    """The same prompt under A, B and the base model: no prefix-cache hit across them, disjoint cached blocks,
    and a hit when repeated under the same adapter."""
    _, eng, *_ = tiny
    ids = _prompt(eng.model_config.vocab_size, n=17, seed=11)
    seqs = {lora: _run(eng, ids, lora) for lora in (None, "a", "b")}
    assert all(s.num_cached_tokens == 0 for s in seqs.values())
    spaces = {lora: s.namespace for lora, s in seqs.items()}
    assert len(set(spaces.values())) == 3 and spaces["a"].adapter.startswith("a@")
    blocks = {lora: _cached_blocks(eng, ns) for lora, ns in spaces.items()}
    assert all(len(b) >= 4 for b in blocks.values())
    assert not (blocks[None] & blocks["a"]) and not (blocks["a"] & blocks["b"]) and not (blocks[None] & blocks["b"])
    again = _run(eng, ids, "a")
    assert again.num_cached_tokens >= 16 and again.output_token_ids == seqs["a"].output_token_ids


def test_reload_same_name_new_weights_never_reuses(tiny, tmp_path):
    """``a`` replaced by other weights under the same name: a new namespace id, no prefix hit, the new weights'
    output; reloading the original weights (same content hash) finds its KV again."""
    name, eng, hf, pa, pb, folder = tiny
    ids = _prompt(eng.model_config.vocab_size, n=17, seed=23)
    eng.load_lora("c", folder / "lora-a")
    first = _run(eng, ids, "c")
    old_id = eng.loras["c"].id
    eng.load_lora("c", folder / "lora-b", replace=True)
    assert eng.loras["c"].id != old_id
    second = _run(eng, ids, "c")
    assert second.num_cached_tokens == 0
    assert second.output_token_ids == _run(eng, ids, "b", namespace=eng.isolated_namespace("b")).output_token_ids
    assert second.output_token_ids != first.output_token_ids
    eng.load_lora("c", folder / "lora-a", replace=True)
    assert eng.loras["c"].id == old_id and _run(eng, ids, "c").num_cached_tokens >= 16
    eng.unload_lora("c")
    with pytest.raises(InvalidRequestError, match="'c'"):
        eng.add_request(ids, GREEDY, lora="c")


def test_session_switching_adapter_recomputes(tiny):
    """A session's turn under another adapter (or none) gets none of the session's KV; the next turn under the same
    adapter reuses it; an adapter's turn equals a fresh request's output under it."""
    _, eng, *_ = tiny
    mgr = SessionManager(eng)
    try:
        s = mgr.open()
        prompts = [_prompt(eng.model_config.vocab_size, n=12, seed=k) for k in (31, 32, 33, 34)]
        turns = []
        ids: list[int] = []
        for lora, extra in zip(("a", "a", "b", None), prompts):
            seq = s.begin_turn(prompt=ids + extra, params=GREEDY, lora=lora)
            eng.run_until_done([seq])
            turns.append(seq)
            ids = list(seq.token_ids)
            # the reuse audit recomputes the kept KV under the turn's own adapter
            assert s.kv is seq and seq.lora is (eng.loras[lora] if lora else None)
            assert audit_sequence(eng, seq, logits=seq.first_logits, num_tokens=seq.num_prompt_tokens).ok, lora
        assert turns[1].num_handed_over > 0  # same adapter: reuse
        assert turns[2].num_handed_over == 0 and turns[2].num_cached_tokens == 0  # a -> b: recomputed
        assert turns[3].num_handed_over == 0 and turns[3].num_cached_tokens == 0  # b -> base: recomputed
        fresh = _run(eng, list(turns[2].token_ids[:turns[2].num_prompt_tokens]), "b",
                     namespace=eng.isolated_namespace("fresh"))
        assert fresh.output_token_ids == turns[2].output_token_ids
    finally:
        for sid in list(mgr.sessions):
            mgr.sessions[sid].close()
        eng.kv.holders.remove(mgr)


def test_adapter_errors(tiny, tmp_path, tokenizer):
    """Clear errors: unknown name, a name in use, an adapter of other shapes, DoRA, a missing file."""
    name, eng, hf, *_ = tiny
    ids = _prompt(eng.model_config.vocab_size, n=5)
    with pytest.raises(InvalidRequestError, match="'nope' is not loaded"):
        eng.add_request(ids, GREEDY, lora="nope")
    with pytest.raises(InvalidRequestError, match="'nope' is not loaded"):
        eng.add_request(ids, GREEDY, lora="nope", namespace=eng.lora_namespace("a"))
    with pytest.raises(InvalidRequestError, match="conflicts"):
        eng.add_request(ids, GREEDY, lora="b", namespace=eng.lora_namespace("a"))
    with pytest.raises(InvalidRequestError, match="2 adapter names for 1 prompts"):
        eng.generate([ids], GREEDY, lora=["a", "b"])
    assert not eng.has_unfinished()
    with pytest.raises(InvalidRequestError, match="already been loaded"):
        eng.load_lora("a", tmp_path)
    other = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, head_dim=8,
                                     num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    make_adapter(transformers.AutoModelForCausalLM.from_config(other), tmp_path / "other", seed=0, r=2,
                 target_modules=["q_proj"])
    with pytest.raises(InvalidRequestError, match="another base model"):
        eng.load_lora("other", tmp_path / "other")
    make_adapter(hf, tmp_path / "dora", seed=0, r=2, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(InvalidRequestError, match="use_dora"):
        eng.load_lora("dora", tmp_path / "dora")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidRequestError, match="adapter_config.json"):
        eng.load_lora("empty", tmp_path / "empty")
    assert set(eng.loras) == {"a", "b"}


# ---- the embedded model ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_embedded_model_parity_with_peft(engine, hf_reference, tmp_path):
    """SmolLM2-135M (fp32 weights) with a random rank-8 adapter on every projection: first-token logits within
    1e-3 and 8 greedy tokens identical to transformers + peft on the same GGUF, for a chat prompt; mixed with the
    base model in one batch."""
    ids = engine.encode_chat([{"role": "user", "content": "Name three colours of the rainbow."}])
    pm = make_adapter(hf_reference, tmp_path / "smol", seed=5, std=0.5, in_place=True, r=8, lora_alpha=16,
                      target_modules=ALL)
    try:
        ref_logits, ref_tokens = _ref(pm, ids, 8)
    finally:
        pm.unload()
    base_logits, base_tokens = _ref(hf_reference, ids, 8)
    assert ref_tokens != base_tokens  # the adapter changes the greedy output
    engine.load_lora("smol", tmp_path / "smol")
    engine.capture_first_logits = True
    try:
        ns = engine.isolated_namespace("smol")
        p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        seqs = [engine.add_request(ids, p, namespace=ns, lora=lora) for lora in ("smol", None)]
        engine.run_until_done(seqs)
        assert seqs[0].output_token_ids == ref_tokens and seqs[1].output_token_ids == base_tokens
        torch.testing.assert_close(seqs[0].first_logits, ref_logits, atol=1e-3, rtol=0)
        torch.testing.assert_close(seqs[1].first_logits, base_logits, atol=1e-3, rtol=0)
    finally:
        engine.capture_first_logits = False
        engine.unload_lora("smol")


def test_adapter_config_is_part_of_the_hash(tiny, tmp_path):
    """Same weights, another lora_alpha: another content hash (so another namespace) and other logits."""
    _, eng, _, _, _, folder = tiny
    import shutil

    shutil.copytree(folder / "lora-a", tmp_path / "a2")
    conf = json.loads((tmp_path / "a2" / "adapter_config.json").read_text())
    conf["lora_alpha"] = conf["lora_alpha"] * 2
    (tmp_path / "a2" / "adapter_config.json").write_text(json.dumps(conf))
    a2 = eng.load_lora("a2", tmp_path / "a2")
    try:
        assert a2.sha256 != eng.loras["a"].sha256 and a2.scaling == 2 * eng.loras["a"].scaling
    finally:
        eng.unload_lora("a2")
