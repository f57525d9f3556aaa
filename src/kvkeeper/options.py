"""Configuration dataclasses as command-line options: one definition, one default.

A field of a config dataclass (``EngineConfig``, ``SessionConfig``, ``BreakerConfig``,
``AuditConfig``, ``ServerConfig``) becomes a command-line option when its metadata
holds :func:`option`; :func:`add_options` adds those options to an argparse parser
with the dataclass's own defaults, and :func:`from_args` builds the dataclass back
from the parsed arguments.  So the CLI never repeats a default, and a new field
reaches the command line by declaring its flag where it is defined.

This module sits at the bottom of the package (it imports nothing of kvkeeper):
any layer may describe its config with it.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any


def option(flag: str, help: str, **argparse_kwargs: Any) -> dict:
    """Field metadata that makes a config field the command-line option ``flag``.

    argparse_kwargs go to ``add_argument`` (type, choices, metavar, action...), plus
    ``exclusive="NAME"``: options sharing a name form one mutually exclusive group, and
    ``negate=True`` for a boolean field set False by a ``store_true`` flag (``--enforce-eager``
    for ``cuda_graphs``).  The dataclass default is appended to the help unless it says one.
    """
    return {"option": (flag, help, argparse_kwargs)}


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def add_options(parser: argparse.ArgumentParser | Any, cls: type, exclude: tuple[str, ...] = ()) -> None:
    """Add every field of dataclass ``cls`` that declares an :func:`option` to ``parser`` (or a group)."""
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("option")
        if spec is None or f.name in exclude:
            continue
        flag, text, kw = spec
        kw = dict(kw)
        target = parser
        if "exclusive" in kw:
            name = kw.pop("exclusive")
            if name not in groups:
                groups[name] = parser.add_mutually_exclusive_group()
            target = groups[name]
        default = _default(f)
        if kw.pop("negate", False):
            target.add_argument(flag, dest=f.name, action="store_false", default=default, help=text)
            continue
        if default not in (None, False) and "default" not in text:
            text = f"{text} (default: {default})"
        target.add_argument(flag, dest=f.name, default=default, help=text, **kw)


def from_args(cls: type, args: argparse.Namespace, **overrides: Any):
    """Build dataclass ``cls`` from parsed arguments (fields with an :func:`option`) plus ``overrides``."""
    kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
          if "option" in f.metadata and hasattr(args, f.name)}
    kw.update(overrides)
    return cls(**kw)
