"""``kvkeeper serve``: the OpenAI-compatible HTTP server (its options are the fields of the server,
session, breaker and audit configs; see :mod:`kvkeeper.api.server`)."""

from __future__ import annotations

import argparse
import os
import socket

from ..api.server import ServerConfig
from ..cluster.config import ClusterConfig, ReplicaSpec
from ..diagnostics.audit import AuditConfig
from ..diagnostics.health import HealthConfig
from ..sessions.breaker import BreakerConfig
from ..errors import KVKeeperError
from ..options import add_options, from_args
from ..sessions.manager import SessionConfig
from ..startup import paused_gc
from .common import EXIT_ERROR, EXIT_OK, CLIError, command, load_engine, stderr


def add_parser(sub, parent: argparse.ArgumentParser) -> None:
    s = command(sub, cmd_serve, "serve", parents=[parent], help="run the OpenAI-compatible HTTP server",
                       description="Serve /v1/chat/completions, /v1/completions, /v1/models, /v1/sessions, "
                                   "/health and /metrics over HTTP.")
    add_options(s, ServerConfig)
    add_options(s.add_argument_group("KV circuit breaker (see README: Circuit breaker)"), BreakerConfig)
    add_options(s.add_argument_group("session offload tiers"), SessionConfig)
    add_options(s.add_argument_group("reuse audit"), AuditConfig)
    add_options(s.add_argument_group("cache-health detector (see README: Cache-health prediction)"), HealthConfig)
    add_options(s.add_argument_group("replicas on Ray Serve (README: Scale-out on Ray Serve)"), ClusterConfig)


def cmd_serve(args: argparse.Namespace) -> int:
    from ..api.server import build_server, run_server

    config = from_args(ServerConfig, args, log_level="info" if args.verbose else "warning")
    if config.api_key is None:
        config.api_key = os.environ.get("KVKEEPER_API_KEY") or None  # the environment is read here, at the edge
    try:
        config.key_ring()  # a bad keys file is refused before the model loads
    except ValueError as e:
        stderr(f"error: {e} (--api-key, --api-keys-file, $KVKEEPER_API_KEY)", None)
        return EXIT_ERROR
    if config.trace_exporter == "otlp":
        try:
            import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        except ImportError:
            stderr("error: --otel-traces otlp needs the OTLP exporter: pip install 'kvkeeper[otlp]'", None)
            return EXIT_ERROR
    try:
        breaker = from_args(BreakerConfig, args)
        health = from_args(HealthConfig, args)
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
    if config.admin_port is not None:
        if config.admin_port == config.port:
            raise CLIError(f"--admin-port {config.admin_port} is the --port: give the admin routes another port")
        _check_port_free("127.0.0.1", config.admin_port)
    cluster = from_args(ClusterConfig, args)
    if cluster.replicas is not None or cluster.ray_address is not None:
        if config.admin_port is not None:
            raise CLIError("--admin-port is not served with --replicas (each replica keeps its admin routes on "
                           "the main port); leave it out")
        if args.kv_events_config is not None:  # each replica binds its own endpoints: all must be free to take
            from ..cluster.replica_events import check_cluster_events

            try:
                check_cluster_events(args.kv_events_config, cluster.replicas or 1)
            except KVKeeperError as e:
                raise CLIError(str(e)) from None
        return _serve_cluster(args, config, sessions, breaker, cluster, health)
    with paused_gc():  # the model, FastAPI and uvicorn: start-up objects, kept for the process's life
        engine = load_engine(args)
        config.served_model_name = config.served_model_name or args.model
        try:
            app = build_server(engine, config, sessions, breaker if config.breaker else None,
                               from_args(AuditConfig, args), health)
        except (ValueError, KVKeeperError) as e:  # a malformed or unloadable --lora-modules entry
            stderr(f"error: {e}", None)
            return EXIT_ERROR
        import uvicorn  # noqa: F401  (imported by run_server; here, under the paused collector)
    stderr(f"serving {config.served_model_name} on http://{config.host}:{config.port}/v1")
    if config.admin_port is not None:
        stderr(f"admin routes on http://127.0.0.1:{config.admin_port}/admin/kv")
    run_server(app, config)
    return EXIT_OK


def _serve_cluster(args, config: ServerConfig, sessions: SessionConfig, breaker: BreakerConfig,
                   cluster: ClusterConfig, health: HealthConfig) -> int:
    """``--replicas N`` / ``--ray-address``: the engine replicas on Ray Serve, until interrupted."""
    import signal
    import time

    from ..engine.config import EngineConfig

    try:
        from ..cluster import deployment
    except ImportError as e:
        stderr(f"error: --replicas needs Ray Serve ({e}): pip install 'kvkeeper[cluster]'", None)
        return EXIT_ERROR
    cluster.replicas = cluster.replicas or 1
    if sessions.data_dir is not None and sessions.checkpoint_every_s is None:
        sessions.checkpoint_every_s = 5.0  # a shared data dir: sessions outlive their replica
    config.served_model_name = config.served_model_name or args.model
    spec = ReplicaSpec(from_args(EngineConfig, args), config, sessions, breaker if config.breaker else None,
                       from_args(AuditConfig, args), cluster.torch_threads, cluster.summary_size, health)
    try:
        deployment.start(spec, cluster, config.host, config.port)
        # after ray.init, which installs its own SIGTERM handler in the driver: SIGTERM drains like Ctrl-C
        signal.signal(signal.SIGTERM, _interrupt)
        stderr(f"serving {config.served_model_name} with {cluster.replicas} replicas on Ray Serve "
               f"(router: {cluster.router}) on http://{config.host}:{config.port}/v1")
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        deployment.stop()
    return EXIT_OK


def _interrupt(*_):
    raise KeyboardInterrupt


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
