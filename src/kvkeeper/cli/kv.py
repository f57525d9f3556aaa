"""``kvkeeper kv map | dump | diff | audit``: the KV cache inspection subcommands.

* ``kv map``   the block pool of a running server (``--server``) or of a local engine (``--demo``),
               drawn in the terminal (see ``kvkeeper.diagnostics.kvmap``).

* ``kv dump``  a prompt's K/V (computed here with the embedded model) or a running server's
               session (``--server URL --session ID``) to a safetensors file (see ``kvdump``).
* ``kv diff``  per-layer max/mean |difference| of two dumps and the first divergent layer and token;
               exit status 0 when nothing diverges above ``--atol``, 1 when something does, 2 on error.
* ``kv audit`` run prompts or conversations with every request audited (reuse vs recompute);
               exit status 0 when no request diverged, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..argtypes import non_negative_float as _non_negative_float
from ..argtypes import positive_int as _positive_int
from .common import EXIT_OK, CLIError, command, load_engine, out_console, stderr, tool_group
from ..engine.handle import EngineHandle

EXIT_DIVERGED = 1


def add_parser(sub, parent: argparse.ArgumentParser) -> None:
    """Add ``kv`` and its tools (map, dump, diff, audit) to the subcommands ``sub``; parent: the engine options."""
    kvsub = tool_group(sub, "kv_command", "TOOL", "kv", help="inspect the KV cache: block map, dump, diff, audit",
                         description="Inspect the KV cache of a server or of a local engine: the block map, "
                                     "layer-wise dumps and diffs, the reuse audit.")
    km = command(kvsub, cmd_kv_map, "map", parents=[parent], help="draw the KV block pool in the terminal",
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
    d = command(kvsub, cmd_kv_dump, "dump", parents=[parent], help="write a prompt's or a session's K/V to a safetensors file",
                        description="Dump K and V (layers x token positions) to a safetensors file with metadata. "
                                    "Either compute a prompt here (--prompt / --messages) or fetch a session's KV "
                                    "from a running server (--server URL --session ID).")
    src = d.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="raw prompt text")
    src.add_argument("--messages", metavar="FILE.json",
                     help="a conversation: a JSON list of {role, content} messages (or {\"messages\": [...]}), "
                          "rendered with the chat template")
    src.add_argument("--session", metavar="ID", help="a session of the server given by --server")
    d.add_argument("--server", metavar="URL", help="base URL of a running `kvkeeper serve` (with --session)")
    d.add_argument("--layers", metavar="LIST", help="layers such as 0,5,29 or 0-3 (default: all)")
    d.add_argument("--start", type=int, metavar="N", help="first token position (default: 0)")
    d.add_argument("--end", type=int, metavar="M", help="end token position, exclusive (default: all)")
    d.add_argument("--warm-prefix", type=int, default=0, metavar="N",
                   help="prefill the prompt's first N tokens first, so that the dump reuses them from the prefix "
                        "cache (default: 0, the prompt is computed whole)")
    d.add_argument("-o", "--output", required=True, metavar="OUT.safetensors", help="output file")

    f = command(kvsub, cmd_kv_diff, "diff", help="compare two KV dumps layer by layer",
                        description="Per-layer max and mean |A - B| of K and V, and the first divergent layer and "
                                    "token.  Exit status 0: no divergence above --atol; 1: divergence; 2: error.")
    f.add_argument("a", metavar="A.safetensors")
    f.add_argument("b", metavar="B.safetensors")
    f.add_argument("--atol", type=_non_negative_float, default=0.0, metavar="X",
                   help="a token diverges when some |A - B| exceeds X (default: 0)")
    f.add_argument("--json", action="store_true", help="print one JSON object")
    f.set_defaults(verbose=False)

    a = command(kvsub, cmd_kv_audit, "audit", parents=[parent], help="run prompts with every request audited (reuse vs recompute)",
                        description="Run a prompt, a conversation or conversations from a JSONL file (one session "
                                    "per line, as `converse`) with the reuse audit on every request.  Exit status "
                                    "0: no divergence; 1: some request diverged.")
    a.add_argument("--limit", type=_positive_int, metavar="K", help="only the first K conversations")
    a.add_argument("--max-tokens", type=int, default=16, metavar="N", help="tokens per reply (default: 16)")
    a.add_argument("--json", action="store_true", help="print one JSON object per audited request")
    src = a.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="raw prompt text")
    src.add_argument("--messages", metavar="FILE.json", help="a conversation (JSON list of {role, content})")
    src.add_argument("--conversations", metavar="FILE.jsonl", help="user turns per line (MT-Bench / Topical-Chat)")


# ---- helpers ---------------------------------------------------------------------


def _read_messages(path: str) -> list[dict]:
    p = Path(path)
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CLIError(f"{p}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if isinstance(obj, dict):
        obj = obj.get("messages")
    if not isinstance(obj, list) or not obj or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                        for m in obj):
        raise CLIError(f"{p}: expected a JSON list of messages such as "
                       '[{"role": "user", "content": "Hi"}] (or {"messages": [...]})')
    return obj


def _read_input(args):
    """The messages of --messages, or the --prompt text; read and checked before the model loads."""
    if args.messages is not None:
        return _read_messages(args.messages)
    if not args.prompt or not args.prompt.strip():
        raise CLIError("the prompt is empty: give some text with --prompt TEXT")
    return args.prompt


def _prompt_ids(engine: EngineHandle, given) -> list[int]:
    return engine.encode_chat(given) if isinstance(given, list) else engine.tokenizer.encode(given)


# ---- dump ------------------------------------------------------------------------


def _fetch_session_dump(args) -> bytes:
    """GET /admin/kv/dump from the server (urllib: no client dependency)."""
    import urllib.error
    import urllib.parse
    import urllib.request

    params = {"session": args.session}
    for k in ("layers", "start", "end"):
        if getattr(args, k) is not None:
            params[k] = str(getattr(args, k))
    url = args.server.rstrip("/") + "/admin/kv/dump"
    if not url.startswith(("http://", "https://")):
        raise CLIError(f"--server must be an http:// or https:// URL, got {args.server!r}")
    try:
        with urllib.request.urlopen(url + "?" + urllib.parse.urlencode(params), timeout=120) as r:
            return r.read()
    except urllib.error.HTTPError as e:
        try:
            msg = json.loads(e.read())["error"]["message"]
        except Exception:
            msg = e.reason
        raise CLIError(f"{url} answered {e.code}: {msg}") from None
    except (urllib.error.URLError, OSError) as e:
        raise CLIError(f"cannot reach {url}: {getattr(e, 'reason', e)}") from None


def cmd_kv_dump(args: argparse.Namespace) -> int:
    from ..diagnostics.kvdump import dump_prompt, parse_layers, to_bytes

    parse_layers(args.layers, None)  # the list's syntax, before anything slow (the range is checked later)
    out = Path(args.output)
    if not out.resolve().parent.is_dir():
        raise CLIError(f"cannot write {out}: folder {out.resolve().parent} does not exist")
    if out.is_dir():
        raise CLIError(f"cannot write {out}: it is a folder; give a file name such as {out / 'kv.safetensors'}")
    if args.session is not None:
        if not args.server:
            raise CLIError("--session needs --server URL (the running server that holds the session)")
        data = _fetch_session_dump(args)
    else:
        if args.server:
            raise CLIError("--server goes with --session; --prompt/--messages are computed locally")
        given = _read_input(args)
        engine = load_engine(args)
        ids = _prompt_ids(engine, given)
        tensors, meta = dump_prompt(engine, ids, args.layers, args.start, args.end, warm_prefix=args.warm_prefix)
        data = to_bytes(tensors, meta)
    out.write_bytes(data)
    from ..diagnostics.kvdiff import load_dump

    _, meta = load_dump(out)
    stderr(f"wrote {out}: layers {meta['layers']}, positions {meta['token_start']}..{int(meta['token_end']) - 1}, "
            f"{meta['tensor_dtype']} (KV {meta['kv_dtype']}, {meta['cached_tokens']} tokens reused), "
            f"{len(data):,} bytes")
    return EXIT_OK


def cmd_kv_diff(args: argparse.Namespace) -> int:
    from ..diagnostics.kvdiff import diff_files, format_report, to_json

    r = diff_files(args.a, args.b, args.atol)
    print(to_json(r) if args.json else format_report(r))
    return EXIT_OK if r["first_divergent"] is None else EXIT_DIVERGED


# ---- audit -----------------------------------------------------------------------


def new_auditor(engine: EngineHandle):
    """A reuse auditor on every request of ``engine`` from now on."""
    from ..diagnostics.audit import ReuseAuditor

    return ReuseAuditor(1.0).attach(engine)


def cmd_kv_audit(args: argparse.Namespace) -> int:
    from ..sampling.params import SamplingParams
    from ..sessions.manager import SessionManager
    from .chat import load_conversations

    if args.max_tokens < 1:
        raise CLIError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    convs = load_conversations(args.conversations, args.limit) if args.conversations else None
    given = None if convs is not None else _read_input(args)
    engine = load_engine(args)
    au = new_auditor(engine)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    if convs is not None:
        sessions = SessionManager(engine)
        for _, turns in convs:
            s = sessions.open(params=params)
            try:
                for t in turns:
                    s.send(t)
            finally:
                s.close()
    else:
        engine.generate([_prompt_ids(engine, given)], params)
    for r in au.reports:
        print(json.dumps(r.to_dict()) if args.json else r.summary())
    stderr(f"audited {au.total} requests: {au.mismatches} diverged, {au.skipped} skipped"
            + ("" if au.total <= len(au.reports) else f" (the last {len(au.reports)} are listed)"))
    return EXIT_OK if au.mismatches == 0 else EXIT_DIVERGED


def cmd_kv_map(args: argparse.Namespace) -> int:
    from ..diagnostics.kvmap import demo_block_map, fetch_block_map, show

    if args.interval <= 0:
        raise CLIError(f"--interval must be a positive number of seconds, got {args.interval}")
    if args.demo:
        if args.watch:
            raise CLIError("--watch needs a server (--server URL); --demo draws one snapshot")
        doc = demo_block_map(load_engine(args))
        get_doc = lambda: doc  # noqa: E731
    else:
        get_doc = lambda: fetch_block_map(args.server)  # noqa: E731
    if args.json:
        print(json.dumps(get_doc()))
        return EXIT_OK
    try:
        show(out_console(), get_doc, watch=args.watch, interval=args.interval, max_rows=args.rows)
    except KeyboardInterrupt:
        if not args.watch:
            raise
    return EXIT_OK  # Ctrl-C is how --watch ends
