"""Command-line interface: ``kvkeeper generate | chat | converse | serve``.

Run as ``kvkeeper ...``, ``python -m kvkeeper ...`` or ``python -m kvkeeper.cli ...``.
One module per group of subcommands (:mod:`.chat`, :mod:`.serve`, :mod:`.evals`, :mod:`.kv`);
:mod:`.common` holds the engine options, errors and consoles they share.

* ``generate``  one prompt (raw text, or one user message through the chat template with ``--chat``).
* ``chat``      an interactive REPL on one session (works with piped stdin too); ``/reset``, ``/exit``.
* ``converse``  scripted multi-turn conversations from a JSONL file (MT-Bench or Topical-Chat
                format), one session per line, with a per-turn table of prompt / cached /
                completion tokens, TTFT and decode speed.
* ``serve``     the OpenAI-compatible HTTP server (``kvkeeper.api``).
* ``eval``      perplexity, passkey retrieval and terminology consistency through the KV cache.
* ``kv``        the block map, KV dumps and diffs, the reuse audit.

Results go to stdout; logging, progress and per-turn stats go to stderr, so ``--json``
output stays parseable.  Any kvkeeper error (unknown model, empty prompt, bad input
file...) prints ``error: <message>`` on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from .. import __version__
from ..errors import KVKeeperError
from ..progress import reporting
from . import chat, evals, kv, serve
from .common import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK, CLIError, engine_parent

__all__ = ["main", "build_parser", "configure_logging", "CLIError", "EXIT_OK", "EXIT_ERROR", "EXIT_INTERRUPTED"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvkeeper",
        description="kvkeeper: an LLM inference engine whose first-class object is the KV cache of a conversation.",
    )
    parser.add_argument("--version", action="version", version=f"kvkeeper {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    parent = engine_parent()
    chat.add_parsers(sub, parent)
    serve.add_parser(sub, parent)
    evals.add_parser(sub, parent)
    kv.add_parser(sub, parent)
    return parser


def configure_logging(verbose: bool) -> None:
    """Log to stderr what is WARNING or above, and INFO too with ``-v``, from kvkeeper and every library alike.

    The level is the handler's, so a library that sets its own logger to DEBUG (bm25s does) stays quiet too; without
    ``-v`` the Hugging Face libraries' progress bars (transformers' "Loading weights") are off as well
    (``HF_HUB_DISABLE_PROGRESS_BARS``, which they read when imported; switched off directly if they already are).
    """
    level = logging.INFO if verbose else logging.WARNING
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(level)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
    if verbose:
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers.utils.logging" in sys.modules:
        sys.modules["transformers.utils.logging"].disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.verbose)
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.reconfigure(errors="replace")  # a reply with odd characters must not crash the CLI
    try:
        with reporting():  # progress of long steps (model load, evals) on stderr
            return args.func(args)
    except (KVKeeperError, CLIError) as e:
        msg = str(e)
    except FileNotFoundError as e:
        msg = f"no such file: {e.filename}" if e.filename else str(e)
    except OSError as e:
        if isinstance(e, BrokenPipeError):  # e.g. `kvkeeper ... | head`
            with contextlib.suppress(Exception):
                sys.stdout = open(os.devnull, "w")
            return EXIT_OK
        msg = f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
    except KeyboardInterrupt:
        sys.stderr.write("\ninterrupted\n")
        return EXIT_INTERRUPTED
    sys.stderr.write(f"error: {msg}\n")
    sys.stderr.flush()
    return EXIT_ERROR


