#!/usr/bin/env python
"""Per turn of a 20-turn conversation: chat completions with the whole history vs ``/v1/responses`` with
``previous_response_id`` (issue 25's "Measure").

One ``kvkeeper serve`` (the embedded SmolLM2-135M unless ``--model``) runs both, their turns interleaved (chat
turn k, then responses turn k), each mode in its own cache namespace (``cache_salt``), so neither finds the
other's prefixes.  Each turn sends one short user
question, greedy, ``--max-tokens`` per reply, streamed.  Per turn and mode:

* ``request_bytes``: the bytes of the JSON request body the client sent (the whole history for chat; the new
  question and the previous response's id for responses); ``response_bytes``: the SSE bytes it received;
* ``prompt_tokens`` and ``cached_tokens`` (the server's usage), ``prefilled_tokens`` = prompt - cached: the
  prompt tokens the server computed;
* ``ttft_s``: from sending the request to the first text delta (chat: the first chunk with content; responses:
  the first ``response.output_text.delta``).

Chat turns reuse the prefix cache (full blocks of 16 tokens); responses hand the previous turn's whole KV over
(a session turn, :mod:`kvkeeper.api.responses.run`).  The replies of the two modes are compared turn by turn.

    .venv/bin/python benchmarks/serving/responses_bench.py [--turns 20] [--max-tokens 32] [--threads 2] [--out DIR]

Writes ``OUT/responses_bench-<config>-<date>.json`` and ``.md`` and prints the markdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # tests.utils.serverproc
sys.path.insert(0, str(ROOT / "benchmarks"))
from common import MODEL, RESULTS, cpu_model, result_name, write_report  # noqa: E402
from tests.utils.serverproc import server_process  # noqa: E402

SERVED = "smollm2-135m-instruct"
QUESTIONS = ["Name a colour.", "Name an animal.", "Name a fruit.", "Name a city.", "Name a planet.", "Name a tree.",
             "Name a river.", "Name a country.", "Name a flower.", "Name a metal.", "Name a bird.", "Name a fish.",
             "Name a sport.", "Name a tool.", "Name a vegetable.", "Name an ocean.", "Name a mountain.",
             "Name an insect.", "Name a drink.", "Name a musical instrument."]


def _stream(client: httpx.Client, path: str, body: dict, is_text) -> tuple[dict, float, int, list[dict]]:
    """POST ``body`` streamed; returns (the last event with usage, ttft seconds, bytes received, events)."""
    payload = json.dumps(body).encode()
    t0 = time.perf_counter()
    ttft, got, events = None, 0, []
    with client.stream("POST", path, content=payload, headers={"content-type": "application/json"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            got += len(line) + 1
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            events.append(ev)
            if ttft is None and is_text(ev):
                ttft = time.perf_counter() - t0
    return events[-1], ttft if ttft is not None else float("nan"), got, events


def run_chat(client: httpx.Client, turns: int, max_tokens: int):
    """Yields each turn's figures (a generator: the two modes' turns are interleaved)."""
    salt, history = uuid.uuid4().hex, []
    for q in QUESTIONS[:turns]:
        history.append({"role": "user", "content": q})
        body = {"model": SERVED, "messages": history, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "cache_salt": salt}
        last, ttft, got, events = _stream(client, "/v1/chat/completions", body,
                                          lambda e: any(c["delta"].get("content") for c in e.get("choices", [])))
        text = "".join(c["delta"].get("content") or "" for e in events for c in e.get("choices", []))
        history.append({"role": "assistant", "content": text})
        u = last["usage"]
        yield {"request_bytes": len(json.dumps(body).encode()), "response_bytes": got, "ttft_s": ttft,
               "prompt_tokens": u["prompt_tokens"], "cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
               "text": text}


def run_responses(client: httpx.Client, turns: int, max_tokens: int):
    """Yields each turn's figures, as :func:`run_chat`."""
    salt, prev = uuid.uuid4().hex, None
    for q in QUESTIONS[:turns]:
        body = {"model": SERVED, "input": q, "max_output_tokens": max_tokens, "temperature": 0, "stream": True,
                "cache_salt": salt, **({"previous_response_id": prev} if prev else {})}
        last, ttft, got, events = _stream(client, "/v1/responses", body,
                                          lambda e: e.get("type") == "response.output_text.delta")
        resp = last["response"]
        prev = resp["id"]
        u = resp["usage"]
        text = "".join(e["delta"] for e in events if e.get("type") == "response.output_text.delta")
        yield {"request_bytes": len(json.dumps(body).encode()), "response_bytes": got, "ttft_s": ttft,
               "prompt_tokens": u["input_tokens"], "cached_tokens": u["input_tokens_details"]["cached_tokens"],
               "text": text}


def _markdown(res: dict) -> str:
    rows = ["| turn | chat bytes sent | responses bytes sent | chat prefilled | responses prefilled | chat TTFT ms "
            "| responses TTFT ms |", "|---|---|---|---|---|---|---|"]
    for i, (c, r) in enumerate(zip(res["chat"], res["responses"]), 1):
        rows.append(f"| {i} | {c['request_bytes']:,} | {r['request_bytes']:,} | {c['prefilled_tokens']} | "
                    f"{r['prefilled_tokens']} | {c['ttft_s'] * 1e3:.0f} | {r['ttft_s'] * 1e3:.0f} |")
    s = res["summary"]
    return (f"# responses_bench ({res['date']})\n\n{res['machine']}; {res['turns']} turns, {res['max_tokens']} "
            f"tokens per reply at most, greedy, streamed; replies equal in both modes on {s['equal_replies']} of "
            f"{res['turns']} turns.\n\n" + "\n".join(rows) + "\n\n"
            f"Totals: bytes sent {s['chat_bytes']:,} (chat) vs {s['responses_bytes']:,} (responses); prefilled "
            f"tokens {s['chat_prefilled']:,} vs {s['responses_prefilled']:,}; median TTFT turns 2-{res['turns']} "
            f"{s['chat_ttft_ms']:.0f} ms vs {s['responses_ttft_ms']:.0f} ms.\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", type=Path, default=RESULTS / "responses_bench")
    a = ap.parse_args(argv)
    log = a.out / "responses_bench-server.log"
    extra = ("--model", a.model) if a.model else ()
    with server_process(log, "--threads", str(a.threads), "--max-model-len", "4096", *extra) as (base, _):
        with httpx.Client(base_url=base, timeout=600) as client:
            list(run_chat(client, 1, 4)) + list(run_responses(client, 1, 4))  # warm-up, namespaces of their own
            chat, resp = [], []
            for c, r in zip(run_chat(client, a.turns, a.max_tokens), run_responses(client, a.turns, a.max_tokens)):
                chat.append(c)  # turn k of chat, then turn k of responses: both see the same machine load
                resp.append(r)
    log.unlink(missing_ok=True)
    for t in chat + resp:
        t["prefilled_tokens"] = t["prompt_tokens"] - t["cached_tokens"]
    summary = {"chat_bytes": sum(t["request_bytes"] for t in chat), "responses_bytes": sum(t["request_bytes"] for t in resp),
               "chat_prefilled": sum(t["prefilled_tokens"] for t in chat),
               "responses_prefilled": sum(t["prefilled_tokens"] for t in resp),
               "chat_ttft_ms": statistics.median(t["ttft_s"] for t in chat[1:]) * 1e3,
               "responses_ttft_ms": statistics.median(t["ttft_s"] for t in resp[1:]) * 1e3,
               "equal_replies": sum(c["text"] == r["text"] for c, r in zip(chat, resp))}
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": f"{cpu_model()}, {a.threads} threads",
           "model": a.model or MODEL, "turns": a.turns, "max_tokens": a.max_tokens, "summary": summary,
           "chat": chat, "responses": resp}
    write_report(a.out, result_name("responses_bench", a.model or MODEL), res, _markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
