"""Rescore a server's recorded health samples with any breach predictor (issue 29): the false alarms of a real soak.

    kvkeeper serve ... --health-trace /tmp/health.jsonl          # the server records every sample it forecasts on
    python benchmarks/health/health_rescore.py --trace /tmp/health.jsonl [--predictors trend,gbt,...] [--json OUT]

Each predictor is built as the server builds it (:func:`kvkeeper.api.server.breach_forecaster` with the default
breaker thresholds and ``--ttft-objective``) and replayed on the recorded samples with the server's warning rule
(:func:`kvkeeper.eval.health.score.rescore_server_trace`: a warning opens at the first warning forecast and closes
after 10 calm samples).  The EWMA charts are replayed too, on the recorded signals
(:class:`~kvkeeper.diagnostics.health.HealthMonitor`, the default gates).  On a fault-free run every warning is a
false alarm.  Where the trace was recorded with the same predictor, ``agree`` counts the samples whose replayed
forecast matches the live one (the check that the replay is the server's code).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kvkeeper.api.server import breach_forecaster
from kvkeeper.diagnostics.health import HealthConfig, HealthMonitor, gates_from_breaker
from kvkeeper.sessions.breaker import BreakerConfig
from kvkeeper.eval.health.score import read_server_trace, rescore_server_trace


def ewma_warnings(records: list[dict]) -> int:
    """EWMA warnings a fresh detector opens on the recorded signals."""
    mon = HealthMonitor(gates_from_breaker(HealthConfig(), BreakerConfig()), clock=lambda: 0.0)
    for rec in records:
        mon.observe_signals(rec.get("signals") or {}, rec["t"])
    return mon.warnings


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, help="a --health-trace file (JSON lines)")
    ap.add_argument("--predictors", default=",".join(HealthConfig.PREDICTORS[:-1]))
    ap.add_argument("--ttft-objective", type=float, default=3.0)
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    try:
        records = read_server_trace(a.trace)
    except (OSError, ValueError) as e:
        ap.error(str(e))
    if len(records) < 2:
        ap.error(f"{a.trace}: {len(records)} records; a rescore needs at least 2")
    out = {"trace": a.trace, "samples": len(records), "recorded_predictor": records[-1].get("predictor"),
           "start_wall_t": records[0].get("wall_t"), "end_wall_t": records[-1].get("wall_t"),
           "load_average": " ".join(f"{x:.2f}" for x in os.getloadavg()), "predictors": {}}
    for name in a.predictors.split(","):
        if name not in HealthConfig.PREDICTORS:
            ap.error(f"--predictors: unknown {name!r}; choose from {', '.join(HealthConfig.PREDICTORS)}")
        fc = breach_forecaster(HealthConfig(predictor=name, ttft_objective_s=a.ttft_objective), BreakerConfig())
        r = rescore_server_trace(records, fc)
        out["predictors"][name] = r
        print(f"{name}: {r['warnings']} warnings in {r['hours']:.3f} h ({r['per_hour']:.2f}/h)"
              + (f"; replay agrees with the live forecast on {r['agree']} of {r['compared']} samples"
                 if r["compared"] else ""))
    out["ewma_warnings"] = ewma_warnings(records)
    print(f"ewma: {out['ewma_warnings']} warnings")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
