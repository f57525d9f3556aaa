"""Compare two KV dumps (see :mod:`kvkeeper.diagnostics.kvdump`) layer by layer.

Two dumps are comparable when they hold the same layers, the same token positions
and tensors of the same shapes; otherwise :class:`DumpMismatchError` says what differs.
Differences of metadata that do not prevent the comparison (model revision, namespace,
KV dtype, token ids) are returned as ``warnings``.

For each layer: max and mean ``|a - b|`` of K and of V (computed in float64).  The first
divergent layer is the lowest one with a token whose ``max |a - b|`` (over heads and head
dimension) exceeds ``atol``; the first divergent token is the lowest such position in it
(K checked before V).  ``max_rel`` is the overall max difference over the largest ``|b|``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..errors import KVKeeperError
from .kvdump import FORMAT


class DumpMismatchError(KVKeeperError):
    """Two dumps cannot be compared (different layers, positions or shapes), or a file is not a dump."""


def load_dump(path) -> tuple[dict, dict]:
    """(tensors, metadata) of a dump file.  Raises FileNotFoundError, or DumpMismatchError if it is not a dump."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(2, "no such dump file", str(path))
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except SafetensorError as e:
        raise DumpMismatchError(f"{path} is not a safetensors file: {e}") from None
    if meta.get("format") != FORMAT:
        raise DumpMismatchError(f"{path} is not a kvkeeper KV dump (metadata format {meta.get('format')!r}, "
                                f"expected {FORMAT!r}); write one with `kvkeeper kv dump`")
    return tensors, meta


def diff_dumps(a: tuple[dict, dict], b: tuple[dict, dict], atol: float = 0.0) -> dict:
    """Per-layer differences of two loaded dumps ``(tensors, metadata)``.

    Returns a dict: ``layers`` (list of {layer, k_max_abs, k_mean_abs, v_max_abs, v_mean_abs}),
    ``max_abs``, ``mean_abs`` (over all compared values), ``max_rel``, ``first_divergent``
    ({layer, token, tensor} or None), ``atol``, ``token_start``, ``token_end``, ``warnings``.
    Raises :class:`DumpMismatchError` when the dumps are not comparable.
    """
    (ta, ma), (tb, mb) = a, b
    for key, what in (("layers", "layers"), ("token_start", "first token position"),
                      ("token_end", "end token position")):
        if ma.get(key) != mb.get(key):
            raise DumpMismatchError(f"the dumps hold different {what}: {ma.get(key)!r} vs {mb.get(key)!r}; "
                                    "dump both with the same --layers/--start/--end")
    warnings = []
    for key in ("model_revision", "namespace", "kv_dtype", "token_ids"):
        if ma.get(key) != mb.get(key):
            warnings.append(f"{key} differs" + ("" if key == "token_ids" else f": {ma.get(key)} vs {mb.get(key)}"))
    start = int(ma["token_start"])
    layers = [int(x) for x in ma["layers"].split(",")]
    rows = []
    first = None
    total_abs, count, max_abs, max_ref, non_finite = 0.0, 0, 0.0, 0.0, 0
    for layer in layers:
        row = {"layer": layer}
        for name in ("k", "v"):
            key = f"layers.{layer}.{name}"
            if key not in ta or key not in tb:
                which = "first" if key not in ta else "second"
                raise DumpMismatchError(f"tensor {key} is missing from the {which} dump")
            x, y = ta[key].to(torch.float64), tb[key].to(torch.float64)
            if x.shape != y.shape:
                raise DumpMismatchError(f"{key} has shape {tuple(x.shape)} in the first dump and {tuple(y.shape)} "
                                        "in the second (a different model?)")
            # NaN/inf in one dump only is an infinite difference (NaN would compare as no divergence);
            # the same bits on both sides (inf == inf, NaN and NaN) count as equal
            same = (x == y) | (x.isnan() & y.isnan())
            d = torch.where(same, 0.0, (x - y).abs().nan_to_num(nan=math.inf))
            non_finite += int((~same & ~(x.isfinite() & y.isfinite())).sum())
            row[f"{name}_max_abs"] = float(d.max()) if d.numel() else 0.0
            row[f"{name}_mean_abs"] = float(d.mean()) if d.numel() else 0.0
            total_abs += float(d.sum())
            count += d.numel()
            max_abs = max(max_abs, row[f"{name}_max_abs"])
            yf = y[y.isfinite()].abs()
            max_ref = max(max_ref, float(yf.max()) if yf.numel() else 0.0)
            if first is None or first["layer"] == layer:
                bad = torch.nonzero(d.flatten(1).amax(dim=1) > atol)
                if bad.numel():
                    tok = start + int(bad[0, 0])
                    if first is None or tok < first["token"]:
                        first = {"layer": layer, "token": tok, "tensor": name}
        rows.append(row)
    if non_finite:
        warnings.append(f"{non_finite} values are NaN or infinite in one dump only (counted as an infinite "
                        "difference)")
    return {"layers": rows, "max_abs": max_abs, "mean_abs": total_abs / count if count else 0.0,
            "max_rel": max_abs / max_ref if max_ref else 0.0, "first_divergent": first, "atol": atol,
            "token_start": start, "token_end": int(ma["token_end"]), "warnings": warnings}


def diff_files(path_a, path_b, atol: float = 0.0) -> dict:
    """:func:`diff_dumps` of two dump files (adds their paths as ``a`` and ``b``)."""
    r = diff_dumps(load_dump(path_a), load_dump(path_b), atol)
    r["a"], r["b"] = str(path_a), str(path_b)
    return r


def format_report(r: dict) -> str:
    """A plain-text table of a diff result (one line per layer, then a summary)."""
    lines = [f"{'layer':>5}  {'K max':>10}  {'K mean':>10}  {'V max':>10}  {'V mean':>10}"]
    for row in r["layers"]:
        lines.append(f"{row['layer']:>5}  {row['k_max_abs']:>10.3g}  {row['k_mean_abs']:>10.3g}  "
                     f"{row['v_max_abs']:>10.3g}  {row['v_mean_abs']:>10.3g}")
    fd = r["first_divergent"]
    where = (f"first divergent: layer {fd['layer']}, token {fd['token']} ({fd['tensor'].upper()})" if fd
             else f"no divergence above atol {r['atol']:g}")
    lines.append(f"positions {r['token_start']}..{r['token_end'] - 1}: max |diff| {r['max_abs']:.3g} "
                 f"(relative {r['max_rel']:.3g}), mean {r['mean_abs']:.3g}; {where}")
    lines += [f"warning: {w}" for w in r["warnings"]]
    return "\n".join(lines)


def to_json(r: dict) -> str:
    """The result as strict JSON: an infinite difference is written as the string "inf"."""
    def fix(o):
        if isinstance(o, float) and not math.isfinite(o):
            return str(o)
        if isinstance(o, dict):
            return {k: fix(v) for k, v in o.items()}
        if isinstance(o, list):
            return [fix(v) for v in o]
        return o

    return json.dumps(fix(r))
