"""``kvkeeper eval perplexity | passkey | terms | intervene | memory | memory-data``: quality through kvkeeper's own
KV cache (quantized, compressed or rewritten by a cache "hotfix"), and recall of early facts under a context policy.

The terminology evaluation (``eval terms``) has its own module, :mod:`.eval_terms`.
"""

from __future__ import annotations

import argparse
import json

from ..argtypes import non_negative_int, positive_int
from . import eval_terms
from .common import EXIT_ERROR, EXIT_OK, command, load_engine, out_console, stderr, tool_group


def add_parser(sub, parent: argparse.ArgumentParser) -> None:
    esub = tool_group(sub, "eval_command", "TASK", "eval", help="quality under KV quantization: perplexity, passkey retrieval, terminology",
                       description="Evaluate the model through kvkeeper's own KV cache.")
    pp = command(esub, cmd_eval_perplexity, "perplexity", parents=[parent], help="perplexity of the first N tokens of a UTF-8 text",
                         description="Run the first --context tokens of --text as one sequence (prefilled in chunks "
                                     "through the paged KV cache) and report its perplexity.")
    pp.add_argument("--text", required=True, metavar="FILE", help="a UTF-8 text file")
    pp.add_argument("--context", type=positive_int, required=True, metavar="N", help="tokens to score")
    pp.add_argument("--skip-tokens", type=non_negative_int, default=0, metavar="N",
                    help="start N tokens into the text (e.g. past a title page)")
    pp.add_argument("--chunk", type=positive_int, default=512, metavar="N", help="prefill chunk in tokens (default: 512)")
    pp.add_argument("--policy", choices=["streaming_llm", "h2o", "snapkv", "knorm"],
                    help="compress the context's KV with this policy, then score --score-tokens more tokens")
    pp.add_argument("--ratio", type=float, default=0.5, metavar="R",
                    help="fraction of the context's tokens the policy drops, in [0, 1) (default: 0.5)")
    pp.add_argument("--score-tokens", type=positive_int, metavar="M",
                    help="score only the M tokens after the --context tokens (continuation perplexity; "
                         "default 256 with --policy, else every position of the context is scored)")
    pp.add_argument("--json", action="store_true", help="print one JSON object: ppl, tokens, kv_bytes_per_token, ...")
    pk = command(esub, cmd_eval_passkey, "passkey", parents=[parent], help="passkey retrieval accuracy over lengths and depths",
                         description="Hide a five-digit pass key at each depth of a filler text of each length and "
                                     "ask for it (greedy); report the accuracy per cell and overall.")
    pk.add_argument("--lengths", type=positive_int, nargs="+", default=[1024, 2048, 4096], metavar="N",
                    help="prompt lengths in tokens (default: 1024 2048 4096)")
    pk.add_argument("--depths", type=float, nargs="+", default=[0.0, 0.5, 1.0], metavar="D",
                    help="needle depths in [0, 1] (default: 0 0.5 1)")
    pk.add_argument("--trials", type=positive_int, default=2, metavar="K", help="keys per cell (default: 2)")
    pk.add_argument("--policy", choices=["streaming_llm", "h2o", "snapkv", "knorm"],
                    help="compress each prompt's KV with this policy after prefill")
    pk.add_argument("--ratio", type=float, default=0.5, metavar="R", help="fraction dropped (default: 0.5)")
    pk.add_argument("--seed", type=int, default=0, help="seed of the pass keys (default: 0)")
    pk.add_argument("--json", action="store_true", help="print one JSON object with the cells and the accuracy")
    eval_terms.add_parser(esub, parent)
    _add_intervene_parser(esub, parent)
    _add_memory_parsers(esub, parent)


def _add_intervene_parser(esub, parent: argparse.ArgumentParser) -> None:
    from ..eval.intervention import INTERVENTION_POLICIES

    iv = command(esub, cmd_eval_intervene, "intervene", parents=[parent],
                 help="the published cache hotfixes (layer reset, gated refresh, LayerNorm-aware reset) measured",
                 description="Apply each KV-surgery policy at sentence boundaries (kvkeeper.kvcache.intervention) "
                             "and measure it against no intervention: the perplexity of a long text prefilled "
                             "sentence by sentence, and the WMT21 terminology translation as sessions (glossary "
                             "condition, a policy applied at the end of each turn): term accuracy, consistency, "
                             "turns identical to the baseline, and the policy's time.  Runs without the hybrid "
                             "(sliding-window) KV cache.")
    iv.add_argument("--policies", nargs="+", choices=INTERVENTION_POLICIES, default=list(INTERVENTION_POLICIES),
                    help="policies to measure (default: all); the baseline (no intervention) always runs")
    iv.add_argument("--layers", type=non_negative_int, nargs="+", default=[3], metavar="L",
                    help="decoder layers (0-based) each policy rewrites (default: 3, the 'layer 3 hotfix')")
    iv.add_argument("--gate", type=float, default=0.5, metavar="G",
                    help="gated_refresh: weight of the old KV in [0, 1] (default: 0.5)")
    iv.add_argument("--text", metavar="FILE", help="a UTF-8 text for the perplexity measurement (default: the "
                                                  "shipped Pride and Prejudice)")
    iv.add_argument("--context", type=positive_int, default=2048, metavar="N", help="tokens of the text (default: 2048)")
    iv.add_argument("--skip-tokens", type=non_negative_int, default=2000, metavar="N",
                    help="start N tokens into the text (default: 2000, past the Gutenberg header)")
    iv.add_argument("--terms", metavar="FILE.jsonl", help="documents and terms (default: the shipped WMT21 EN-FR dev set)")
    iv.add_argument("--docs", nargs="+", metavar="DOC_ID", help="only these documents")
    iv.add_argument("--max-docs", type=positive_int, metavar="N", help="the first N documents")
    iv.add_argument("--max-segments", type=positive_int, default=10, metavar="N",
                    help="the first N segments of each document (default: 10)")
    iv.add_argument("--max-tokens", type=positive_int, default=64, metavar="N", help="tokens per reply (default: 64)")
    iv.add_argument("--skip-perplexity", action="store_true", help="only the terminology measurement")
    iv.add_argument("--skip-terms", action="store_true", help="only the perplexity measurement")
    iv.add_argument("--out", metavar="FILE.json", help="write the result object (settings, rows, translations)")
    iv.add_argument("--json", action="store_true", help="print one JSON object (without the translations)")


def _add_memory_parsers(esub, parent: argparse.ArgumentParser) -> None:
    from ..sessions.context import CONTEXT_POLICIES

    m = command(esub, cmd_eval_memory, "memory", parents=[parent], help="recall of early facts under a context policy",
                        description="Replay conversations (FILE.jsonl: id, system, messages, questions) one session "
                                    "each under --context-policy and --budget, ask each question and report how often "
                                    "the answer and its evidence were in the prompt and in the reply.")
    m.add_argument("file", metavar="FILE.jsonl", help="conversations with questions (see `eval memory-data`)")
    m.add_argument("--json", metavar="OUT", help="write the result object (figures, per_question, per_turn) to OUT")
    m.add_argument("--context-policy", choices=CONTEXT_POLICIES, required=True, help="the sessions' context policy")
    m.add_argument("--budget", type=positive_int, required=True, metavar="N", help="prompt tokens (context budget)")
    m.add_argument("--context-every", type=positive_int, default=4, metavar="K",
                   help="turns leave the prompt at least K at a time (default: 4)")
    m.add_argument("--server", metavar="URL", help="ask a running kvkeeper server instead of an in-process engine")
    m.add_argument("--max-tokens", type=positive_int, default=16, metavar="N", help="tokens per answer (default: 16)")
    m.add_argument("--limit", type=positive_int, metavar="N", help="only the first N conversations")
    m.add_argument("--replay", choices=("turns", "questions"), default="turns",
                   help="send every user message of the history in order, as a live client would (turns, the "
                        "default), or only the questions (faster; its cached share says nothing of a live session)")
    g = command(esub, cmd_eval_memory_data, "memory-data", parents=[parent], help="generate conversations with planted facts",
                        description="Join Topical-Chat dialogues into long conversations, plant facts (a name, a "
                                    "number, a date, a place) early and ask about them later; seeded.")
    g.add_argument("out", metavar="OUT.jsonl")
    g.add_argument("--source", default="data/topical_chat/test_freq_conversations.jsonl", metavar="FILE",
                   help="Topical-Chat conversations, one JSON object a line (default: %(default)s)")
    g.add_argument("--conversations", type=positive_int, default=20, metavar="N", help="how many (default: 20)")
    g.add_argument("--min-tokens", type=positive_int, default=6000, metavar="N",
                   help="tokens per conversation at least (default: 6000)")
    g.add_argument("--facts", type=positive_int, default=3, metavar="N", help="planted facts each (default: 3)")
    g.add_argument("--seed", type=int, default=0, help="seed (default: 0)")
    g.add_argument("--harder", action="store_true",
                   help="the harder set: facts said in passing at the end of longer real messages (one in an "
                        "assistant message), paraphrased questions, a corrected fact, a distractor, several depths")


def cmd_eval_perplexity(args: argparse.Namespace) -> int:
    from ..eval.perplexity import perplexity, read_text_tokens
    from ..kvcache.compression import KVCompression

    comp = KVCompression(args.policy, args.ratio) if args.policy else None
    score = args.score_tokens or (256 if comp is not None else None)
    engine = load_engine(args)
    ids = read_text_tokens(engine, args.text, args.context + (score or 0), args.skip_tokens)
    r = perplexity(engine, ids, chunk=args.chunk, compression=comp, score_tokens=score)
    r["text"] = str(args.text)
    if args.json:
        print(json.dumps(r))
    else:
        pol = f", {r['policy']} at ratio {r['ratio']}: {r['kv_tokens']} of {args.context} context tokens kept" \
            if r["policy"] else ""
        out_console().print(f"perplexity {r['ppl']:.4f} over {r['scored_tokens']} predicted tokens "
                             f"(KV {r['kv_dtype']}, {r['kv_bytes_per_token']:,} bytes/token{pol}, {r['seconds']:.1f} s)")
    return EXIT_OK


def cmd_eval_passkey(args: argparse.Namespace) -> int:
    from ..eval.passkey import passkey_grid
    from ..kvcache.compression import KVCompression

    bad = [d for d in args.depths if not 0.0 <= d <= 1.0]
    if bad:
        stderr(f"error: depths must be in [0, 1], got {bad[0]}", None)
        return EXIT_ERROR
    comp = KVCompression(args.policy, args.ratio) if args.policy else None
    engine = load_engine(args)
    too_long = [n for n in args.lengths if n >= engine.context_length]
    if too_long:
        stderr(f"error: length {too_long[0]} does not fit the context window of {engine.context_length} tokens", None)
        return EXIT_ERROR
    r = passkey_grid(engine, args.lengths, args.depths, trials=args.trials, seed=args.seed, compression=comp)
    if args.json:
        print(json.dumps(r))
    else:
        for c in r["cells"]:
            out_console().print(f"length {c['length']:>6}  depth {c['depth']:.2f}  {c['solved']}/{c['trials']}")
        out_console().print(f"accuracy {r['accuracy']:.0%} over {r['trials']} trials ({r['seconds']:.1f} s)")
    return EXIT_OK



def cmd_eval_memory_data(args: argparse.Namespace) -> int:
    from ..eval.memory_recall import generate, load_dialogues
    from ..weights.sources import resolve_model_path
    from ..text.tokenizer import load_tokenizer

    try:
        dialogues = load_dialogues(args.source)
    except (OSError, ValueError, KeyError) as e:
        stderr(f"error: cannot read the Topical-Chat file {args.source}: {e}", None)
        return EXIT_ERROR
    tok = load_tokenizer(resolve_model_path(args.model))
    try:
        convs = generate(dialogues, args.conversations, args.min_tokens,
                         lambda t: len(tok.encode(t, add_special_tokens=False)), args.seed, args.facts,
                         harder=args.harder)
    except ValueError as e:
        stderr(f"error: {e}", None)
        return EXIT_ERROR
    with open(args.out, "w") as f:
        for c in convs:
            f.write(json.dumps(c) + "\n")
    stderr(f"wrote {len(convs)} conversations ({sum(len(c['questions']) for c in convs)} questions) to {args.out}")
    return EXIT_OK


def cmd_eval_memory(args: argparse.Namespace) -> int:
    from ..eval.memory_recall import LibraryBackend, ServerBackend, run

    try:
        convs = [json.loads(line) for line in open(args.file) if line.strip()][: args.limit]
    except (OSError, ValueError) as e:
        stderr(f"error: cannot read {args.file}: {e}", None)
        return EXIT_ERROR
    if args.server:
        backend = ServerBackend(args.server, args.context_policy, args.budget, args.max_tokens)
    else:
        backend = LibraryBackend(load_engine(args), args.context_policy, args.budget, args.max_tokens,
                                 context_every=args.context_every)
    r = run(convs, backend, args.context_policy, args.budget, replay=args.replay)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f)
    out_console().print(
        f"{r['policy']} at {r['budget']} tokens, {r['questions']} questions: answer in prompt "
        f"{r['answer_in_prompt']:.0%}, evidence in prompt {r['evidence_in_prompt']:.0%}, answer in reply "
        f"{r['answer_in_reply']:.0%}, {r['mean_prompt_tokens']:.0f} prompt tokens, {r['cached_share']:.0%} of the "
        f"tokens of {r['turns'] + r['questions']} prompts cached, "
        f"memory {r['memory_ms_per_turn']:.1f} ms/turn ({r['seconds']:.0f} s)")
    return EXIT_OK


def cmd_eval_intervene(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..eval import intervene as IV
    from ..eval import term_translate as TT
    from ..eval import terms as T
    from ..eval.perplexity import read_text_tokens
    from ..eval.intervention import KVIntervention
    from .eval_terms import DEFAULT_TERMS

    if args.skip_perplexity and args.skip_terms:
        stderr("error: --skip-perplexity and --skip-terms leave nothing to measure; drop one", None)
        return EXIT_ERROR
    policies = [None] + [KVIntervention(p, tuple(args.layers), args.gate) for p in args.policies]
    args.hybrid_kv_cache = False  # interventions address every layer by block id
    text = args.text or str(Path(__file__).resolve().parents[3] / "data" / "gutenberg_pride_and_prejudice" /
                            "1342-0.txt")
    engine = load_engine(args)
    bad = [x for x in args.layers if x >= engine.model_config.num_layers]
    if bad:
        stderr(f"error: layer {bad[0]} does not exist: {engine.model_name} has layers 0..."
               f"{engine.model_config.num_layers - 1}", None)
        return EXIT_ERROR
    rows = {("none" if p is None else p.name): {} for p in policies}
    res: dict = {"settings": {"model": engine.model_name, "weights": engine.numerics["weight_format"],
                              "kv_dtype": engine.kv.store.format.name, "layers": args.layers, "gate": args.gate},
                 "rows": rows}
    if not args.skip_perplexity:
        ids = read_text_tokens(engine, text, args.context, args.skip_tokens)
        res["settings"].update(text=text, context=args.context, skip_tokens=args.skip_tokens)
        base = None
        for p in policies:
            r = IV.document_perplexity(engine, ids, p, chunk=engine.scheduler.max_num_batched_tokens)
            base = base or r
            r["ppl_change"] = r["ppl"] - base["ppl"]
            rows["none" if p is None else p.name]["perplexity"] = r
            stderr(f"perplexity {'none' if p is None else p.name}: {r['ppl']:.4f} ({r['seconds']:.1f} s)")
    if not args.skip_terms:
        terms = args.terms or str(DEFAULT_TERMS)
        segs = T.load_segments(terms)
        docs = TT.documents(segs, args.docs, args.max_docs, args.max_segments)
        res["settings"].update(terms=terms, documents={d: len(s) for d, s in docs.items()},
                               max_tokens=args.max_tokens)
        runs = IV.terms_runs(engine, docs, segs, policies, args.max_tokens,
                             progress=lambda n, d, r: stderr(f"[{n}] {d}: {len(r)} segments"))
        for name, r in runs.items():
            rows[name]["terms"] = r
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    if args.json:
        slim = {**res, "rows": {n: {k: ({a: b for a, b in v.items() if a not in ("hyps", "turns")} if k == "terms"
                                        else v) for k, v in r.items()} for n, r in rows.items()}}
        print(json.dumps(slim))
    else:
        for name, r in rows.items():
            parts = [name]
            if "perplexity" in r:
                q = r["perplexity"]
                parts.append(f"ppl {q['ppl']:.4f} ({q['ppl_change']:+.4f}), {q['interventions']} resets "
                             f"{q['intervention_ms']:.0f} ms")
            if "terms" in r:
                t = r["terms"]
                sc, same = t["scores"], t["identical_turns"]
                cons = "n/a" if sc["consistency"] is None else f"{sc['consistency'] * 100:.1f}%"
                parts.append(f"term acc {sc['term_accuracy'] * 100:.1f}%, consistency {cons}, {same[0]}/{same[1]} "
                             f"turns as baseline, {t['intervention_ms']:.0f} ms of {t['seconds']:.1f} s")
            out_console().print("  ".join(parts))
    return EXIT_OK
