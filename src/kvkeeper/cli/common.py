"""What every subcommand shares: errors and exit codes, consoles, the engine options, loading the engine.

The engine options are the fields of :class:`~kvkeeper.engine.config.EngineConfig` (one default,
declared there).  This is the edge of the program: the only place that reads environment
variables, as option defaults: ``KVKEEPER_VALIDATE`` (``--validate-every``), ``KVKEEPER_QUANTIZATION``
(``--quantization``), ``KVKEEPER_FUSED_DECODE=0`` (``--no-fused-decode``), ``KVKEEPER_CACHE``
(``--cache-dir``); and ``KVKEEPER_CPU_KERNELS=0`` (never load the C++ kernels in this process).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

from ..argtypes import non_negative_int, positive_int
from ..engine.config import EngineConfig
from ..sampling.params import SamplingParams
from ..options import add_options, from_args

EXIT_OK = 0
EXIT_ERROR = 2
EXIT_INTERRUPTED = 130


class CLIError(Exception):
    """A usage or input problem found by the CLI itself (bad input file, empty prompt...)."""


def err_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


def out_console():
    from rich.console import Console

    # When stdout is not a terminal rich assumes 80 columns and would squeeze the table.
    return Console(highlight=False, width=None if sys.stdout.isatty() else 160)


def stderr(msg: str, style: str | None = "dim") -> None:
    """``msg`` as one line on stderr: styled through rich on a terminal, written as it is otherwise (a server's
    log file or pipe; rich is then not imported, a start-up's few tens of milliseconds)."""
    isatty = getattr(sys.stderr, "isatty", None)
    if not (isatty and isatty()):
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()
        return
    err_console().print(msg, style=style, markup=False)


def command(sub, func, name: str, **kw) -> argparse.ArgumentParser:
    """A subcommand ``name`` of ``sub`` that runs ``func(args)``; kw: ``add_parser``'s (help, description, parents)."""
    p = sub.add_parser(name, **kw)
    p.set_defaults(func=func)
    return p


def tool_group(sub, dest: str, metavar: str, name: str, **kw):
    """A subcommand ``name`` of ``sub`` whose own subcommands are required (``kvkeeper kv TOOL``); returns them."""
    group = sub.add_parser(name, **kw).add_subparsers(dest=dest, metavar=metavar)
    group.required = True
    return group


def engine_parent() -> argparse.ArgumentParser:
    """A parent parser with the engine options (EngineConfig's fields) and ``-v``."""
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("engine options")
    add_options(g, EngineConfig)
    # the edge of the program: environment variables become option defaults here and nowhere else (a string
    # default goes through the option's type, so a bad $KVKEEPER_VALIDATE is a usage error, exit 2)
    p.set_defaults(validate_every=os.environ.get("KVKEEPER_VALIDATE", "0") or "0",
                   quantization=os.environ.get("KVKEEPER_QUANTIZATION") or None,
                   fused_decode=os.environ.get("KVKEEPER_FUSED_DECODE", "1") != "0",
                   cache_dir=os.environ.get("KVKEEPER_CACHE") or None)
    g.add_argument("-v", "--verbose", action="store_true", help="log engine activity (INFO) to stderr")
    return p


def add_sampling(p: argparse.ArgumentParser, max_tokens: int, temperature: float, top: bool = False) -> None:
    g = p.add_argument_group("sampling options")
    g.add_argument("--max-tokens", type=positive_int, default=max_tokens, metavar="N",
                   help=f"new tokens at most per reply (default: {max_tokens})")
    g.add_argument("--temperature", type=float, default=temperature, metavar="T",
                   help=f"sampling temperature, 0 = greedy (default: {temperature:g})")
    if top:
        g.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass in (0, 1] (default: 1)")
        g.add_argument("--top-k", type=non_negative_int, default=0, metavar="K", help="keep the K most likely tokens, 0 = off")
    g.add_argument("--seed", type=int, default=None, metavar="S", help="random seed for reproducible sampling")


def sampling(args: argparse.Namespace, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed, **extra)


def load_engine(args: argparse.Namespace):
    """The engine the engine options describe, with a load line on stderr (model, dtypes, KV pool, context)."""
    from ..engine.llm_engine import LLMEngine
    from ..weights.sources import resolve_model_path

    cfg = from_args(EngineConfig, args)
    if os.environ.get("KVKEEPER_CPU_KERNELS", "1") == "0":
        from ..kernels import cpu as cpu_kernels

        cpu_kernels.disable("KVKEEPER_CPU_KERNELS=0")
    if cfg.load_format == "dummy":
        from ..weights.dummy import resolve_config

        resolve_config(cfg.model)  # fail fast, listing the shipped config names
    else:
        resolve_model_path(cfg.model)  # fail fast (and listing the known ids) before anything slow
    t0 = time.perf_counter()
    # Keep stdout clean for results: anything a library prints while loading goes to stderr.
    # Long steps of the load (a first dequantisation, packing weight blocks) show their own progress
    # (kvkeeper.progress; the CLI turns reporting on).
    stderr(f"loading {cfg.model} ...")
    with contextlib.redirect_stdout(sys.stderr):
        engine = LLMEngine(cfg)
    stderr(f"loaded {engine.model_name} ({engine.describe()}) in {time.perf_counter() - t0:.1f} s")
    return engine


def fmt_s(x: float | None, nd: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


def stats_line(r) -> str:
    speed = "n/a tok/s" if r.decode_tok_per_s is None else f"{r.decode_tok_per_s:.1f} tok/s"
    return (f"[turn {r.turn}] prompt {r.prompt_tokens} tok, cached {r.cached_tokens} tok, "
            f"completion {r.completion_tokens} tok, TTFT {fmt_s(r.ttft_s)} s, {speed}")
