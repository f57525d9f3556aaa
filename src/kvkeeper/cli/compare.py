"""``kvkeeper converse --compare``: time-to-first-token per turn with KV reuse and with a full re-prefill.

Each conversation runs on two sessions turn by turn.  The *reuse* session keeps its KV between turns
(turn N prefills only its new tokens); the *baseline* session (``reuse=False``, an isolated cache
namespace) is given exactly the reuse session's history before each turn and recomputes all of it.
The baseline stops after its first token (only its TTFT is compared), so both sides prefill the same
prompt of the same length.  Before the first timed turn one untimed request warms the engine up (the first
request of a process pays one-off costs that would otherwise land on turn 1).

Records (one per turn): ``id``, ``turn``, ``history_tokens`` (the prompt), ``cached_tokens`` (reused by
the reuse session), ``baseline_cached_tokens`` (0 unless something leaked across namespaces),
``ttft_reuse_s``, ``ttft_baseline_s``, ``ratio`` (baseline / reuse), ``completion_tokens`` and
``kv_bytes_held`` (bytes of pool blocks the reuse session pins after the turn:
blocks x block size x KV bytes per token).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..errors import ContextLengthError
from ..sessions.manager import SessionManager
from .common import CLIError, fmt_s
from ..engine.handle import EngineHandle


def _ratio(base: float | None, reuse: float | None) -> float | None:
    return base / reuse if base and reuse else None


def run_compare(engine: EngineHandle, convs, system: str | None, params, progress) -> list[dict]:
    """Run every conversation of ``convs`` ((id, [user texts]) pairs) both ways; one record per turn.

    progress: a :class:`kvkeeper.progress.Progress`-like object (``advance``, ``note``).  A turn that no longer
    fits the context ends its conversation (noted, no record).
    """
    sessions = SessionManager(engine)
    warm = sessions.open(system=system, reuse=False)
    try:
        warm.send(convs[0][1][0], params=dataclasses.replace(params, max_tokens=1))
    finally:
        warm.close()
    bytes_per_block = engine.kv.bytes_per_token * engine.block_size
    first_token = dataclasses.replace(params, max_tokens=1)
    records: list[dict] = []
    for cid, turns in convs:
        reuse = sessions.open(system=system, params=params)
        base = sessions.open(system=system, reuse=False, params=first_token)
        try:
            for i, text in enumerate(turns, 1):
                history = list(reuse.messages)
                try:
                    r = reuse.send(text)
                    base.messages = history  # the same conversation so far, recomputed from scratch
                    b = base.send(text)
                except ContextLengthError as e:
                    progress.note(f"conversation {cid} turn {i}: {e}; skipping the rest of it")
                    progress.advance(len(turns) - i + 1)
                    break
                records.append({
                    "id": cid, "turn": i, "history_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                    "baseline_cached_tokens": b.cached_tokens, "ttft_reuse_s": r.ttft_s,
                    "ttft_baseline_s": b.ttft_s, "ratio": _ratio(b.ttft_s, r.ttft_s),
                    "completion_tokens": r.completion_tokens, "kv_bytes_held": reuse.num_blocks * bytes_per_block})
                progress.advance()
        finally:
            reuse.close()
            base.close()
    return records


def compare_table(records: list[dict], title: str):
    """A rich Table of the per-turn records of :func:`run_compare`."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=title)
    table.add_column("id", overflow="fold")
    for name in ("turn", "history tok", "cached tok", "TTFT reuse s", "TTFT re-prefill s", "ratio"):
        table.add_column(name, justify="right")
    for rec in records:
        ratio = "n/a" if rec["ratio"] is None else f"{rec['ratio']:.1f}x"
        table.add_row(escape(str(rec["id"])), str(rec["turn"]), str(rec["history_tokens"]), str(rec["cached_tokens"]),
                      fmt_s(rec["ttft_reuse_s"]), fmt_s(rec["ttft_baseline_s"]), ratio)
    return table


def compare_summary(records: list[dict], at_turn: int = 10) -> str:
    """The summary lines: the ratio at turn ``at_turn`` (else the last turn), the share of prompt tokens
    served from the cache, and the KV bytes held at the end (reuse side; the baseline holds none)."""
    if not records:
        return "no turns ran"
    by_turn = [r for r in records if r["turn"] == at_turn] or [r for r in records if r["turn"] == max(
        x["turn"] for x in records)]
    ratios = [r["ratio"] for r in by_turn if r["ratio"] is not None]
    turn = by_turn[0]["turn"]
    lines = []
    if ratios:
        mean_ratio = sum(ratios) / len(ratios)
        lines.append(f"turn {turn}: TTFT {mean_ratio:.1f}x lower with KV reuse than with a full re-prefill"
                     + (f" (mean of {len(ratios)} conversations)" if len(ratios) > 1 else ""))
    prompt = sum(r["history_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    lines.append(f"prompt tokens served from the KV cache: {cached} of {prompt} "
                 f"({100 * cached / prompt:.1f}%)" if prompt else "no prompt tokens")
    last: dict[Any, dict] = {}
    for r in records:
        last[r["id"]] = r
    held = sum(r["kv_bytes_held"] for r in last.values())
    lines.append(f"KV held after the last turn: {held:,} bytes ({held / 2**20:.2f} MiB) with reuse, 0 without")
    return "\n".join(lines)


def plot_compare(records: list[dict], path: str | Path, title: str) -> None:
    """Draw TTFT per turn, with reuse and with re-prefill, into the PNG ``path`` (matplotlib: the ``plots`` extra).

    Raises :class:`CLIError` when matplotlib is not installed (saying how to install it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CLIError("--plot needs matplotlib: pip install 'kvkeeper[plots]' (or leave out --plot)") from None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ids = list(dict.fromkeys(r["id"] for r in records))
    for cid in ids:
        rs = [r for r in records if r["id"] == cid]
        suffix = f" ({cid})" if len(ids) > 1 else ""
        ax.plot([r["turn"] for r in rs], [r["ttft_baseline_s"] for r in rs], "o-", color="#d62728",
                label="re-prefill (no reuse)" + suffix)
        ax.plot([r["turn"] for r in rs], [r["ttft_reuse_s"] for r in rs], "o-", color="#1f77b4",
                label="KV reuse" + suffix)
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
