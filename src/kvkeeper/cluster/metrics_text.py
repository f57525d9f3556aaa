"""One Prometheus page from several: each replica's samples get a ``replica`` label (text format 0.0.4)."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?(\s.*)$")


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def with_label(text: str, key: str, value: str) -> tuple[list[str], list[str]]:
    """(comment lines, sample lines) of a Prometheus text page, every sample labelled ``key="value"``."""
    comments, samples = [], []
    lab = f'{key}="{_escape(value)}"'
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith("#"):
            comments.append(line)
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, inner, rest = m.group(1), m.group(3), m.group(4)
        samples.append(f"{name}{{{lab}{',' + inner if inner else ''}}}{rest}")
    return comments, samples


def merge(pages: dict[str, str], key: str = "replica") -> str:
    """The pages of ``{replica name: text}`` as one page: each HELP/TYPE once, then its samples of every replica."""
    order: list[str] = []
    comments: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for name in sorted(pages):
        cs, ss = with_label(pages[name], key, name)
        for c in cs:
            parts = c.split(None, 3)
            fam = parts[2] if len(parts) > 2 else ""
            if fam not in comments:
                order.append(fam)
                comments[fam], samples[fam] = [], []
            if c not in comments[fam]:
                comments[fam].append(c)
        for s in ss:
            fam = _family(s, comments)
            samples.setdefault(fam, []).append(s)
            if fam not in comments:
                order.append(fam)
                comments[fam] = []
    return "".join("\n".join(comments[f] + samples.get(f, [])) + "\n" for f in order)


def _family(sample: str, families: dict) -> str:
    name = sample.split("{", 1)[0]
    for suffix in ("_total", "_bucket", "_count", "_sum", "_created"):
        base = name.removesuffix(suffix)
        if base != name and base in families:
            return base
    return name
