"""``kvkeeper generate | chat | converse``: one prompt, an interactive session, scripted conversations.

Results go to stdout; progress and per-turn stats to stderr, so ``--json`` output stays parseable.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..argtypes import non_negative_int
from ..errors import ContextLengthError, KVKeeperError
from ..progress import progress
from ..sessions.manager import SessionManager
from .common import (EXIT_OK, CLIError, add_sampling, command, fmt_s, load_engine, out_console, sampling,
                     stats_line, stderr)
from ..engine.handle import EngineHandle


def add_parsers(sub, parent: argparse.ArgumentParser) -> None:
    """Add ``generate``, ``chat`` and ``converse`` to the subcommands ``sub`` (parent: the engine options)."""
    g = command(sub, cmd_generate, "generate", parents=[parent], help="complete one prompt",
                       description="Complete one prompt.  Raw text by default; --chat sends it as one user message "
                                   "through the model's chat template.")
    g.add_argument("--prompt", required=True, metavar="TEXT", help="the prompt text ('-' reads it from stdin)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as one user message with the chat template")
    g.add_argument("--system", metavar="TEXT", help="system message (implies --chat)")
    add_sampling(g, max_tokens=128, temperature=0.0, top=True)
    g.add_argument("--stop", nargs="+", action="extend", default=[], metavar="STR",
                   help="strings that end generation (not included in the text)")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token ids, token counts, timings) instead of the text")

    c = command(sub, cmd_chat, "chat", parents=[parent], help="interactive multi-turn chat (one session, KV kept between turns)",
                       description="Chat on one session: each line read from stdin is a user message.  "
                                   "Commands: /reset starts a new session, /exit (or end of input) quits.")
    c.add_argument("--system", metavar="TEXT", help="system message")
    add_sampling(c, max_tokens=256, temperature=0.7)

    v = command(sub, cmd_converse, "converse", parents=[parent], help="run scripted multi-turn conversations from a JSONL file",
                       description="Run scripted conversations, one session per JSONL line.  A line holds a list of "
                                   "user turns under 'turns': strings (MT-Bench) or objects with 'text' (Topical-Chat).  "
                                   "The id is 'question_id', else 'id', else the line number.")
    v.add_argument("file", metavar="FILE.jsonl", help="conversations, one JSON object per line")
    add_sampling(v, max_tokens=128, temperature=0.0)
    v.add_argument("--system", metavar="TEXT", help="system message for every conversation")
    v.add_argument("--limit", type=non_negative_int, metavar="K", help="run only the first K conversations")
    v.add_argument("--json", metavar="OUT", dest="json_out", help="write one JSON record per turn to OUT")
    v.add_argument("--no-reuse", action="store_true",
                   help="recompute the whole conversation every turn (baseline without KV reuse)")
    v.add_argument("--turns", type=non_negative_int, metavar="N", help="run only the first N turns of each conversation")
    v.add_argument("--compare", action="store_true",
                   help="run each conversation with KV reuse and again with a full re-prefill of the same history "
                        "every turn; print TTFT of both per turn and their ratio")
    v.add_argument("--plot", metavar="FILE.png", help="with --compare: draw TTFT per turn of both runs "
                                                      "(needs matplotlib: pip install 'kvkeeper[plots]')")


# ---- generate -------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise CLIError("the prompt is empty: give some text with --prompt TEXT (or --prompt - to read stdin)")
    chat = args.chat or args.system is not None
    params = sampling(args, top_p=args.top_p, top_k=args.top_k, stop=args.stop)  # validate before loading
    engine = load_engine(args)
    if chat:
        messages = ([{"role": "system", "content": args.system}] if args.system is not None else [])
        messages.append({"role": "user", "content": prompt})
        ids: str | list[int] = engine.encode_chat(messages)
    else:
        ids = prompt
    out = engine.generate([ids], params)[0]
    if out.finish_reason == "error":
        raise KVKeeperError(out.error or "the request failed")
    if args.json:
        rec = {
            "model": engine.model_name,
            "text": out.text,
            "token_ids": out.token_ids,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "cached_tokens": out.cached_tokens,
            "finish_reason": out.finish_reason,
            "ttft_s": out.ttft_s,
            "decode_tok_per_s": out.decode_tok_per_s,
        }
        print(json.dumps(rec))
    else:
        print(out.text, flush=True)
        speed = "n/a" if out.decode_tok_per_s is None else f"{out.decode_tok_per_s:.1f}"
        stderr(f"prompt {out.prompt_tokens} tok, cached {out.cached_tokens} tok, completion "
                f"{out.completion_tokens} tok ({out.finish_reason}), TTFT {fmt_s(out.ttft_s)} s, {speed} tok/s")
    return EXIT_OK


# ---- chat -----------------------------------------------------------------------

_CHAT_HELP = "commands: /reset (new conversation), /exit (quit), /help"


def cmd_chat(args: argparse.Namespace) -> int:
    params = sampling(args)
    engine = load_engine(args)
    interactive = sys.stdin.isatty()
    if interactive:
        stderr(_CHAT_HELP)
    sessions = SessionManager(engine)
    session = sessions.open(system=args.system, params=params)
    try:
        while True:
            if interactive:
                sys.stderr.write("you> ")
                sys.stderr.flush()
            line = sys.stdin.readline()
            if not line:  # EOF
                break
            text = line.strip()
            if not text:
                continue
            cmd = text.lower()
            if cmd in ("/exit", "/quit"):
                break
            if cmd == "/reset":
                session.close()
                session = sessions.open(system=args.system, params=params)
                stderr("(new session)")
                continue
            if cmd in ("/help", "/?"):
                stderr(_CHAT_HELP)
                continue
            try:
                r = session.send(text)
            except ContextLengthError as e:
                stderr(f"error: {e}; type /reset to start a new conversation", style="red")
                continue
            except KVKeeperError as e:
                stderr(f"error: {e}", style="red")
                continue
            print(r.text, flush=True)
            stderr(stats_line(r))
    finally:
        session.close()
    return EXIT_OK


# ---- converse -------------------------------------------------------------------


def load_conversations(path: str | Path, limit: int | None = None) -> list[tuple[Any, list[str]]]:
    """Read ``(id, [user turn texts])`` from a JSONL file.

    Raises :class:`FileNotFoundError` for a missing file and :class:`CLIError` naming the
    line for a line that is not a JSON object or has no non-empty list of turns.
    """
    path = Path(path)
    if path.is_dir():
        raise CLIError(f"{path} is a folder, not a JSONL file")
    convs: list[tuple[Any, list[str]]] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(convs) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise CLIError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise CLIError(f"{where}: expected a JSON object with a 'turns' list, got {type(obj).__name__}")
            if "turns" not in obj:
                raise CLIError(f"{where}: no 'turns' key; expected e.g. "
                               '{"question_id": 1, "turns": ["first message", "second message"]}')
            turns = obj["turns"]
            if not isinstance(turns, list) or not turns:
                raise CLIError(f"{where}: 'turns' must be a non-empty list of user messages, got {turns!r}")
            texts: list[str] = []
            for i, t in enumerate(turns, 1):
                text = t.get("text") if isinstance(t, dict) else t
                if not isinstance(text, str) or not text.strip():
                    raise CLIError(f"{where}: turn {i} must be a non-empty string or an object with a non-empty "
                                   f"'text' string, got {t!r}")
                texts.append(text)
            cid = obj["question_id"] if "question_id" in obj else obj["id"] if "id" in obj else lineno
            convs.append((cid, texts))
    return convs


def _turn_record(cid: Any, r) -> dict:
    return {"id": cid, "turn": r.turn, "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
            "completion_tokens": r.completion_tokens, "ttft_s": r.ttft_s, "decode_tok_per_s": r.decode_tok_per_s,
            "finish_reason": r.finish_reason, "text": r.text, "token_ids": r.token_ids, "error": None}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def cmd_converse(args: argparse.Namespace) -> int:
    convs = load_conversations(args.file, args.limit)
    if args.turns is not None:
        convs = [(cid, turns[: args.turns]) for cid, turns in convs if args.turns]
    if not convs:
        raise CLIError(f"{args.file}: no conversations to run"
                       + (" (--limit 0)" if args.limit == 0 else " (--turns 0)" if args.turns == 0 else ""))
    out_path = Path(args.json_out) if args.json_out else None
    for flag, path in (("--json", out_path), ("--plot", Path(args.plot) if args.plot else None)):
        if path is not None and not path.resolve().parent.is_dir():
            raise CLIError(f"cannot write {flag} {path}: folder {path.resolve().parent} does not exist")
    if args.compare and args.no_reuse:
        raise CLIError("--compare runs both ways already; leave out --no-reuse")
    if args.plot and not args.compare:
        raise CLIError("--plot draws the two runs of --compare; add --compare")
    params = sampling(args)
    engine = load_engine(args)
    if args.compare:
        records = _compare(engine, convs, args, params)
    else:
        records = _run_conversations(SessionManager(engine), convs, args.system, not args.no_reuse, params)
        out = out_console()
        out.print(_turn_table(records, f"{engine.model_name}: {len(convs)} conversations, {len(records)} turns"
                                       + (" (no KV reuse)" if args.no_reuse else "")))
        out.print(_summary(records), markup=False)
    if out_path is not None:
        out_path.write_text(json.dumps(records, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        stderr(f"wrote {len(records)} turn records to {out_path}")
    return EXIT_OK


def _compare(engine: EngineHandle, convs, args: argparse.Namespace, params) -> list[dict]:
    """``converse --compare``: both runs, the table, the summary and the optional plot (kvkeeper.cli.compare)."""
    from .compare import compare_summary, compare_table, plot_compare, run_compare

    with progress("turns", total=sum(len(t) for _, t in convs)) as p:
        records = run_compare(engine, convs, args.system, params, p)
    title = (f"{engine.model_name}: {len(convs)} conversation(s), {len(records)} turns, "
             f"KV reuse vs re-prefill of the same history")
    out = out_console()
    out.print(compare_table(records, title))
    out.print(compare_summary(records), markup=False)
    if args.plot:
        plot_compare(records, args.plot, title)
        stderr(f"wrote the TTFT plot to {args.plot}")
    return records


def _run_conversations(sessions: SessionManager, convs, system: str | None, reuse: bool, params) -> list[dict]:
    """One session per conversation, one record per turn (a turn that no longer fits ends its conversation)."""
    records: list[dict] = []
    with progress("turns", total=sum(len(t) for _, t in convs)) as p:
        for cid, turns in convs:
            session = sessions.open(system=system, reuse=reuse, params=params)
            try:
                for i, text in enumerate(turns, 1):
                    p.description = f"{cid} turn {i}"
                    try:
                        records.append(_turn_record(cid, session.send(text)))
                    except ContextLengthError as e:
                        p.note(f"conversation {cid} turn {i}: {e}; skipping the rest of it")
                        records.append({"id": cid, "turn": i, "prompt_tokens": e.prompt_tokens, "cached_tokens": None,
                                        "completion_tokens": None, "ttft_s": None, "decode_tok_per_s": None,
                                        "finish_reason": "error", "text": None, "token_ids": None, "error": str(e)})
                        p.advance(len(turns) - i + 1)
                        break
                    p.advance()
            finally:
                session.close()
    return records


def _turn_table(records: list[dict], title: str):
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title)
    table.add_column("id", overflow="fold")
    table.add_column("turn", justify="right")
    for name in ("prompt tok", "cached tok", "completion tok", "TTFT s", "decode tok/s"):
        table.add_column(name, justify="right")
    for rec in records:
        if rec["error"]:
            table.add_row(escape(str(rec["id"])), str(rec["turn"]), str(rec["prompt_tokens"]),
                          "[red]context full[/red]", "-", "-", "-")
            continue
        speed = "n/a" if rec["decode_tok_per_s"] is None else f"{rec['decode_tok_per_s']:.1f}"
        table.add_row(escape(str(rec["id"])), str(rec["turn"]), str(rec["prompt_tokens"]), str(rec["cached_tokens"]),
                      str(rec["completion_tokens"]), fmt_s(rec["ttft_s"]), speed)
    return table


def _summary(records: list[dict]) -> str:
    ok = [r for r in records if not r["error"]]
    first = [r["ttft_s"] for r in ok if r["turn"] == 1 and r["ttft_s"] is not None]
    later = [r["ttft_s"] for r in ok if r["turn"] > 1 and r["ttft_s"] is not None]
    cached = sum(r["cached_tokens"] for r in ok)
    prompt = sum(r["prompt_tokens"] for r in ok)
    m1, m2 = _mean(first), _mean(later)
    summary = (f"mean TTFT: turn 1 {fmt_s(m1)} s ({len(first)} turns), later turns {fmt_s(m2)} s "
               f"({len(later)} turns)")
    if m1 and m2:
        summary += f", {m1 / m2:.1f}x faster" if m2 < m1 else f", {m2 / m1:.1f}x slower"
    summary += f"; cached tokens: {cached} of {prompt} prompt tokens"
    if prompt:
        summary += f" ({100 * cached / prompt:.1f}%)"
    failed = len(records) - len(ok)
    if failed:
        summary += f"; {failed} turn(s) did not fit the context"
    return summary
