"""Section 2, multi-turn TTFT: MT-Bench turns with KV reuse against re-prefill (kvkeeper without reuse,
transformers, llama.cpp), and 2b, short Topical-Chat turns."""

from __future__ import annotations

import json
import time
import traceback

from kvkeeper import LLMEngine, SamplingParams, SessionManager

from .base import BenchConfig, ROOT, TARGET_MULTITURN_LAST_TURN, TARGET_TTFT_VS_LLAMA, _err, _ratio, log
from .peers import hf_generate


def sessions_of(engine: LLMEngine) -> SessionManager:
    """The engine's session manager (made on first use)."""
    return next((h for h in engine.kv.holders if isinstance(h, SessionManager)), None) or SessionManager(engine)


def bench_multiturn(engine: LLMEngine, hf, llm, llm_status: str, questions: list[dict], bc: BenchConfig,
                    user_turns: list[str] | None = None, reply_tokens: int | None = None,
                    source: str | None = None) -> dict:
    """Turn-by-turn TTFT of one conversation (default: MT-Bench first turns, replies of bc.reply_tokens)."""
    if user_turns is None:
        user_turns = [q["turns"][0] for q in questions[: bc.turns]]
        source = ("data/mt_bench/question.jsonl, first-turn questions "
                  f"{[q['question_id'] for q in questions[: bc.turns]]}")
    reply_tokens = reply_tokens or bc.reply_tokens
    # warm-up of the engine's kernels (isolated namespace: nothing cached for the session)
    engine.generate([engine.encode_chat([{"role": "user", "content": "Hello there!"}])],
                    SamplingParams(max_tokens=8), namespace=engine.isolated_namespace("warm"))
    sess = sessions_of(engine).open(params=SamplingParams(max_tokens=reply_tokens))
    rows = []
    log(f"multi-turn: kvkeeper session, {len(user_turns)} turns")
    for q in user_turns:
        r = sess.send(q)
        rows.append({"turn": r.turn, "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                     "new_tokens": r.prompt_tokens - r.cached_tokens, "kvkeeper_ttft_s": r.ttft_s,
                     "reply_tokens": r.completion_tokens, "finish_reason": r.finish_reason,
                     "kvkeeper_first_token": r.token_ids[0] if r.token_ids else None,
                     "_prompt_ids": list(r.prompt_token_ids), "_reply_ids": list(r.token_ids)})
    sess.close()

    log("multi-turn: kvkeeper without reuse")
    for row in rows:
        ids = row["_prompt_ids"]
        engine.generate([ids], SamplingParams(max_tokens=1), namespace=engine.isolated_namespace("noreuse-warm"))
        o = engine.generate([ids], SamplingParams(max_tokens=1), namespace=engine.isolated_namespace("noreuse"))[0]
        row["noreuse_ttft_s"] = o.ttft_s
        row["noreuse_cached_tokens"] = o.cached_tokens
        row["noreuse_first_token"] = o.token_ids[0] if o.token_ids else None

    log("multi-turn: transformers re-prefill")
    for row in rows:
        ids = row["_prompt_ids"]
        if hf is None:
            row["transformers_ttft_s"] = None
            continue
        hf_generate(hf, ids, 1)  # warm-up on the same prompt
        t0 = time.perf_counter()
        out = hf_generate(hf, ids, 1)
        row["transformers_ttft_s"] = time.perf_counter() - t0
        row["transformers_first_token"] = int(out[0, len(ids)])

    llama_rows_status = llm_status
    if llm is not None:
        log("multi-turn: llama.cpp with its own prefix reuse")
        try:
            llm.reset()
            for row in rows:
                ids = row["_prompt_ids"]
                t0 = time.perf_counter()
                llm.create_completion(prompt=ids, max_tokens=1, temperature=0.0)
                row["llama_cpp_ttft_s"] = time.perf_counter() - t0
                # bring its cache to prompt + reply, as a chat server holding the slot would (untimed)
                llm.create_completion(prompt=ids + row["_reply_ids"], max_tokens=1, temperature=0.0)
        except Exception as e:  # noqa: BLE001
            llama_rows_status = f"failed: {_err(e)}"
            traceback.print_exc()

    for row in rows:
        row["ratio_transformers_over_kvkeeper"] = _ratio(row.get("transformers_ttft_s"), row["kvkeeper_ttft_s"])
        row["ratio_noreuse_over_kvkeeper"] = _ratio(row.get("noreuse_ttft_s"), row["kvkeeper_ttft_s"])
        row["ratio_llama_cpp_over_kvkeeper"] = _ratio(row.get("llama_cpp_ttft_s"), row["kvkeeper_ttft_s"])
        ft = [row.get(k) for k in ("kvkeeper_first_token", "noreuse_first_token", "transformers_first_token")]
        row["first_token_agrees"] = len({t for t in ft if t is not None}) <= 1
        row.pop("_prompt_ids"), row.pop("_reply_ids")
    last = rows[-1]
    ratio = last["ratio_transformers_over_kvkeeper"]
    vs_llama = _ratio(last["kvkeeper_ttft_s"], last.get("llama_cpp_ttft_s"))
    note = "target defined for turn 10 of the full run" if bc.quick else ""
    return {
        "user_turns_from": source,
        "reply_max_tokens": reply_tokens,
        "llama_cpp": llama_rows_status,
        "turns": rows,
        "new_tokens_per_turn_after_1": [r["new_tokens"] for r in rows[1:]],
        "target": {"metric": f"transformers TTFT / kvkeeper TTFT at turn {last['turn']}",
                   "target": TARGET_MULTITURN_LAST_TURN, "measured": ratio,
                   "met": None if ratio is None else ratio >= TARGET_MULTITURN_LAST_TURN, "note": note},
        "target_llama_cpp": {"metric": f"kvkeeper TTFT / llama.cpp TTFT (its prefix reuse) at turn {last['turn']}",
                             "target": TARGET_TTFT_VS_LLAMA, "op": "<=", "measured": vs_llama,
                             "met": None if vs_llama is None else vs_llama <= TARGET_TTFT_VS_LLAMA, "note": note},
        "first_token_agrees_all_turns": all(r["first_token_agrees"] for r in rows),
    }


def topical_chat_turns(n: int) -> tuple[list[str], str]:
    """The first n messages of agent_1 in the first Topical-Chat conversation (short chat turns)."""
    path = ROOT / "data" / "topical_chat" / "test_freq_conversations_first20.jsonl"
    conv = json.loads(path.read_text().splitlines()[0])
    msgs = [t["text"] for t in conv["turns"] if t["speaker"] == "agent_1"][:n]
    return msgs, f"{path.relative_to(ROOT)}, conversation {conv['id']}, agent_1's first {len(msgs)} messages"


def bench_multiturn_short(engine: LLMEngine, hf, llm, llm_status: str, bc: BenchConfig) -> dict:
    """Short turns: each adds the previous short reply plus a one-line message (about 30-60 tokens)."""
    msgs, source = topical_chat_turns(bc.short_turns)
    log(f"short turns: {len(msgs)} Topical-Chat messages, replies of at most {bc.short_reply_tokens} tokens")
    return bench_multiturn(engine, hf, llm, llm_status, [], bc, user_turns=msgs, reply_tokens=bc.short_reply_tokens,
                           source=source)
