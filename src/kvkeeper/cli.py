"""Command-line interface: ``kvkeeper generate | chat | converse | serve``.

Run as ``kvkeeper ...``, ``python -m kvkeeper ...`` or ``python -m kvkeeper.cli ...``.

* ``generate``  one prompt (raw text, or one user message through the chat template with ``--chat``).
* ``chat``      an interactive REPL on one session (works with piped stdin too); ``/reset``, ``/exit``.
* ``converse``  scripted multi-turn conversations from a JSONL file (MT-Bench or Topical-Chat
                format), one session per line, with a per-turn table of prompt / cached /
                completion tokens, TTFT and decode speed.
* ``serve``     the OpenAI-compatible HTTP server (``kvkeeper.api``).

Results go to stdout; logging, progress and per-turn stats go to stderr, so ``--json``
output stays parseable.  Any kvkeeper error (unknown model, empty prompt, bad input
file...) prints ``error: <message>`` on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

from . import __version__
from .argtypes import non_negative_int as _non_negative_int
from .argtypes import positive_int as _positive_int
from .argtypes import size as _size
from .engine.sampling_params import SamplingParams
from .errors import ContextLengthError, KVKeeperError
from .model.registry import DEFAULT_MODEL

EXIT_OK = 0
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130


class CLIError(Exception):
    """A usage or input problem found by the CLI itself (bad input file, empty prompt...)."""


# ---- consoles ----------------------------------------------------------------


def _err_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def _out_console():
    from rich.console import Console

    # When stdout is not a terminal rich assumes 80 columns and would squeeze the table.
    return Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def _stderr(msg: str, style: str | None = "dim") -> None:
    _err_console().print(msg, style=style, markup=False)


# ---- parser ---------------------------------------------------------------------


def _engine_parent() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("engine options")
    g.add_argument("--model", default=DEFAULT_MODEL, metavar="ID_OR_PATH",
                   help=f"known model id or path to a .gguf file / Hugging Face folder (default: {DEFAULT_MODEL})")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weights and activations dtype (default: float32 on CPU, bfloat16 on CUDA)")
    g.add_argument("--device", default="auto", metavar="{auto,cpu,cuda}",
                   help="where weights and the KV block pool live (default: auto = cuda when available)")
    g.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights for --model = a shipped config name (llama-3.1-8b, llama-3-8b, "
                        "qwen2.5-7b) or a config.json path, to measure speed without weight files")
    g.add_argument("--enforce-eager", action="store_true", help="CUDA: no decode CUDA graphs")
    g.add_argument("--quantization", default=None, metavar="{auto,none,gguf,int8,int4}",
                   help="weight format: none = float32 (exact), gguf = the GGUF file's Q4_0/Q4_1/Q8_0 blocks computed "
                        "in place, int8 / int4 = round-to-nearest groups of 32 (default: auto, the fastest format "
                        "meeting the quality bar for the file: gguf for the embedded model)")
    g.add_argument("--kv-dtype", choices=["fp32", "bf16", "fp16", "int8", "fp8"], default=None,
                   help="KV cache storage; int8 and fp8 (e4m3) are quantized per token and KV head "
                        "(default: the --dtype)")
    g.add_argument("--block-size", type=_positive_int, default=16, metavar="N", help="tokens per KV block (default: 16)")
    kv = g.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-bytes", type=_size, metavar="N",
                    help="KV cache budget in bytes, suffixes K/M/G allowed (default: 1G)")
    kv.add_argument("--kv-blocks", type=_positive_int, metavar="N", help="KV cache size in blocks (overrides the byte budget)")
    g.add_argument("--max-batched-tokens", type=_positive_int, default=512, metavar="N",
                   help="token budget per engine step, i.e. the prefill chunk size (default: 512)")
    g.add_argument("--max-model-len", type=_positive_int, metavar="N",
                   help="cap the context window at N tokens (default: the model's own)")
    g.add_argument("--threads", type=_positive_int, metavar="N", help="CPU threads for torch (default: torch's choice)")
    g.add_argument("-v", "--verbose", action="store_true", help="log engine activity (INFO) to stderr")
    return p


def _add_sampling(p: argparse.ArgumentParser, max_tokens: int, temperature: float, top: bool = False) -> None:
    g = p.add_argument_group("sampling options")
    g.add_argument("--max-tokens", type=_positive_int, default=max_tokens, metavar="N",
                   help=f"new tokens at most per reply (default: {max_tokens})")
    g.add_argument("--temperature", type=float, default=temperature, metavar="T",
                   help=f"sampling temperature, 0 = greedy (default: {temperature:g})")
    if top:
        g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass in (0, 1] (default: 1)")
        g.add_argument("--top-k", type=_non_negative_int, default=0, metavar="K", help="keep the K most likely tokens, 0 = off")
    g.add_argument("--seed", type=int, default=None, metavar="S", help="random seed for reproducible sampling")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvkeeper",
        description="kvkeeper: an LLM inference engine whose first-class object is the KV cache of a conversation.",
    )
    parser.add_argument("--version", action="version", version=f"kvkeeper {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    parent = _engine_parent()

    g = sub.add_parser("generate", parents=[parent], help="complete one prompt",
                       description="Complete one prompt.  Raw text by default; --chat sends it as one user message "
                                   "through the model's chat template.")
    g.add_argument("--prompt", required=True, metavar="TEXT", help="the prompt text ('-' reads it from stdin)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as one user message with the chat template")
    g.add_argument("--system", metavar="TEXT", help="system message (implies --chat)")
    _add_sampling(g, max_tokens=128, temperature=0.0, top=True)
    g.add_argument("--stop", nargs="+", action="extend", default=[], metavar="STR",
                   help="strings that end generation (not included in the text)")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token ids, token counts, timings) instead of the text")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", parents=[parent], help="interactive multi-turn chat (one session, KV kept between turns)",
                       description="Chat on one session: each line read from stdin is a user message.  "
                                   "Commands: /reset starts a new session, /exit (or end of input) quits.")
    c.add_argument("--system", metavar="TEXT", help="system message")
    _add_sampling(c, max_tokens=256, temperature=0.7)
    c.set_defaults(func=cmd_chat)

    v = sub.add_parser("converse", parents=[parent], help="run scripted multi-turn conversations from a JSONL file",
                       description="Run scripted conversations, one session per JSONL line.  A line holds a list of "
                                   "user turns under 'turns': strings (MT-Bench) or objects with 'text' (Topical-Chat).  "
                                   "The id is 'question_id', else 'id', else the line number.")
    v.add_argument("file", metavar="FILE.jsonl", help="conversations, one JSON object per line")
    v.add_argument("--system", metavar="TEXT", help="system message for every conversation")
    _add_sampling(v, max_tokens=128, temperature=0.0)
    v.add_argument("--limit", type=_non_negative_int, metavar="K", help="run only the first K conversations")
    v.add_argument("--json", metavar="OUT", dest="json_out", help="write one JSON record per turn to OUT")
    v.add_argument("--no-reuse", action="store_true",
                   help="recompute the whole conversation every turn (baseline without KV reuse)")
    v.set_defaults(func=cmd_converse)

    s = sub.add_parser("serve", parents=[parent], help="run the OpenAI-compatible HTTP server",
                       description="Serve /v1/chat/completions, /v1/completions, /v1/models, /v1/sessions, "
                                   "/health and /metrics over HTTP.")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    s.add_argument("--port", type=_positive_int, default=8000, help="TCP port (default: 8000)")
    s.add_argument("--served-model-name", metavar="NAME",
                   help="the model id clients send and /v1/models lists (default: the --model value)")
    s.add_argument("--max-queue", type=_positive_int, default=256, metavar="N",
                   help="requests that may wait before new ones get 503 (default: 256)")
    s.add_argument("--max-body-bytes", type=_size, default=4 << 20, metavar="N",
                   help="larger request bodies get 413, suffixes K/M/G allowed (default: 4M)")
    s.add_argument("--max-new-tokens", type=_positive_int, metavar="N",
                   help="most tokens one choice may generate; larger or omitted max_tokens are cut to N "
                        "(default: the rest of the context)")
    b = s.add_argument_group("KV circuit breaker (see README: Circuit breaker)")
    b.add_argument("--no-breaker", action="store_true", help="do not watch KV memory (no compaction/offload/degrade)")
    b.add_argument("--breaker-frag-threshold", type=float, default=0.683, metavar="F",
                   help="trip at this pool fragmentation rate, 0..1 (default: 0.683)")
    b.add_argument("--breaker-usage-threshold", type=float, default=0.95, metavar="U",
                   help="trip at this KV usage, 0..1 (default: 0.95)")
    b.add_argument("--breaker-recover-usage", type=float, default=None, metavar="U",
                   help="close again below this KV usage, 0..1 (default: min(0.80, 0.85 x the usage threshold))")
    b.add_argument("--degrade-budget-tokens", type=_positive_int, default=512, metavar="N",
                   help="while degraded, the lowest-priority sessions' prompts keep only their newest turns "
                        "that fit N tokens (default: 512)")
    s.add_argument("--otel-traces", choices=["none", "console", "otlp"], default="none",
                   help="OpenTelemetry request traces: none (default), console (stdout) or otlp (OTLP/HTTP)")
    s.add_argument("--otlp-traces-endpoint", metavar="URL",
                   help="OTLP/HTTP traces endpoint, e.g. http://127.0.0.1:4318/v1/traces (implies --otel-traces otlp)")
    s.add_argument("--data-dir", metavar="DIR",
                   help="disk tier of session offload: sessions are saved under DIR/sessions and reopened at start "
                        "(default: none, no disk tier)")
    s.add_argument("--host-offload-bytes", type=_size, metavar="N",
                   help="host-memory budget of offloaded session KV, e.g. 2G (default: 1G)")
    s.set_defaults(func=cmd_serve)
    from .diagnostics.cli import add_audit_fraction, add_kv_commands

    add_audit_fraction(s)

    e = sub.add_parser("eval", help="quality under KV quantization: perplexity of a long text",
                       description="Evaluate the model through kvkeeper's own KV cache.")
    esub = e.add_subparsers(dest="eval_command", metavar="TASK")
    esub.required = True
    pp = esub.add_parser("perplexity", parents=[parent], help="perplexity of the first N tokens of a UTF-8 text",
                         description="Run the first --context tokens of --text as one sequence (prefilled in chunks "
                                     "through the paged KV cache) and report its perplexity.")
    pp.add_argument("--text", required=True, metavar="FILE", help="a UTF-8 text file")
    pp.add_argument("--context", type=_positive_int, required=True, metavar="N", help="tokens to score")
    pp.add_argument("--skip-tokens", type=_non_negative_int, default=0, metavar="N",
                    help="start N tokens into the text (e.g. past a title page)")
    pp.add_argument("--chunk", type=_positive_int, default=512, metavar="N", help="prefill chunk in tokens (default: 512)")
    pp.add_argument("--policy", choices=["streaming_llm", "h2o", "snapkv", "knorm"],
                    help="compress the context's KV with this policy, then score --score-tokens more tokens")
    pp.add_argument("--ratio", type=float, default=0.5, metavar="R",
                    help="fraction of the context's tokens the policy drops, in [0, 1) (default: 0.5)")
    pp.add_argument("--score-tokens", type=_positive_int, metavar="M",
                    help="score only the M tokens after the --context tokens (continuation perplexity; "
                         "default 256 with --policy, else every position of the context is scored)")
    pp.add_argument("--json", action="store_true", help="print one JSON object: ppl, tokens, kv_bytes_per_token, ...")
    pp.set_defaults(func=cmd_eval_perplexity)
    pk = esub.add_parser("passkey", parents=[parent], help="passkey retrieval accuracy over lengths and depths",
                         description="Hide a five-digit pass key at each depth of a filler text of each length and "
                                     "ask for it (greedy); report the accuracy per cell and overall.")
    pk.add_argument("--lengths", type=_positive_int, nargs="+", default=[1024, 2048, 4096], metavar="N",
                    help="prompt lengths in tokens (default: 1024 2048 4096)")
    pk.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.5, 1.0], metavar="D",
                    help="needle depths in [0, 1] (default: 0 0.5 1)")
    pk.add_argument("--trials", type=_positive_int, default=2, metavar="K", help="keys per cell (default: 2)")
    pk.add_argument("--policy", choices=["streaming_llm", "h2o", "snapkv", "knorm"],
                    help="compress each prompt's KV with this policy after prefill")
    pk.add_argument("--ratio", type=float, default=0.5, metavar="R", help="fraction dropped (default: 0.5)")
    pk.add_argument("--seed", type=int, default=0, help="seed of the pass keys (default: 0)")
    pk.add_argument("--json", action="store_true", help="print one JSON object with the cells and the accuracy")
    pk.set_defaults(func=cmd_eval_passkey)

    kvp = sub.add_parser("kv", help="inspect the KV cache: block map, dump, diff, audit",
                         description="Inspect the KV cache of a server or of a local engine: the block map, "
                                     "layer-wise dumps and diffs, the reuse audit.")
    kvsub = kvp.add_subparsers(dest="kv_command", metavar="TOOL")
    kvsub.required = True
    km = kvsub.add_parser("map", parents=[parent], help="draw the KV block pool in the terminal",
                          description="Draw every KV block as a coloured cell (free, cached, owned per owner, shared, "
                                      "offloaded) with the fragmentation figures, from a server's /admin/kv.json or "
                                      "(--demo) from a local engine after a few prompts.  Engine options apply to --demo.")
    km.add_argument("--server", default="http://127.0.0.1:8000", metavar="URL",
                    help="kvkeeper server base URL (default: http://127.0.0.1:8000)")
    km.add_argument("--demo", action="store_true",
                    help="no server: load the model, run a session and a request, draw that engine's pool")
    km.add_argument("--watch", action="store_true", help="refresh in place until Ctrl-C (with --server)")
    km.add_argument("--interval", type=float, default=1.0, metavar="S", help="refresh period with --watch (default: 1 s)")
    km.add_argument("--rows", type=_positive_int, default=32, metavar="N",
                    help="at most N rows of cells; larger pools draw several blocks per cell (default: 32)")
    km.add_argument("--json", action="store_true", help="print the block-map document (JSON) instead of drawing it")
    km.set_defaults(func=cmd_kv_map)
    add_kv_commands(kvsub, parent)
    return parser


# ---- shared helpers -------------------------------------------------------------


def _sampling(args: argparse.Namespace, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed, **extra)


def _load_engine(args: argparse.Namespace):
    from .engine.llm_engine import LLMEngine
    from .model.registry import resolve_model_path

    if args.load_format == "dummy":
        from .model.dummy import resolve_config

        resolve_config(args.model)  # fail fast, listing the shipped config names
    else:
        resolve_model_path(args.model)  # fail fast (and listing the known ids) before anything slow
    kw: dict[str, Any] = {"dtype": args.dtype, "block_size": args.block_size,
                          "max_num_batched_tokens": args.max_batched_tokens, "device": args.device,
                          "load_format": args.load_format, "cuda_graphs": not args.enforce_eager}
    if args.kv_blocks is not None:
        kw["num_kv_blocks"] = args.kv_blocks
    if args.kv_cache_bytes is not None:
        kw["kv_cache_bytes"] = args.kv_cache_bytes
    if args.max_model_len is not None:
        kw["max_model_len"] = args.max_model_len
    if args.threads is not None:
        kw["num_threads"] = args.threads
    if args.kv_dtype is not None:
        kw["kv_dtype"] = args.kv_dtype
    if getattr(args, "quantization", None) is not None:
        kw["quantization"] = args.quantization
    if getattr(args, "data_dir", None) is not None:
        kw["data_dir"] = args.data_dir
    if getattr(args, "host_offload_bytes", None) is not None:
        kw["host_offload_bytes"] = args.host_offload_bytes
    if getattr(args, "audit_fraction", 0.0):
        kw["audit_fraction"] = args.audit_fraction
    t0 = time.perf_counter()
    # Keep stdout clean for results: anything a library prints while loading goes to stderr.
    with _err_console().status(f"loading {args.model} ..."), contextlib.redirect_stdout(sys.stderr):
        engine = LLMEngine(args.model, **kw)
    _stderr(f"loaded {engine.model_name} ({str(engine.runner.dtype).removeprefix('torch.')} on {engine.runner.device}, "
            f"weights {engine.runner.weight_description}, KV {engine.runner.kv_format.name} at "
            f"{engine.kv_bytes_per_token:,} bytes/token, {engine.pool.num_blocks} KV blocks of {engine.block_size} "
            f"tokens, context {engine.context_length}) in {time.perf_counter() - t0:.1f} s")
    return engine


def _fmt_s(x: float | None, nd: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def _stats_line(r) -> str:
    speed = "n/a tok/s" if r.decode_tok_per_s is None else f"{r.decode_tok_per_s:.1f} tok/s"
    return (f"[turn {r.turn}] prompt {r.prompt_tokens} tok, cached {r.cached_tokens} tok, "
            f"completion {r.completion_tokens} tok, TTFT {_fmt_s(r.ttft_s)} s, {speed}")


# ---- generate -------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise CLIError("the prompt is empty: give some text with --prompt TEXT (or --prompt - to read stdin)")
    chat = args.chat or args.system is not None
    params = _sampling(args, top_p=args.top_p, top_k=args.top_k, stop=args.stop)  # validate before loading
    engine = _load_engine(args)
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
        _stderr(f"prompt {out.prompt_tokens} tok, cached {out.cached_tokens} tok, completion "
                f"{out.completion_tokens} tok ({out.finish_reason}), TTFT {_fmt_s(out.ttft_s)} s, {speed} tok/s")
    return EXIT_OK


# ---- chat -----------------------------------------------------------------------

_CHAT_HELP = "commands: /reset (new conversation), /exit (quit), /help"


def cmd_chat(args: argparse.Namespace) -> int:
    params = _sampling(args)
    engine = _load_engine(args)
    interactive = sys.stdin.isatty()
    if interactive:
        _stderr(_CHAT_HELP)
    session = engine.new_session(system=args.system, params=params)
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
                session = engine.new_session(system=args.system, params=params)
                _stderr("(new session)")
                continue
            if cmd in ("/help", "/?"):
                _stderr(_CHAT_HELP)
                continue
            try:
                r = session.send(text)
            except ContextLengthError as e:
                _stderr(f"error: {e}; type /reset to start a new conversation", style="red")
                continue
            except KVKeeperError as e:
                _stderr(f"error: {e}", style="red")
                continue
            print(r.text, flush=True)
            _stderr(_stats_line(r))
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
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    convs = load_conversations(args.file, args.limit)
    if not convs:
        raise CLIError(f"{args.file}: no conversations to run" + (" (--limit 0)" if args.limit == 0 else ""))
    out_path = Path(args.json_out) if args.json_out else None
    if out_path is not None and not out_path.resolve().parent.is_dir():
        raise CLIError(f"cannot write --json {out_path}: folder {out_path.resolve().parent} does not exist")
    params = _sampling(args)
    engine = _load_engine(args)

    records: list[dict] = []
    n_turns = sum(len(t) for _, t in convs)
    err = _err_console()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as progress:
        task = progress.add_task("turns", total=n_turns)
        for cid, turns in convs:
            session = engine.new_session(system=args.system, reuse=not args.no_reuse, params=params)
            try:
                for i, text in enumerate(turns, 1):
                    progress.update(task, description=f"{cid} turn {i}")
                    try:
                        r = session.send(text)
                    except ContextLengthError as e:
                        progress.console.print(f"conversation {cid} turn {i}: {e}; skipping the rest of it",
                                               style="yellow", markup=False)
                        records.append({"id": cid, "turn": i, "prompt_tokens": e.prompt_tokens, "cached_tokens": None,
                                        "completion_tokens": None, "ttft_s": None, "decode_tok_per_s": None,
                                        "finish_reason": "error", "text": None, "token_ids": None,
                                        "error": str(e)})
                        progress.advance(task, len(turns) - i + 1)
                        break
                    records.append(_turn_record(cid, r))
                    progress.advance(task)
            finally:
                session.close()

    table = Table(title=f"{engine.model_name}: {len(convs)} conversations, {len(records)} turns"
                        + (" (no KV reuse)" if args.no_reuse else ""))
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
                      str(rec["completion_tokens"]), _fmt_s(rec["ttft_s"]), speed)
    out = _out_console()
    out.print(table)

    ok = [r for r in records if not r["error"]]
    first = [r["ttft_s"] for r in ok if r["turn"] == 1 and r["ttft_s"] is not None]
    later = [r["ttft_s"] for r in ok if r["turn"] > 1 and r["ttft_s"] is not None]
    cached = sum(r["cached_tokens"] for r in ok)
    prompt = sum(r["prompt_tokens"] for r in ok)
    m1, m2 = _mean(first), _mean(later)
    summary = (f"mean TTFT: turn 1 {_fmt_s(m1)} s ({len(first)} turns), later turns {_fmt_s(m2)} s "
               f"({len(later)} turns)")
    if m1 and m2:
        summary += f", {m1 / m2:.1f}x faster" if m2 < m1 else f", {m2 / m1:.1f}x slower"
    summary += f"; cached tokens: {cached} of {prompt} prompt tokens"
    if prompt:
        summary += f" ({100 * cached / prompt:.1f}%)"
    failed = len(records) - len(ok)
    if failed:
        summary += f"; {failed} turn(s) did not fit the context"
    out.print(summary, markup=False)

    if out_path is not None:
        out_path.write_text(json.dumps(records, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
        _stderr(f"wrote {len(records)} turn records to {out_path}")
    return EXIT_OK


# ---- serve -----------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from .api.server import run_server

    exporter = "otlp" if args.otlp_traces_endpoint else args.otel_traces
    if exporter == "otlp":
        try:
            import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        except ImportError:
            _stderr("error: --otel-traces otlp needs the OTLP exporter: pip install 'kvkeeper[otlp]'", None)
            return EXIT_ERROR
    breaker = None
    if not args.no_breaker:
        from .sessions.breaker import BreakerConfig

        try:
            breaker = BreakerConfig(frag_threshold=args.breaker_frag_threshold,
                                    usage_threshold=args.breaker_usage_threshold,
                                    recover_usage=args.breaker_recover_usage,
                                    degrade_budget_tokens=args.degrade_budget_tokens)
        except ValueError as e:
            _stderr(f"error: {e}", None)
            return EXIT_ERROR
    engine = _load_engine(args)
    name = args.served_model_name or args.model
    _stderr(f"serving {name} on http://{args.host}:{args.port}/v1")
    run_server(engine, host=args.host, port=args.port, max_queue=args.max_queue, served_model_name=name,
               max_body_bytes=args.max_body_bytes, log_level="info" if args.verbose else "warning",
               max_new_tokens=args.max_new_tokens, trace_exporter=exporter, otlp_endpoint=args.otlp_traces_endpoint,
               breaker=breaker)
    return EXIT_OK


# ---- eval ------------------------------------------------------------------------


def cmd_eval_perplexity(args: argparse.Namespace) -> int:
    from .eval.perplexity import perplexity, read_text_tokens

    from .kvcache.compression import KVCompression

    comp = KVCompression(args.policy, args.ratio) if args.policy else None
    score = args.score_tokens or (256 if comp is not None else None)
    engine = _load_engine(args)
    ids = read_text_tokens(engine, args.text, args.context + (score or 0), args.skip_tokens)
    r = perplexity(engine, ids, chunk=args.chunk, compression=comp, score_tokens=score)
    r["text"] = str(args.text)
    if args.json:
        print(json.dumps(r))
    else:
        pol = f", {r['policy']} at ratio {r['ratio']}: {r['kv_tokens']} of {args.context} context tokens kept" \
            if r["policy"] else ""
        _out_console().print(f"perplexity {r['ppl']:.4f} over {r['scored_tokens']} predicted tokens "
                             f"(KV {r['kv_dtype']}, {r['kv_bytes_per_token']:,} bytes/token{pol}, {r['seconds']:.1f} s)")
    return EXIT_OK


def cmd_eval_passkey(args: argparse.Namespace) -> int:
    from .eval.passkey import passkey_grid
    from .kvcache.compression import KVCompression

    bad = [d for d in args.depths if not 0.0 <= d <= 1.0]
    if bad:
        _stderr(f"error: depths must be in [0, 1], got {bad[0]}", None)
        return EXIT_ERROR
    comp = KVCompression(args.policy, args.ratio) if args.policy else None
    engine = _load_engine(args)
    too_long = [n for n in args.lengths if n >= engine.context_length]
    if too_long:
        _stderr(f"error: length {too_long[0]} does not fit the context window of {engine.context_length} tokens", None)
        return EXIT_ERROR
    r = passkey_grid(engine, args.lengths, args.depths, trials=args.trials, seed=args.seed, compression=comp)
    if args.json:
        print(json.dumps(r))
    else:
        for c in r["cells"]:
            _out_console().print(f"length {c['length']:>6}  depth {c['depth']:.2f}  {c['solved']}/{c['trials']}")
        _out_console().print(f"accuracy {r['accuracy']:.0%} over {r['trials']} trials ({r['seconds']:.1f} s)")
    return EXIT_OK


# ---- kv ------------------------------------------------------------------------


def cmd_kv_map(args: argparse.Namespace) -> int:
    from .diagnostics.kvmap import demo_block_map, fetch_block_map, show

    if args.interval <= 0:
        raise CLIError(f"--interval must be a positive number of seconds, got {args.interval}")
    if args.demo:
        if args.watch:
            raise CLIError("--watch needs a server (--server URL); --demo draws one snapshot")
        doc = demo_block_map(_load_engine(args))
        get_doc = lambda: doc  # noqa: E731
    else:
        get_doc = lambda: fetch_block_map(args.server)  # noqa: E731
    if args.json:
        print(json.dumps(get_doc()))
        return EXIT_OK
    try:
        show(_out_console(), get_doc, watch=args.watch, interval=args.interval, max_rows=args.rows)
    except KeyboardInterrupt:
        if not args.watch:
            raise
    return EXIT_OK  # Ctrl-C is how --watch ends


# ---- entry point ----------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.reconfigure(errors="replace")  # a reply with odd characters must not crash the CLI
    try:
        return args.func(args)
    except (KVKeeperError, CLIError) as e:
        msg = str(e)
    except FileNotFoundError as e:
        msg = f"no such file: {e.filename}" if e.filename else str(e)
    except OSError as e:
        if isinstance(e, BrokenPipeError):  # e.g. `kvkeeper ... | head`
            with contextlib.suppress(Exception):
                sys.stdout = open(__import__("os").devnull, "w")
            return EXIT_OK
        msg = f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted\n")
        return EXIT_INTERRUPTED
    sys.stderr.write(f"error: {msg}\n")
    sys.stderr.flush()
    return EXIT_ERROR


if __name__ == "__main__":
    # `python -m kvkeeper.cli`: run the importable module's main, so that the CLIError raised by
    # subcommands elsewhere (`from ..cli import CLIError`) is the class main() catches
    from kvkeeper.cli import main as _main

    sys.exit(_main())
