"""``kvkeeper serve``: the OpenAI-compatible HTTP server (its options are the fields of the server,
session, breaker and audit configs; see :mod:`kvkeeper.api.server`)."""

from __future__ import annotations

import argparse
import os
import socket

from ..api.server import ServerConfig
from ..diagnostics.audit import AuditConfig
from ..errors import KVKeeperError
from ..options import add_options, from_args
from ..sessions.breaker import BreakerConfig
from ..sessions.manager import SessionConfig
from .common import EXIT_ERROR, EXIT_OK, CLIError, load_engine, stderr


def add_parser(sub, parent: argparse.ArgumentParser) -> None:
    s = sub.add_parser("serve", parents=[parent], help="run the OpenAI-compatible HTTP server",
                       description="Serve /v1/chat/completions, /v1/completions, /v1/models, /v1/sessions, "
                                   "/health and /metrics over HTTP.")
    add_options(s, ServerConfig)
    add_options(s.add_argument_group("KV circuit breaker (see README: Circuit breaker)"), BreakerConfig)
    add_options(s.add_argument_group("session offload tiers"), SessionConfig)
    add_options(s.add_argument_group("reuse audit"), AuditConfig)
    s.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from ..api.server import build_server, run_server

    config = from_args(ServerConfig, args, log_level="info" if args.verbose else "warning")
    if config.trace_exporter == "otlp":
        try:
            import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        except ImportError:
            stderr("error: --otel-traces otlp needs the OTLP exporter: pip install 'kvkeeper[otlp]'", None)
            return EXIT_ERROR
    try:
        breaker = from_args(BreakerConfig, args)
    except ValueError as e:
        stderr(f"error: {e}", None)
        return EXIT_ERROR
    # test hook, read here at the edge: seconds slept inside each disk write (to kill a server mid-write)
    raw = os.environ.get("KVKEEPER_TEST_OFFLOAD_DELAY", "0") or "0"
    try:
        delay = float(raw)
    except ValueError:
        raise CLIError(f"$KVKEEPER_TEST_OFFLOAD_DELAY must be a number of seconds, got {raw!r}") from None
    sessions = from_args(SessionConfig, args, offload_write_delay_s=delay)
    try:
        sessions.context_spec()  # before the model loads: a policy without a budget
    except KVKeeperError as e:
        stderr(f"error: {e} (--context-policy, --context-budget)", None)
        return EXIT_ERROR
    _check_port_free(config.host, config.port)  # before the model loads
    engine = load_engine(args)
    config.served_model_name = config.served_model_name or args.model
    try:
        app = build_server(engine, config, sessions, breaker if config.breaker else None,
                           from_args(AuditConfig, args))
    except (ValueError, KVKeeperError) as e:  # a malformed or unloadable --lora-modules entry
        stderr(f"error: {e}", None)
        return EXIT_ERROR
    stderr(f"serving {config.served_model_name} on http://{config.host}:{config.port}/v1")
    run_server(app, config)
    return EXIT_OK


def _check_port_free(host: str, port: int) -> None:
    """Raise :class:`CLIError` when ``host:port`` cannot be listened on (in use, or not an address here)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise CLIError(f"cannot listen on {host}:{port}: {e}; give another --host") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            s.bind(addr)
        except OSError as e:
            raise CLIError(f"cannot listen on {host}:{port}: {e.strerror or e}; stop what uses it or give "
                           "another --port") from None
