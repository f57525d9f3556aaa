"""JSON-object settings of the command line (``--kv-events-config``, ``--speculative-config``): one parser for both."""

from __future__ import annotations

import json
from dataclasses import fields

from ..errors import InvalidRequestError


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
