"""Train the cache-health LSTM with attention (kvkeeper.diagnostics.health_predict.LstmAttention) on generated traces.

    python -m kvkeeper.eval.health.evaluate --seeds 0-11 --predictors ewma,trend --json /tmp/train.json \\
        --traces /tmp/train.jsonl.gz                      # the training traces (seeds 0-11)
    python benchmarks/health/train_health_lstm.py --traces /tmp/train.jsonl.gz --train-seeds 0-8 --tune-seeds 9-11 \\
        [--out src/kvkeeper/diagnostics/health_lstm.safetensors]

Windows of ``--window`` samples (features of :func:`~kvkeeper.diagnostics.health_predict.features`) from the
training seeds' traces, labelled 1 when the episode's recorded breach lies within ``--horizon-s`` of the
window's last sample (samples after a breach left out); binary cross-entropy with the positives weighted by
the class ratio, Adam, full-batch epochs, all seeded (``torch.manual_seed``, one thread): the same traces give
the same weights.  The warning threshold is then chosen on the tuning seeds' traces (the one of the grid with
the best F1 of precision and recall under :mod:`kvkeeper.eval.health.score`).  Held-out seeds (100 and up) are
never read.  The weights and settings go to a safetensors file (a few kB) shipped as package data.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvkeeper.diagnostics.health_predict import LSTM_WEIGHTS, LstmAttention, LstmPredictor, features
from kvkeeper.eval.health.evaluate import parse_seeds, read_traces
from kvkeeper.eval.health.score import score_episode, summarize


def windows(traces: list[dict], window: int, horizon_s: float, objective: float):
    xs, ys = [], []
    for tr in traces:
        f = [features(s, objective) for s in tr["samples"]]
        br = tr["breach_s"]
        for i in range(window - 1, len(f)):
            t = tr["samples"][i]["t"]
            if br is not None and t > br:
                break
            xs.append(f[i - window + 1: i + 1])
            ys.append(1.0 if br is not None and br - t <= horizon_s else 0.0)
    return torch.tensor(xs, dtype=torch.float32), torch.tensor(ys, dtype=torch.float32)


def train(x, y, hidden: int, epochs: int, lr: float) -> LstmAttention:
    torch.manual_seed(0)
    model = LstmAttention(hidden=hidden)
    pos = float(y.sum())
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=torch.tensor((len(y) - pos) / max(pos, 1.0)))
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for ep in range(epochs):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        if ep % 20 == 0 or ep == epochs - 1:
            print(f"epoch {ep}: loss {loss.item():.4f}", flush=True)
    model.eval()
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", required=True)
    ap.add_argument("--train-seeds", default="0-8")
    ap.add_argument("--tune-seeds", default="9-11")
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--horizon-s", type=float, default=60.0)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=200)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--objective-s", type=float, default=3.0)
    ap.add_argument("--out", default=str(LSTM_WEIGHTS))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    traces = read_traces(Path(a.traces))
    tr_seeds, tu_seeds = set(parse_seeds(a.train_seeds)), set(parse_seeds(a.tune_seeds))
    if tr_seeds & tu_seeds or any(s >= 100 for s in tr_seeds | tu_seeds):
        ap.error("training and tuning seeds must be apart and below 100 (the held-out seeds)")
    t0 = time.time()
    x, y = windows([t for t in traces if t["seed"] in tr_seeds], a.window, a.horizon_s, a.objective_s)
    print(f"{len(y)} windows, {int(y.sum())} positive", flush=True)
    model = train(x, y, a.hidden, a.epochs, a.lr)
    tune = [t for t in traces if t["seed"] in tu_seeds]
    best = None
    for th in (0.5, 0.6, 0.7, 0.8, 0.9, 0.95):
        info = {"window": a.window, "horizon_s": a.horizon_s, "threshold": th, "hidden": a.hidden,
                "ttft_objective_s": a.objective_s}
        s = summarize([score_episode(t, LstmPredictor(model, info)) for t in tune])
        p, r = s["precision"] or 0.0, s["recall"] or 0.0
        f1 = 2 * p * r / (p + r) if p + r else 0.0
        print(f"threshold {th}: precision {p:.2f} recall {r:.2f} F1 {f1:.2f} lead {s['median_lead_s']}", flush=True)
        if best is None or f1 > best[0]:
            best = (f1, th)
    meta = {"window": str(a.window), "horizon_s": str(a.horizon_s), "threshold": str(best[1]),
            "hidden": str(a.hidden), "ttft_objective_s": str(a.objective_s),
            "seeds": f"train {a.train_seeds}, tune {a.tune_seeds}", "epochs": str(a.epochs), "lr": str(a.lr)}
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, a.out, metadata=meta)
    print(f"wrote {a.out} (threshold {best[1]}, {time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
