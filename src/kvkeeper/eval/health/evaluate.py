"""Cache-health prediction on generated incidents: precision, recall, lead time, false alarms (issue 29).

    python -m kvkeeper.eval.health.evaluate --seeds 100-119 --json OUT.json [--kinds flood,leak,...]
        [--predictors ewma,trend,lstm] [--traces TRACES.jsonl.gz] [--from-traces TRACES.jsonl.gz]
        [--soak-s 3600 --soak-seeds 200-201] [--proactive [--defer-new-s S]]

One episode per kind and seed (:mod:`kvkeeper.eval.health.scenarios`: a tiny random engine on a simulated
clock, so the figures do not depend on this machine's load), each recorded as a trace; every predictor
(:mod:`kvkeeper.diagnostics.health_predict`) is replayed on the same traces and scored
(:mod:`kvkeeper.eval.health.score`).  OUT's top level holds ``precision``, ``recall``, ``median_lead_s`` and
``false_alarms_per_hour`` of the server's default predictor, and ``predictors``: a table per predictor (with
its per-kind results).  Seeds 0-11 trained and tuned the predictors; evaluate on seeds from 100 that were never
looked at (100-119 had been by 2026-12-06; that day's evaluation used 300-319).  ``--traces`` saves the traces
(gzip JSON lines); ``--from-traces`` scores saved traces
without running an engine (with ``--proactive``, the saved traces are the reactive runs and only the acting runs
are generated).  ``--soak-s S``: one fault-free episode of S simulated seconds per ``--soak-seeds`` seed
(the ``swings`` kind, its false alarms reported apart).  ``--proactive``: every incident episode again with the
breaker acting on the default predictor's forecast (:attr:`CircuitBreaker.forecast`), and the breaches of
both runs side by side; ``--defer-new-s S`` a third run where, besides, admission control holds new conversations'
first turns (at most S seconds, their TTFT counted from when they were asked) while the forecast puts a usage
breach within the breaker's ``act_ahead_s`` (``Episode(defer_new_s=)``).  A markdown table is written beside OUT.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path

from ...diagnostics.health_predict import DEFAULT_PREDICTOR, PREDICTORS, make_predictor
from .scenarios import INCIDENTS, KINDS, ScenarioConfig, run_episode, tiny_model_config
from .score import markdown_table, per_kind_table, score

RESULTS_NAME = "health_eval"  # its reports' folder and name prefix under benchmarks/results/


def parse_seeds(text: str) -> list[int]:
    """'A-B' (inclusive) or 'A,B,C' -> seeds; raises ValueError naming the form."""
    try:
        if "-" in text:
            a, b = text.split("-", 1)
            return list(range(int(a), int(b) + 1))
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--seeds {text!r}: give A-B (inclusive) or a comma-separated list of integers") from None


def read_traces(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_training_traces(ap, path: str, max_seed: int, purpose: str, need_head_wait: bool = False) -> list[dict]:
    """Traces for tuning or training: ``ap.error`` (exit 2) when a seed is above ``max_seed`` (held-out seeds
    never tune or train) or, with need_head_wait, when the traces predate the generator's ``head_wait_s``."""
    traces = read_traces(Path(path))
    bad = sorted({t["seed"] for t in traces if t["seed"] > max_seed})
    if bad:
        ap.error(f"--traces holds seeds {bad} above --max-seed {max_seed}: held-out seeds must not {purpose}")
    if need_head_wait and any("head_wait_s" not in t["samples"][0] for t in traces if t["samples"]):
        ap.error("--traces lack head_wait_s (made before 2026-12-06's generator): generate them again")
    return traces


def write_traces(path: Path, traces: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt") as f:
        for t in traces:
            f.write(json.dumps(t, separators=(",", ":")) + "\n")


def generate(kinds: list[str], seeds: list[int], config: ScenarioConfig, **kw) -> list[dict]:
    model = tiny_model_config()
    out = []
    for seed in seeds:
        for kind in kinds:
            t0 = time.time()
            tr = run_episode(kind, seed, config=config, model_path=model, **kw)
            print(json.dumps({"kind": kind, "seed": seed, "onset_s": tr["onset_s"], "breach_s": tr["breach_s"],
                              "reason": tr["breach_reason"], "wall_s": round(time.time() - t0, 1)}), flush=True)
            out.append(tr)
    return out


def tables(traces: list[dict], names: list[str]) -> dict[str, dict]:
    return {n: score(traces, n) for n in names}


def proactive(kinds: list[str], seeds: list[int], config: ScenarioConfig, reactive: list[dict],
              defer_new_s: float = 0.0) -> dict:
    """The incident episodes again with the breaker acting on the default predictor's forecasts (a fresh predictor
    per episode), and with admission control holding new first turns too when ``defer_new_s`` > 0."""
    inc = [k for k in kinds if k in INCIDENTS]
    acting = generate_fresh(inc, seeds, config)
    out = compare_breaches(reactive, acting)
    if defer_new_s > 0:
        held = generate_fresh(inc, seeds, config, defer_new_s=defer_new_s)
        for k, v in compare_breaches(reactive, held).items():
            out[k].update({"breaches_acting_and_holding": v["breaches_acting"], "prevented_holding": v["prevented"],
                           "caused_holding": v["caused"],
                           "first_turns_held": sum(t["deferred_first_turns"] for t in held if t["kind"] == k)})
        out["defer_new_s"] = defer_new_s
    return out


def generate_fresh(kinds: list[str], seeds: list[int], config: ScenarioConfig, **kw) -> list[dict]:
    """Episodes as :func:`generate`, each with a fresh default predictor for the breaker to act on."""
    model = tiny_model_config()
    out = []
    for seed in seeds:
        for kind in kinds:
            tr = run_episode(kind, seed, config=config, model_path=model,
                             forecaster=make_predictor(DEFAULT_PREDICTOR), **kw)
            print(json.dumps({"kind": kind, "seed": seed, "acting": True, "breach_s": tr["breach_s"], **kw}),
                  flush=True)
            out.append(tr)
    return out


def compare_breaches(reactive: list[dict], acting: list[dict]) -> dict:
    """Per kind: episodes, breaches with the reactive breaker alone, breaches when it acts on the prediction."""
    key = {(t["kind"], t["seed"]): t for t in reactive}
    out: dict[str, dict] = {}
    for t in acting:
        r = key.get((t["kind"], t["seed"]))
        if r is None:
            continue
        k = out.setdefault(t["kind"], {"episodes": 0, "breaches_reactive": 0, "breaches_acting": 0,
                                       "prevented": 0, "caused": 0})
        k["episodes"] += 1
        k["breaches_reactive"] += r["breach_s"] is not None
        k["breaches_acting"] += t["breach_s"] is not None
        k["prevented"] += r["breach_s"] is not None and t["breach_s"] is None
        k["caused"] += r["breach_s"] is None and t["breach_s"] is not None
    return out


def markdown(res: dict) -> str:
    lines = [f"Health prediction, {res['episodes']} episodes ({res['seeds']}), default predictor "
             f"`{res['default_predictor']}`; load average {res['load_average']}.\n",
             markdown_table(res["predictors"])]
    for name, t in res["predictors"].items():
        lines += [f"\nPer kind, `{name}`:\n", per_kind_table(t)]
    if "soak" in res:
        s = res["soak"]
        lines.append(f"\nFault-free soak ({s['simulated_s']:.0f} simulated s per seed, {s['episodes']} seeds): "
                     + ", ".join(f"{n} {v['false_alarms']} false alarms ({v['false_alarms_per_hour']:.2f}/h)"
                                 for n, v in s["predictors"].items()) + ".\n")
    if "proactive" in res:
        p = res["proactive"]
        d = p.get("defer_new_s")
        extra = (f" breaches, acting and holding new first turns <= {d:g} s | prevented | caused | first turns held |"
                 if d else "")
        lines += ["\n| kind | episodes | breaches, reactive breaker | breaches, acting on the forecast | prevented |"
                  " caused |" + extra, "|---|---|---|---|---|---|" + ("---|---|---|---|" if d else "")]
        for k, v in p.items():
            if not isinstance(v, dict):
                continue
            row = (f"| {k} | {v['episodes']} | {v['breaches_reactive']} | {v['breaches_acting']} | "
                   f"{v['prevented']} | {v['caused']} |")
            if d:
                row += (f" {v['breaches_acting_and_holding']} | {v['prevented_holding']} | {v['caused_holding']} | "
                        f"{v['first_turns_held']} |")
            lines.append(row)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="100-102", help="A-B inclusive or a list (default %(default)s)")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--predictors", default=",".join(PREDICTORS))
    ap.add_argument("--json", required=True, help="write the results here (and a .md beside it)")
    ap.add_argument("--traces", help="save the generated traces (gzip JSON lines)")
    ap.add_argument("--from-traces", help="score saved traces instead of generating episodes")
    ap.add_argument("--soak-s", type=float, default=0.0, help="a fault-free soak of S simulated s per soak seed")
    ap.add_argument("--soak-seeds", default="200", help="seeds of the soak (default %(default)s)")
    ap.add_argument("--proactive", action="store_true", help="also run the breaker acting on the forecast")
    ap.add_argument("--defer-new-s", type=float, default=0.0,
                    help="with --proactive: also hold new first turns up to S s ahead of a forecast usage breach")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    t0 = time.time()
    seeds, kinds = parse_seeds(args.seeds), args.kinds.split(",")
    for k in kinds:
        if k not in KINDS:
            ap.error(f"--kinds: unknown kind {k!r}; choose from {', '.join(KINDS)}")
    names = args.predictors.split(",")
    for n in names:
        if n not in PREDICTORS:
            ap.error(f"--predictors: unknown predictor {n!r}; choose from {', '.join(PREDICTORS)}")
    config = ScenarioConfig()
    if args.from_traces:
        traces = read_traces(Path(args.from_traces))
        seeds = sorted({t["seed"] for t in traces})
    else:
        traces = generate(kinds, seeds, config)
        if args.traces:
            write_traces(Path(args.traces), traces)
    tabs = tables(traces, names)
    d = tabs.get(DEFAULT_PREDICTOR) or next(iter(tabs.values()))
    res = {k: d[k] for k in ("precision", "recall", "median_lead_s", "false_alarms_per_hour")}
    res.update(default_predictor=DEFAULT_PREDICTOR, episodes=len(traces),
               seeds=f"{min(seeds)}-{max(seeds)}" if seeds else "", kinds=kinds,
               load_average=" ".join(f"{x:.2f}" for x in os.getloadavg()),
               predictors={n: {k: v for k, v in t.items() if k != "rows"} for n, t in tabs.items()},
               episodes_scored={n: t["rows"] for n, t in tabs.items()})
    if args.soak_s > 0 and not args.from_traces:
        soak_cfg = ScenarioConfig(duration_s=args.soak_s)
        soak = generate(["swings"], parse_seeds(args.soak_seeds), soak_cfg)
        st = tables(soak, names)
        res["soak"] = {"simulated_s": args.soak_s, "episodes": len(soak), "breaches": sum(
            t["breach_s"] is not None for t in soak), "predictors": {n: {"false_alarms": t["false_alarms"],
                                                                         "false_alarms_per_hour": t[
                                                                             "false_alarms_per_hour"]}
                                                                     for n, t in st.items()}}
    if args.proactive:  # the reactive runs: the episodes just generated, or the saved traces
        res["proactive"] = proactive(sorted({t["kind"] for t in traces}, key=KINDS.index) if args.from_traces
                                     else kinds, seeds, config, traces, args.defer_new_s)
    res["elapsed_s"] = round(time.time() - t0, 1)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str))
    out.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
