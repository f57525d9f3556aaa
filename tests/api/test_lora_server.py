"""LoRA adapters through the server, on the embedded model with its default weights (GGUF blocks computed in place,
bf16 KV): ``--lora-modules``, the ``model`` field, ``/v1/models``, ``POST /v1/load_lora_adapter`` /
``/v1/unload_lora_adapter``, the official openai client, and the KV isolation of adapters seen in
``usage.prompt_tokens_details.cached_tokens``.

The adapters are made with peft for SmolLM2's shapes on its first two layers (random, large enough to change the
greedy output); exact parity with transformers + peft is in tests/models/test_lora.py.
"""

from __future__ import annotations

import concurrent.futures as cf

import httpx
import pytest

from tests.utils.serverproc import running_server
from tests.models.test_lora import ALL, make_adapter

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
PROMPT = ("A lighthouse keeper writes in the log every evening: the weather, the ships that passed, the state of the "
          "lamp and the oil left in the tank. Tonight the entry reads:")


def smol_adapter(out, seed: int) -> str:
    """A peft adapter of SmolLM2-135M's widths on its first two layers (made on a 2-layer transformers Llama with
    those widths and a tiny vocabulary: the adapter's tensors do not depend on the rest)."""
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=576, intermediate_size=1536, head_dim=64,
                                   num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3)
    make_adapter(transformers.AutoModelForCausalLM.from_config(cfg), out, seed=seed, std=1.0, r=8, lora_alpha=32,
                 target_modules=ALL)
    return str(out)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    return {k: smol_adapter(d / k, seed) for k, seed in (("a", 1), ("b", 2), ("c", 3))}


@pytest.fixture(scope="module")
def server(tmp_path_factory, adapters):
    log = tmp_path_factory.mktemp("lora-server") / "server.log"
    with running_server(log, "--quantization", "gguf", "--max-model-len", "1024",
                        "--lora-modules", f"a={adapters['a']}", "--lora-modules", f"b={adapters['b']}",
                        "--allow-runtime-lora") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0, timeout=120)


def _complete(client, model: str, prompt: str = PROMPT, **kw):
    return client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, **kw)


def test_models_lists_base_and_adapters(client, adapters):
    cards = {m.id: m.model_extra for m in client.models.list().data}
    assert list(cards) == [MODEL, "a", "b"]
    assert cards["a"]["parent"] == MODEL and cards["a"]["root"] == adapters["a"] and cards[MODEL]["parent"] is None
    assert client.models.retrieve("b").id == "b"


def test_model_field_selects_adapter_and_no_block_is_shared(client):
    """The same prompt under the base model, a and b: each computed from scratch (no cached token), three different
    greedy outputs, the response naming the adapter; repeated under a, its own KV is found."""
    outs = {}
    for model in (MODEL, "a", "b"):
        r = _complete(client, model)
        assert r.model == model
        assert r.usage.prompt_tokens_details.cached_tokens == 0, model
        outs[model] = r.choices[0].text
    assert len(set(outs.values())) == 3, outs
    again = _complete(client, "a")
    assert again.usage.prompt_tokens_details.cached_tokens >= 32 and again.choices[0].text == outs["a"]


def test_mixed_batch_equals_alone(client):
    """Requests under a, b and the base model at once give the outputs each gets alone."""
    prompt = PROMPT.replace("evening", "morning")
    alone = {m: _complete(client, m, prompt=prompt, extra_body={"cache_salt": "alone"}).choices[0].text
             for m in ("a", "b", MODEL)}
    with cf.ThreadPoolExecutor(6) as pool:
        futs = {pool.submit(_complete, client, m, prompt, extra_body={"cache_salt": f"mixed-{i}"}): m
                for i, m in enumerate(("a", "b", MODEL, "a", "b", MODEL))}
        for f, m in futs.items():
            assert f.result().choices[0].text == alone[m], m


def test_session_switching_adapter_recomputes(client):
    """A session (X-Session-ID) whose turn changes model gets no KV from the earlier turn; staying, it does."""
    h = {"X-Session-ID": "lora-switch"}
    msgs = [{"role": "user", "content": "Describe the sea at night in two sentences."}]

    def turn(model):
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0, extra_headers=h)
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
        msgs.append({"role": "user", "content": "And in the morning?"})
        return r.usage.prompt_tokens_details.cached_tokens

    assert turn("a") == 0
    assert turn("a") > 0
    assert turn("b") == 0
    assert turn(MODEL) == 0
    assert turn(MODEL) > 0


def test_unknown_adapter_404(client):
    with pytest.raises(openai.NotFoundError, match="'nope' does not exist"):
        _complete(client, "nope")


def test_load_reload_unload(server, client, adapters):
    post = lambda path, body: httpx.post(server + path, json=body, timeout=60)  # noqa: E731
    r = post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["a"]})
    assert r.status_code == 200 and "added" in r.text
    assert [m.id for m in client.models.list().data] == [MODEL, "a", "b", "c"]
    first = _complete(client, "c")
    assert first.choices[0].text == _complete(client, "a").choices[0].text  # same weights as a
    r = post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["c"]})
    assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
    r = post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": adapters["c"], "load_inplace": True})
    assert r.status_code == 200
    second = _complete(client, "c")  # new weights under the old name: none of the old KV
    assert second.usage.prompt_tokens_details.cached_tokens == 0 and second.choices[0].text != first.choices[0].text
    r = post("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "/nonexistent/adapter"})
    assert r.status_code == 400 and "not a directory" in r.json()["error"]["message"]
    assert post("/v1/unload_lora_adapter", {"lora_name": "c"}).status_code == 200
    with pytest.raises(openai.NotFoundError, match="'c'"):
        _complete(client, "c")
    r = post("/v1/unload_lora_adapter", {"lora_name": "c"})
    assert r.status_code == 404 and "'c' cannot be found" in r.json()["error"]["message"]
