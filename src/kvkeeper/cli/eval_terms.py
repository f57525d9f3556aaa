"""``kvkeeper eval terms score | generate``: terminology accuracy and consistency of document translation.

``score`` scores given translations; ``generate`` translates the documents of a terms file (one session a
document, one segment a turn, greedy) through the local engine or ``--server URL``, under glossary
conditions, and scores them.  Metrics: :mod:`kvkeeper.eval.terms`; turns: :mod:`kvkeeper.eval.term_translate`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..argtypes import positive_int
from .common import EXIT_OK, CLIError, command, load_engine, out_console, stderr, tool_group

DEFAULT_TERMS = Path(__file__).resolve().parents[3] / "data" / "wmt21_terminology_enfr" / "dev.en-fr.terms.jsonl"
ROWS = (("term_accuracy", "term acc", 1), ("window_overlap_2", "WO-2", 1), ("window_overlap_3", "WO-3", 1),
        ("one_minus_term", "1-TERm", 1), ("bleu", "BLEU", 0.01), ("chrf", "chrF", 0.01),
        ("consistency", "consistency", 1))


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenize", choices=["moses", "none"], default="moses",
                   help="tokenize hypotheses with the Moses tokenizer before matching (default), or take them "
                        "as whitespace-tokenized (the task's references are Moses-tokenized)")
    p.add_argument("--lang", default="fr", metavar="CODE", help="target language of the tokenizer and lemmatizer "
                                                                "(default: fr)")
    p.add_argument("--no-lemmas", action="store_true", help="no lemma fallback in term accuracy")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def add_parser(esub, parent: argparse.ArgumentParser) -> None:
    tsub = tool_group(esub, "terms_command", "MODE", "terms", help="terminology accuracy and consistency of document translation",
                        description="Score translations with the WMT21 terminology metrics and a consistency "
                                    "score, or translate documents as sessions and score them.")
    sc = command(tsub, cmd_terms_score, "score", help="score a hypothesis file against references and a terms file",
                         description="Score one hypothesis line per segment (matched by order with --ref and "
                                     "--terms; documents from the terms file's doc_id).")
    sc.add_argument("--hyp", required=True, metavar="FILE", help="translations, one segment a line")
    sc.add_argument("--ref", required=True, metavar="FILE", help="references, one segment a line (Moses-tokenized)")
    sc.add_argument("--terms", required=True, metavar="FILE.jsonl", help="one terms record per segment")
    _common(sc)
    sc.add_argument("-v", "--verbose", action="store_true", help="log to stderr (INFO)")
    g = command(tsub, cmd_terms_generate, "generate", parents=[parent], help="translate documents as sessions, then score",
                        description="Translate each document of --terms as one session (a segment a turn, greedy) "
                                    "under each --conditions, through the local engine or --server, and score.")
    g.add_argument("--terms", default=str(DEFAULT_TERMS), metavar="FILE.jsonl",
                   help="documents and terms (default: the WMT21 EN-FR dev set shipped in data/)")
    g.add_argument("--conditions", nargs="+", choices=["none", "glossary", "random"], default=["none", "glossary"],
                   help="glossary conditions: none, glossary (the document's terms in the system message), "
                        "random (wrong forms of the same shape) (default: none glossary)")
    g.add_argument("--docs", nargs="+", metavar="DOC_ID", help="only these documents")
    g.add_argument("--max-docs", type=positive_int, metavar="N", help="the first N documents")
    g.add_argument("--max-segments", type=positive_int, metavar="N", help="the first N segments of each document")
    g.add_argument("--max-tokens", type=positive_int, default=96, metavar="N", help="tokens per reply (default: 96)")
    g.add_argument("--no-reuse", action="store_true", help="recompute every turn's whole prompt (no KV reuse)")
    g.add_argument("--policy", choices=["streaming_llm", "h2o", "snapkv", "knorm"],
                   help="compress each turn's prompt KV with this policy after prefill")
    g.add_argument("--ratio", type=float, default=0.5, metavar="R", help="fraction the policy drops (default: 0.5)")
    g.add_argument("--server", metavar="URL", help="an OpenAI-compatible server instead of the local engine")
    g.add_argument("--server-model", metavar="NAME", help="model name on --server (default: its first model)")
    g.add_argument("--seed", type=int, default=0, help="seed of the random-terms control (default: 0)")
    g.add_argument("--out", metavar="DIR", help="write hyp.<condition>.txt, turns.<condition>.jsonl and scores.json")
    _common(g)


def _read_lines(path: str) -> list[str]:
    return Path(path).read_text(encoding="utf-8").splitlines()


def _print_table(results: dict[str, dict], caches: dict[str, dict] | None = None) -> None:
    from rich.table import Table

    tab = Table(show_edge=False)
    tab.add_column("")
    for _, head, _ in ROWS:
        tab.add_column(head, justify="right")
    if caches:
        tab.add_column("cached / prompt tok", justify="right")
    for name, r in results.items():
        o = r["overall"]
        cells = ["n/a" if o[k] is None else f"{o[k] * 100 * f:.2f}" if f != 1 else f"{o[k]:.3f}" for k, _, f in ROWS]
        if caches:
            c = caches[name]
            cells.append(f"{c['cached_tokens'] if c['cached_tokens'] is not None else 'n/a'} / {c['prompt_tokens']}")
        tab.add_row(name, *cells)
    out_console().print(tab)


def cmd_terms_score(args: argparse.Namespace) -> int:
    from ..eval import terms as T

    segs = T.with_references(T.load_segments(args.terms), _read_lines(args.ref))
    r = T.score(segs, _read_lines(args.hyp), tokenize=args.tokenize, lang=args.lang, lemmas=not args.no_lemmas)
    if args.json:
        print(json.dumps(r))
    else:
        _print_table({"overall": r} | {d: {"overall": v} for d, v in r["documents"].items()})
    return EXIT_OK


def _translator(args: argparse.Namespace):
    from ..eval.term_translate import LocalTranslator, ServerTranslator
    from ..kvcache.compression import KVCompression

    comp = KVCompression(args.policy, args.ratio) if args.policy else None
    if args.server:
        return ServerTranslator(args.server, args.server_model, args.max_tokens, not args.no_reuse, comp)
    return LocalTranslator(load_engine(args), args.max_tokens, not args.no_reuse, comp)


def cmd_terms_generate(args: argparse.Namespace) -> int:
    from ..eval import term_translate as TT
    from ..eval import terms as T

    segs = T.load_segments(args.terms)
    docs = TT.documents(segs, args.docs, args.max_docs, args.max_segments)
    chosen = [s for d in docs.values() for s in d]
    if not chosen:
        raise CLIError(f"no segments to translate in {args.terms}")
    translator = _translator(args)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    results, caches = {}, {}
    for cond in args.conditions:
        run = TT.translate_condition(translator, docs, cond, segs, args.seed,
                                     progress=lambda d, recs, c=cond: stderr(f"[{c}] {d}: {len(recs)} segments"))
        results[cond] = T.score(chosen, run["hyps"], args.tokenize, args.lang, not args.no_lemmas)
        caches[cond] = results[cond]["cache"] = TT.cache_summary(run["turns"])
        if out is not None:
            (out / f"hyp.{cond}.txt").write_text("".join(h + "\n" for h in run["hyps"]), encoding="utf-8")
            (out / f"turns.{cond}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in run["turns"]))
    summary = {"settings": _settings(args, translator, docs), "conditions": results}
    if out is not None:
        (out / "scores.json").write_text(json.dumps(summary, indent=1))
    if args.json:
        print(json.dumps(summary))
    else:
        _print_table(results, caches)
    return EXIT_OK


def _settings(args: argparse.Namespace, translator, docs: dict) -> dict:
    eng = getattr(translator, "engine", None)
    return {"server": args.server, "model": getattr(translator, "model", None) or (eng.model_name if eng else None),
            "kv_dtype": eng.kv.store.format.name if eng else None, "reuse": not args.no_reuse,
            "policy": args.policy, "ratio": args.ratio if args.policy else None, "max_tokens": args.max_tokens,
            "documents": {d: len(s) for d, s in docs.items()}, "tokenize": args.tokenize}
