"""argparse value types shared by the command-line modules: each raises ArgumentTypeError saying what was wrong;
and the one parser of the JSON-object settings (``--kv-events-config``, ``--speculative-config``)."""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import fields

from .errors import InvalidRequestError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _int(s: str) -> int:
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {s!r}") from None


def _float(s: str, what: str) -> float:
    try:
        return float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None


def positive_int(s: str) -> int:
    v = _int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def non_negative_int(s: str) -> int:
    v = _int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def port(s: str) -> int:
    """A TCP port, 1..65535."""
    v = _int(s)
    if not 1 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 1..65535, got {v}")
    return v


def validate_every_arg(s: str) -> int:
    """``--validate-every`` (whose default comes from ``$KVKEEPER_VALIDATE``): a whole number >= 0."""
    try:
        return non_negative_int(s)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (from --validate-every or $KVKEEPER_VALIDATE)") from None


def fraction(s: str) -> float:
    """A number in [0, 1]."""
    v = _float(s, "a number in [0, 1]")
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {s}")
    return v


def non_negative_float(s: str) -> float:
    v = _float(s, "a number >= 0")
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {s}")
    return v


def size(s: str) -> int:
    """Bytes: a number with an optional binary suffix (512M, 1G, 1.5GiB)."""
    m = _SIZE_RE.match(s)
    if not m:
        raise argparse.ArgumentTypeError(f"expected a size in bytes such as 536870912, 512M or 1G, got {s!r}")
    v = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be > 0, got {s!r}")
    return v


def size_or_zero(s: str) -> int:
    """Bytes as :func:`size`, or 0 (the feature off)."""
    return 0 if s.strip() in ("0", "0B", "0b") else size(s)


def parse_json_config(raw, cls: type, flag: str, hint: str, param: str):
    """A ``cls`` (a dataclass) from JSON text, a dict or a ``cls``: ``cls(**fields)``.  Raises
    :class:`InvalidRequestError` (``param``) saying the text is not a JSON object, or naming the unknown fields and
    the known ones; ``cls`` raises for a wrong value.  flag: the option named in the messages; hint: an example."""
    if isinstance(raw, cls):
        return raw
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as e:
            raise InvalidRequestError(f"{flag} must be a JSON object: {e} ({hint})", param=param) from None
    if not isinstance(raw, dict):
        raise InvalidRequestError(f"{flag} must be a JSON object, got {type(raw).__name__} ({hint})", param=param)
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise InvalidRequestError(f"{flag}: unknown field(s) {', '.join(unknown)}; known fields: {', '.join(known)}",
                                  param=param)
    return cls(**raw)
