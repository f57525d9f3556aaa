"""Cache-health detector under injected faults and induced overloads: precision, recall, lead time.

    python benchmarks/health_eval.py [--repeats 2] [--blocks 256] [--audit-fraction 1.0] [--soak-json PATH]
        [--out benchmarks/results]

Each *episode* runs a fresh engine (SmolLM2-135M, the default gguf weights and bf16 KV, validators off) with a
session manager, the circuit breaker (default thresholds, the detector's warnings as its early signal), the reuse
audit and the health detector (:mod:`kvkeeper.diagnostics.health`, one sample every ``--interval-s``), all fed
from the engine's step hooks, under a steady background load (``--concurrency`` requests in flight: MT-Bench
questions behind a shared instruction, 16 tokens each).  After ``--pre-s`` seconds (the detector's warm-up plus a
fault-free stretch) an *onset* happens, and the episode goes on for ``--horizon-s`` seconds:

* ``control``: nothing (a fault-free episode; every warning is a false alarm);
* ``foreign_block``, ``shifted_positions``, ``freed_while_referenced``: the fault injectors of
  :mod:`kvkeeper.diagnostics.faults`, as the audit tests use them (one faulty request or session turn);
* ``overload_sessions``: a new session every ``--session-every-s`` seconds whose ~300-token turn stays pinned,
  until the pool is full;
* ``overload_burst``: 16 long requests (~400-token prompts, 48 tokens each) at once.

A warning that opens within ``[onset, onset + horizon]`` of a fault or overload episode is a true positive; any
other warning (before an onset, or in a control episode) a false positive.  Precision = true-positive warnings /
all warnings; recall = fault and overload episodes with a true-positive warning / such episodes.  Lead time = the
breaker's first trip after the onset minus the first true-positive warning (positive: the warning came first),
where the breaker tripped.  ``--soak-json`` adds the false-alarm rate of a fault-free soak
(``benchmarks/soak.py``).  Writes ``health_eval-<config>-<date>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, result_name, write_report  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ROOT / "data" / "mt_bench" / "question.jsonl"
PREFIX = "Answer the following question briefly and precisely, in plain words, without lists.\n\n"
TEXT_A = ("The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lamp, a flask "
          "of tea and a notebook in which he recorded the ships that passed the rocky point during the night.")
TEXT_B = ("A small bakery on the corner sold bread, pastries and cakes to the people of the village, opening "
          "before sunrise so that the farmers could buy warm loaves on their way to the fields.")
KINDS = ("control", "foreign_block", "shifted_positions", "freed_while_referenced", "overload_sessions",
         "overload_burst")


class Episode:
    """One engine, its breaker, audit and detector, a background load, and one onset of ``kind``."""

    def __init__(self, kind: str, args, seed: int):
        from kvkeeper import LLMEngine
        from kvkeeper.diagnostics.audit import ReuseAuditor
        from kvkeeper.diagnostics.health import HealthConfig, HealthMonitor, gates_from_breaker
        from kvkeeper.sessions import SessionManager
        from kvkeeper.engine.breaker import BreakerConfig, CircuitBreaker

        self.kind, self.args = kind, args
        exact = {"quantization": "none", "kv_dtype": "fp32"} if args.exact else {}
        self.eng = LLMEngine(num_kv_blocks=args.blocks, validate_every=0, num_threads=args.threads, **exact)
        self.sessions = SessionManager(self.eng)
        self.breaker = CircuitBreaker(self.eng, self.sessions, BreakerConfig())
        self.auditor = ReuseAuditor(args.audit_fraction, seed).attach(self.eng)
        hc = HealthConfig(interval_s=args.sample_every, warmup=args.warmup)
        self.health = HealthMonitor(gates_from_breaker(hc, self.breaker.config))
        if not args.no_early_signal:
            self.breaker.early_warning = self.health.active_signals
        self.questions = [json.loads(x)["turns"][0] for x in QUESTIONS.read_text().splitlines() if x.strip()]
        self.bg: list = []
        self.n_bg = 0
        self.ttft_sum, self.ttft_count = 0.0, 0
        self.trips: list[float] = []
        self.warnings: list[dict] = []
        self.t0 = time.monotonic()
        self.step_no = 0
        self.onset: float | None = None
        self.max_usage = self.max_frag = 0.0
        self.sessions_opened = 0
        self.errors: list[str] = []  # engine errors after the onset (the server would log and carry on)
        self.eng.first_token_hooks.append(self._first_token)
        self.eng.step_hooks.append(self._tick)

    def _first_token(self, seq, logits) -> None:
        self.ttft_sum += time.perf_counter() - seq.t_arrival
        self.ttft_count += 1

    def _tick(self) -> None:
        """Before every engine step: the detector's sample, trips and warnings, the background load topped up."""
        from kvkeeper import SamplingParams
        from kvkeeper.diagnostics.health import engine_counters

        self.step_no += 1
        now = float(self.step_no)  # the detector's clock: engine steps (the machine is shared; steps are reproducible)
        wall = time.monotonic() - self.t0
        c = engine_counters(self.eng, self.auditor, self.ttft_sum, self.ttft_count, self.breaker)
        self.max_usage = max(self.max_usage, c["usage"])
        self.max_frag = max(self.max_frag, c["pool_rate"])
        self.health.observe(c, now)
        if self.breaker.trips > len(self.trips):  # the breaker (a step hook before this one) tripped
            st = self.breaker.last_stats
            why = "usage" if st.usage >= self.breaker.config.usage_threshold else "fragmentation"
            self.trips.append((now, wall, why))
        for ev in list(self.health.events)[len(self.warnings):]:
            self.warnings.append({"t": ev["t_mono"], "wall_s": round(wall, 2), "event": ev["event"],
                                  "signals": [r["signal"] for r in ev["reasons"]]})
        self.bg = [s for s in self.bg if not s.finished]
        while len(self.bg) < self.args.concurrency:
            q = self.questions[self.n_bg % len(self.questions)]
            self.n_bg += 1
            self.bg.append(self.eng.add_request(PREFIX + q, SamplingParams(max_tokens=16, temperature=0.7,
                                                                           seed=self.n_bg)))

    # ---- onsets ------------------------------------------------------------------------------------------
    def foreign_block(self) -> None:
        from kvkeeper import SamplingParams
        from kvkeeper.diagnostics import faults

        eng = self.eng
        ns_a, ns_b = eng.isolated_namespace("a"), eng.isolated_namespace("b")
        ids_a = eng.tokenizer.encode(TEXT_A)
        ids_b = ids_a[:5] + eng.tokenizer.encode(TEXT_B)
        eng.generate([ids_a], SamplingParams(max_tokens=2), namespace=ns_a)
        bid, _ = eng.pool.lookup(None, ns_a, ids_a[: eng.block_size])
        seq = eng.add_request(ids_b, SamplingParams(max_tokens=2), namespace=ns_b)
        faults.reuse_foreign_block(eng, seq, bid)
        eng.run_until_done([seq])

    def shifted_positions(self) -> None:
        from kvkeeper import SamplingParams
        from kvkeeper.diagnostics import faults

        eng = self.eng
        seq = eng.add_request(eng.tokenizer.encode(TEXT_A), SamplingParams(max_tokens=2),
                              namespace=eng.isolated_namespace("shift"))
        faults.shift_positions(eng, seq, 20, 28)
        eng.run_until_done([seq])

    def freed_while_referenced(self) -> None:
        from kvkeeper import SamplingParams
        from kvkeeper.diagnostics import faults

        eng = self.eng
        s = self.sessions.open()
        s.send(TEXT_A + " " + TEXT_B, SamplingParams(max_tokens=2))
        bid = faults.free_while_referenced(eng, s.kv, 2)
        eng.generate([TEXT_B + " " + TEXT_A], SamplingParams(max_tokens=2), namespace=eng.isolated_namespace("o"))
        s.send("Summarise that in five words.", SamplingParams(max_tokens=2))
        eng.pool.incref(bid)  # give the session its reference back so that closing it is consistent
        s.close()

    def overload_sessions(self, now: float, state: dict) -> None:
        from kvkeeper import SamplingParams
        from kvkeeper.errors import KVKeeperError

        if now < state.get("next", 0.0) or state.get("full"):
            return
        state["next"] = now + self.args.session_every
        i = self.sessions_opened = self.sessions_opened + 1
        try:
            s = self.sessions.open(session_id=f"overload-{i}")
            s.send(f"Session {i}. " + TEXT_A + " " + TEXT_B + " " + self.questions[i % len(self.questions)],
                   SamplingParams(max_tokens=8))
        except KVKeeperError:  # refused (degraded): the pool is full, the overload has done its work
            state["full"] = True

    def overload_burst(self) -> None:
        from kvkeeper import SamplingParams

        for i in range(16):
            self.bg.append(self.eng.add_request(f"Request {i}. " + (TEXT_A + " " + TEXT_B + " ") * 3 +
                                                self.questions[i % len(self.questions)],
                                                SamplingParams(max_tokens=48, temperature=0.7, seed=i)))

    # ---- the run -----------------------------------------------------------------------------------------
    def run(self) -> dict:
        a = self.args
        state: dict = {}
        end = a.pre + a.horizon
        while (now := self.step_no) < end:
            try:
                if now >= a.pre and self.onset is None:
                    self.onset = now
                    self.onset_wall = time.monotonic() - self.t0
                    if self.kind in ("foreign_block", "shifted_positions", "freed_while_referenced",
                                     "overload_burst"):
                        getattr(self, self.kind)()
                if self.kind == "overload_sessions" and self.onset is not None:
                    self.overload_sessions(now, state)
                self.eng.step()
            except Exception as e:  # a corrupted pool (freed while referenced) can make a later step fail
                self.errors.append(f"{now:.1f} s: {type(e).__name__}: {str(e)[:200]}")
                if len(self.errors) >= 20:
                    break
        return self.result()

    def result(self) -> dict:
        on, h = self.onset, self.args.horizon
        opened = [w for w in self.warnings if w["event"] == "warning"]
        faulty = self.kind != "control"
        tp = [w for w in opened if faulty and on <= w["t"] <= on + h]
        trips = [t for t in self.trips if t[0] >= on]
        lead = lead_s = None
        if tp and trips:
            lead, lead_s = trips[0][0] - tp[0]["t"], round(trips[0][1] - tp[0]["wall_s"], 2)
        return {"kind": self.kind, "onset_step": on, "onset_wall_s": round(self.onset_wall, 2),
                "steps": self.step_no, "wall_s": round(time.monotonic() - self.t0, 1),
                "warnings": self.warnings, "true_positive": len(tp),
                "false_positive": len(opened) - len(tp), "detected": bool(tp),
                "trips": [{"step": t[0], "wall_s": round(t[1], 2), "on": t[2]} for t in self.trips],
                "first_trip_on": trips[0][2] if trips else None,
                "first_warning_step": tp[0]["t"] if tp else None,
                "first_trip_step": trips[0][0] if trips else None,
                "lead_steps": lead, "lead_time_s": lead_s, "audit_mismatches": self.auditor.mismatches, "audits": self.auditor.total,
                "preemptions": self.eng.scheduler.num_preemptions, "engine_errors": self.errors,
                "max_usage": round(self.max_usage, 3), "max_pool_rate": round(self.max_frag, 3),
                "sessions_opened": self.sessions_opened, "samples": self.health.samples,
                "breaker_actions": [{"tier": t, "action": x, "count": n} for (t, x), n in
                                    sorted(self.breaker.actions.items())]}


def summarize(eps: list[dict], args, soak: dict | None) -> dict:
    tp = sum(e["true_positive"] for e in eps)
    fp = sum(e["false_positive"] for e in eps)
    faulty = [e for e in eps if e["kind"] != "control"]
    per_kind = {}
    for k in KINDS:
        es = [e for e in eps if e["kind"] == k]
        if es:
            per_kind[k] = {"episodes": len(es), "detected": sum(e["detected"] for e in es),
                           "false_positive": sum(e["false_positive"] for e in es),
                           "signals": sorted({s for e in es for w in e["warnings"] for s in w["signals"]}),
                           "lead": [(e["lead_steps"], e["lead_time_s"]) for e in es if e["lead_steps"] is not None],
                           "trips": sum(1 for e in es if e["first_trip_step"] is not None),
                           "trip_on": sorted({e["first_trip_on"] for e in es if e["first_trip_on"]})}
    # fault-free time: control episodes whole, the others before their onset
    free_s = sum(e["wall_s"] if e["kind"] == "control" else e["onset_wall_s"] for e in eps)
    out = {"precision": tp / (tp + fp) if tp + fp else None,
           "recall": sum(e["detected"] for e in faulty) / len(faulty) if faulty else None,
           "true_positive_warnings": tp, "false_positive_warnings": fp,
           "fault_free_seconds": round(free_s, 1), "false_alarms_per_hour_eval": fp / (free_s / 3600) if free_s else None,
           "lead": [(e["lead_steps"], e["lead_time_s"]) for e in eps if e["lead_steps"] is not None],
           "per_kind": per_kind}
    if soak is not None:
        out["soak"] = {"minutes": round(soak["elapsed_s"] / 60, 1), **soak["health"]}
    return out


def markdown(res: dict) -> str:
    s, a = res["summary"], res["settings"]
    pr = "n/a" if s["precision"] is None else f"{s['precision']:.2f}"
    rc = "n/a" if s["recall"] is None else f"{s['recall']:.2f}"
    lines = [f"Health detector: precision {pr}, recall {rc} ({s['true_positive_warnings']} true / "
             f"{s['false_positive_warnings']} false warnings); {a['repeats']} episodes per kind, onset at step "
             f"{a['pre']}, horizon {a['horizon']} steps, a sample every {a['sample_every']} steps, {a['blocks']} blocks, "
             f"audit fraction {a['audit_fraction']}, early signal {'off' if a['no_early_signal'] else 'on'}, "
             f"{'float32 weights and KV (exact path)' if a['exact'] else 'gguf weights, bf16 KV (the defaults)'}.\n",
             "| episode kind | detected | false warnings | warning signals | breaker tripped (first trip on) | lead: steps (s) |",
             "|---|---|---|---|---|---|"]
    for k, v in s["per_kind"].items():
        lt = ", ".join(f"{n:+.0f} ({x:+.1f})" for n, x in v["lead"]) or "-"
        lines.append(f"| {k} | {v['detected']}/{v['episodes']} | {v['false_positive']} | "
                     f"{', '.join(v['signals']) or '-'} | {v['trips']}/{v['episodes']} ({', '.join(v['trip_on']) or '-'}) | {lt} |")
    lines.append(f"\nFalse alarms in the eval's fault-free time ({s['fault_free_seconds']} s): "
                 f"{s['false_positive_warnings']}.")
    if "soak" in s:
        k = s["soak"]
        lines.append(f"Fault-free soak ({k['minutes']} min): {k['warnings']} warnings over {k['samples']} samples "
                     f"({k['false_alarms_per_hour']:.2f} per hour).")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2, help="episodes per kind")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--blocks", type=int, default=256, help="KV pool blocks (16 tokens each)")
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--audit-fraction", type=float, default=1.0)
    ap.add_argument("--sample-every", type=int, default=4, help="engine steps between detector samples")
    ap.add_argument("--warmup", type=int, default=20, help="detector samples of baseline")
    ap.add_argument("--pre", type=int, default=120, help="engine steps before the onset")
    ap.add_argument("--horizon", type=int, default=240, help="engine steps after the onset")
    ap.add_argument("--session-every", type=int, default=6, help="overload_sessions: steps between new sessions")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--exact", action="store_true", help="float32 weights and KV (quantization none, kv fp32)")
    ap.add_argument("--no-early-signal", action="store_true", help="the breaker ignores the detector")
    ap.add_argument("--soak-json", help="a benchmarks/soak.py JSON: its fault-free false-alarm rate")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--config", default="default", help="the run's config in its file name (default %(default)s)")
    ap.add_argument("--name", default=None, help="write OUT/NAME.json and .md (default: health_eval-CONFIG-DATE)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    eps = []
    t0 = time.time()
    for r in range(args.repeats):
        for kind in args.kinds.split(","):
            ep = Episode(kind, args, seed=r)
            res = ep.run()
            del ep
            gc.collect()
            print(json.dumps({k: res[k] for k in ("kind", "detected", "true_positive", "false_positive",
                                                  "first_warning_step", "first_trip_step", "lead_steps", "wall_s",
                                                  "max_usage", "max_pool_rate", "sessions_opened")}), flush=True)
            eps.append(res)
    soak = json.loads(Path(args.soak_json).read_text()) if args.soak_json else None
    res = {"settings": vars(args), "cpu": cpu_model(), "elapsed_s": round(time.time() - t0, 1),
           "summary": summarize(eps, args, soak), "episodes": eps}
    write_report(Path(args.out), args.name or result_name("health_eval", args.config), res, markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
