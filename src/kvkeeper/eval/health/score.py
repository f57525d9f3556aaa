"""Scoring cache-health predictors on recorded traces (:mod:`kvkeeper.eval.health.scenarios`): no engine needed.

Each trace is replayed through a fresh predictor (:mod:`kvkeeper.diagnostics.health_predict`) and a
:class:`~kvkeeper.diagnostics.health_predict.WarningTracker`.  A warning that opens in ``[onset, breach]`` of a
breaching episode is a **true positive** (its lead is ``breach - t``, seconds); one that opens before the onset,
or anywhere in a fault-free episode that does not breach, is a **false alarm**; one after the onset of an
incident that never breached within the episode is counted apart (``unresolved``: the incident is real, its
breach lies past the episode).  Warnings after the breach do not count.

* precision = true positives / (true positives + false alarms);
* recall = breaching episodes with a true positive / breaching episodes;
* median lead (s) over the breaching episodes' first true positive;
* false alarms per hour = false alarms / fault-free hours (fault-free episodes whole, incidents before onset).
"""

from __future__ import annotations

import statistics

from ...diagnostics.health_predict import WarningTracker, make_predictor


def replay(trace: dict, predictor) -> list[tuple[float, dict]]:
    """The warnings that ``predictor`` opens on ``trace``'s samples: [(t, {"eta_s", "reason", "signal"})]."""
    tracker = WarningTracker()
    out = []
    for s in trace["samples"]:
        fc = predictor.update(s)
        if tracker.update(s["t"], fc):
            out.append((s["t"], {"eta_s": fc.eta_s, "reason": fc.reason, "signal": fc.signal}))
    return out


def score_episode(trace: dict, predictor) -> dict:
    """One episode's counts: ``tp``, ``fp``, ``unresolved`` warnings, ``lead_s`` (None: no true positive),
    ``breach``, ``fault_free_s``."""
    warns = replay(trace, predictor)
    on, br = trace["onset_s"], trace["breach_s"]
    end = trace["samples"][-1]["t"] if trace["samples"] else 0.0
    tp = fp = unresolved = 0
    lead = None
    for t, _ in warns:
        if br is not None and t > br:
            continue
        if on is not None and t >= on:
            if br is None:
                unresolved += 1
            else:
                tp += 1
                lead = br - t if lead is None else lead
        elif on is None and br is not None:  # a fault-free episode that breached: warnings before it are right
            tp += 1
            lead = br - t if lead is None else lead
        else:
            fp += 1
    return {"kind": trace["kind"], "seed": trace["seed"], "breach": br is not None, "tp": tp, "fp": fp,
            "unresolved": unresolved, "lead_s": lead, "fault_free_s": end if on is None else min(on, end),
            "first_warning": warns[0] if warns else None}


def summarize(rows: list[dict]) -> dict:
    """precision, recall, median_lead_s, false_alarms_per_hour and their inputs, over ``rows``."""
    tp, fp = sum(r["tp"] for r in rows), sum(r["fp"] for r in rows)
    breaching = [r for r in rows if r["breach"]]
    leads = [r["lead_s"] for r in breaching if r["lead_s"] is not None]
    hours = sum(r["fault_free_s"] for r in rows) / 3600.0
    return {"precision": tp / (tp + fp) if tp + fp else None,
            "recall": len(leads) / len(breaching) if breaching else None,
            "median_lead_s": statistics.median(leads) if leads else None,
            "false_alarms_per_hour": fp / hours if hours else None,
            "episodes": len(rows), "breaching_episodes": len(breaching), "true_positives": tp, "false_alarms": fp,
            "unresolved": sum(r["unresolved"] for r in rows), "fault_free_hours": round(hours, 4)}


def score(traces: list[dict], predictor_name: str, **predictor_kw) -> dict:
    """The table of one predictor over ``traces``: the summary, one per kind, and the episodes' rows."""
    rows = [score_episode(t, make_predictor(predictor_name, **predictor_kw)) for t in traces]
    kinds = sorted({r["kind"] for r in rows})
    return {**summarize(rows), "per_kind": {k: summarize([r for r in rows if r["kind"] == k]) for k in kinds},
            "rows": rows}


def markdown_table(tables: dict[str, dict]) -> str:
    """A markdown table of every predictor's summary (``tables``: {predictor name: :func:`score`'s result})."""
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    lines = ["| predictor | precision | recall | median lead (s) | false alarms / h | breaching episodes | "
             "true / false warnings |", "|---|---|---|---|---|---|---|"]
    for name, t in tables.items():
        lines.append(f"| {name} | {f(t['precision'])} | {f(t['recall'])} | {f(t['median_lead_s'], 1)} | "
                     f"{f(t['false_alarms_per_hour'], 1)} | {t['breaching_episodes']}/{t['episodes']} | "
                     f"{t['true_positives']} / {t['false_alarms']} |")
    return "\n".join(lines) + "\n"


def per_kind_table(table: dict) -> str:
    """One predictor's results per kind, as markdown."""
    f = lambda v, p=2: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    lines = ["| kind | episodes (breaching) | recall | median lead (s) | false alarms | unresolved |",
             "|---|---|---|---|---|---|"]
    for k, t in table["per_kind"].items():
        lines.append(f"| {k} | {t['episodes']} ({t['breaching_episodes']}) | {f(t['recall'])} | "
                     f"{f(t['median_lead_s'], 1)} | {t['false_alarms']} | {t['unresolved']} |")
    return "\n".join(lines) + "\n"


def read_server_trace(path) -> list[dict]:
    """The records of a server's ``--health-trace`` file (JSON lines; see
    :class:`~kvkeeper.diagnostics.health.HealthMonitor`).  Raises ValueError naming the line of a malformed one."""
    import json
    from pathlib import Path

    out = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            rec["sample"], rec["t"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path}:{i}: not a --health-trace record (JSON with 't' and 'sample')") from None
        out.append(rec)
    return out


def rescore_server_trace(records: list[dict], predictor, clear_after: int = 10) -> dict:
    """Replay a server's recorded samples (:func:`read_server_trace`) through ``predictor`` (an object with
    ``update(sample) -> Forecast``, as the server builds it) and a :class:`WarningTracker` closing after
    ``clear_after`` calm samples (the server's ``HealthConfig.clear_after``): ``warnings`` opened, ``hours``
    covered (first to last sample), ``per_hour``, ``first`` (t, reason) of each warning, and, where the trace
    was recorded with a predictor of the same name, ``agree``: samples whose replayed ``warn`` equals the recorded
    one (the replay runs the server's code: all of them, when nothing differs)."""
    tracker = WarningTracker(clear_after)
    name = getattr(predictor, "name", None)
    opened, agree, compared = [], 0, 0
    for rec in records:
        fc = predictor.update(rec["sample"])
        if tracker.update(rec["t"], fc):
            opened.append((rec["t"], fc.reason))
        live = rec.get("forecast")
        if live is not None and rec.get("predictor") == name:
            compared += 1
            agree += bool(live["warn"]) == fc.warn
    hours = (records[-1]["t"] - records[0]["t"]) / 3600.0 if len(records) > 1 else 0.0
    return {"predictor": name, "samples": len(records), "warnings": len(opened), "hours": round(hours, 4),
            "per_hour": len(opened) / hours if hours else None, "first": opened,
            "compared": compared, "agree": agree}
