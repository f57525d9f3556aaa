"""``kvkeeper serve``: wire an engine, its sessions, breaker, audit and tracing into the HTTP app, run uvicorn.

The engine layers know nothing of each other above them: this module is where the session
manager (with its offload tiers), the circuit breaker, the reuse auditor and the tracer are
attached to the engine and handed to the app.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..argtypes import port as port_number, positive_int, size
from ..diagnostics.audit import AuditConfig, ReuseAuditor
from ..diagnostics.health import ForecastFeed, HealthConfig, HealthMonitor, gates_from_breaker
from ..diagnostics.health_predict import (GbtPredictor, Limits, LstmPredictor, TrendConfig, TrendPredictor,
                                          TreesAndTrendPredictor)
from ..sessions.breaker import BreakerConfig, CircuitBreaker
from ..options import option
from ..sessions.manager import SessionConfig, SessionManager
from .common.errors import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE
from .engine_client.tracing import EXPORTERS, RequestTracer, configure_tracing
from .common.context import SESSION_HEADERS
from ..engine.handle import EngineHandle

if TYPE_CHECKING:
    from .common.auth import KeyRing

log = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    """HTTP server settings (bytes, tokens, seconds).  ``breaker``: watch KV memory (False: no circuit breaker)."""

    host: str = field(default="127.0.0.1", metadata=option("--host", "address to bind"))
    port: int = field(default=8000, metadata=option("--port", "TCP port, 1..65535", type=port_number))
    served_model_name: str | None = field(default=None, metadata=option(
        "--served-model-name", "the model id clients send and /v1/models lists (default: the --model value)",
        metavar="NAME"))
    max_queue: int = field(default=DEFAULT_MAX_QUEUE, metadata=option(
        "--max-queue", "requests that may wait before new ones get 503", type=positive_int, metavar="N"))
    max_body_bytes: int = field(default=DEFAULT_MAX_BODY_BYTES, metadata=option(
        "--max-body-bytes", "larger request bodies get 413, suffixes K/M/G allowed (default: 4M)", type=size,
        metavar="N"))
    max_new_tokens: int | None = field(default=None, metadata=option(
        "--max-new-tokens", "most tokens one choice may generate; larger or omitted max_tokens are cut to N "
        "(default: the rest of the context)", type=positive_int, metavar="N"))
    otel_traces: str = field(default="none", metadata=option(
        "--otel-traces", "OpenTelemetry request traces: none, console (stdout) or otlp (OTLP/HTTP)",
        choices=list(EXPORTERS)))
    otlp_traces_endpoint: str | None = field(default=None, metadata=option(
        "--otlp-traces-endpoint", "OTLP/HTTP traces endpoint, e.g. http://127.0.0.1:4318/v1/traces "
        "(implies --otel-traces otlp)", metavar="URL"))
    breaker: bool = field(default=True, metadata=option(
        "--no-breaker", "do not watch KV memory (no compaction/offload/degrade)", action="store_true", negate=True))
    access_log: bool = field(default=True, metadata=option(
        "--no-access-log", "write no access-log line per request (method, path, status, tokens, ms) on stderr",
        action="store_true", negate=True))
    refuse_unknown_fields: bool = field(default=True, metadata=option(
        "--ignore-unknown-fields", "ignore request fields this server does not know, instead of answering 400 "
        "naming them (for clients that send extra fields)", action="store_true", negate=True))
    api_key: str | None = field(default=None, repr=False, metadata=option(
        "--api-key", "one admin API key: every route but /health, /metrics and /openapi.json needs 'Authorization: "
        "Bearer KEY' (default: $KVKEEPER_API_KEY; without keys every client may use every session)", metavar="KEY"))
    api_keys_file: str | None = field(default=None, metadata=option(
        "--api-keys-file", "API keys of several tenants, JSON or TOML: key -> tenant, admin, max_sessions, "
        "max_pinned_blocks (README: Tenants and API keys)", metavar="FILE"))
    admin_port: int | None = field(default=None, metadata=option(
        "--admin-port", "serve /admin/* on this port of 127.0.0.1 only, not on --port", type=port_number,
        metavar="PORT"))
    lora_modules: list[str] = field(default_factory=list, metadata=option(
        "--lora-modules", "LoRA adapters (PEFT directories) to load at start, selected by NAME in a request's "
        "model field; repeatable", nargs="+", action="extend", metavar="NAME=PATH"))
    allow_runtime_lora: bool = field(default=False, metadata=option(
        "--allow-runtime-lora", "allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (they read "
        "directories on this machine)", action="store_true"))
    session_headers: list[str] = field(default_factory=lambda: list(SESSION_HEADERS), metadata=option(
        "--session-headers", "the request headers that name a session (X-Session-ID's meaning), first found wins: "
        "coding agents send their own (Claude Code X-Claude-Code-Session-Id, Codex CLI session-id)", nargs="+",
        metavar="HEADER"))
    log_level: str = "warning"

    @property
    def trace_exporter(self) -> str:
        return "otlp" if self.otlp_traces_endpoint else self.otel_traces

    def key_ring(self) -> KeyRing | None:
        """The API keys of ``api_key`` and ``api_keys_file`` (both: one ring), None for none.
        Raises :class:`~kvkeeper.api.common.auth.KeysFileError` (a ValueError) for a bad key or keys file."""
        from .common.auth import DEFAULT_TENANT, Caller, KeyRing, load_keys_file

        keys = load_keys_file(self.api_keys_file) if self.api_keys_file else {}
        if self.api_key is not None:
            keys[self.api_key] = Caller(DEFAULT_TENANT, True, None)
        return KeyRing(keys) if keys else None


def breach_forecaster(health: HealthConfig, breaker: BreakerConfig):
    """The server's breach forecaster (``--health-predictor``), None for ``none``: the trend forecast against the
    breaker's usage threshold and the TTFT objective (on the TTFT p99 of the last 10 s, which the detector's
    :class:`~kvkeeper.diagnostics.health.ForecastFeed` measures as the generated incidents do), the shipped
    boosted trees alone or backed by the trend's forecast of an imminent breach (``gbt_trend``), or the learned
    LSTM."""
    if health.predictor == "none":
        return None
    if health.predictor == "lstm":
        return LstmPredictor()
    if health.predictor == "gbt":
        return GbtPredictor()
    limits = Limits(usage=breaker.usage_threshold, ttft_p99=health.ttft_objective_s)
    if health.predictor == "gbt_trend":
        return TreesAndTrendPredictor(GbtPredictor(), limits=limits)
    return TrendPredictor(TrendConfig(limits=limits, ttft_field="ttft_p99"))


def build_server(engine: EngineHandle, config: ServerConfig | None = None, sessions: SessionConfig | None = None,
                 breaker: BreakerConfig | None = None, audit: AuditConfig | None = None,
                 health: HealthConfig | None = None):
    """The FastAPI app serving ``engine`` (an :class:`LLMEngine`), with its parts attached.

    sessions: the offload tiers of the server's sessions; breaker: the circuit breaker's thresholds
    (used when ``config.breaker``); audit: the reuse audit's sample; health: the cache-health detector's
    settings (its gates follow the breaker's thresholds; its warnings are the breaker's early signal);
    ``config.lora_modules``: LoRA adapters loaded first.  With ``config.admin_port`` the ``/admin/*`` routes
    are left out of the app and served by ``app.state.admin_app`` (:func:`run_server`).  Logs a warning when
    the server has no API keys.  Raises ValueError for an unknown trace exporter, a bad API key or keys file,
    a malformed ``--lora-modules`` entry or an engine that already serves an app (one server per engine: a
    second one would run its sessions, breaker and audit hooks twice), ImportError when the OTLP exporter is
    missing, and InvalidRequestError for an adapter that cannot be loaded.
    """
    from .common.access_log import configure_access_log  # FastAPI: imported when an app is built, not with the config
    from .app import create_admin_app, create_app
    from .engine_client.async_engine import AsyncEngine

    if any(isinstance(h, SessionManager) for h in engine.kv.holders):
        raise ValueError("this engine already has a session manager (it serves an app already): build one server "
                         "per engine")
    config = config or ServerConfig()
    keys = config.key_ring()  # before anything is attached to the engine
    if keys is None:
        log.warning("no API keys (--api-key, --api-keys-file): every client can read, list and delete every "
                    "session and use /admin; fine on a machine of your own, not on a shared network")
    name = config.served_model_name or engine.model_name
    for name_path in config.lora_modules:  # before anything attaches: a bad adapter stops the start
        lora_name, sep, path = name_path.partition("=")
        if not sep or not lora_name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, got {name_path!r}")
        if lora_name == name:
            raise ValueError(f"--lora-modules: {lora_name!r} is the served model's name; name the adapter otherwise")
        engine.load_lora(lora_name, path)
    manager = SessionManager(engine, sessions or SessionConfig())
    breaker = breaker or BreakerConfig()
    br = CircuitBreaker(engine, manager, breaker) if config.breaker else None
    monitor = HealthMonitor(gates_from_breaker(health or HealthConfig(), breaker))
    monitor.forecaster = breach_forecaster(monitor.config, breaker)
    monitor.feed = ForecastFeed(engine, manager, br)
    if br is not None:
        br.early_warning = monitor.active_signals
        br.forecast = lambda: monitor.forecast
    auditor = ReuseAuditor.from_config(audit or AuditConfig()).attach(engine)
    tracer = configure_tracing(config.trace_exporter, config.otlp_traces_endpoint)
    aeng = AsyncEngine(engine, manager, max_queue=config.max_queue, max_new_tokens=config.max_new_tokens,
                       tracer=RequestTracer(tracer, name) if tracer is not None else None, breaker=br, auditor=auditor,
                       health=monitor)
    configure_access_log(config.access_log)
    app = create_app(aeng, name, config.max_body_bytes, config.refuse_unknown_fields, keys,
                     admin_routes=config.admin_port is None)
    app.state.admin_app = create_admin_app(aeng, keys) if config.admin_port is not None else None
    app.state.allow_runtime_lora = config.allow_runtime_lora
    app.state.session_headers = tuple(config.session_headers)
    return app


ADMIN_HOST = "127.0.0.1"  # the admin app's address (--admin-port): this machine only


def run_server(app, config: ServerConfig) -> None:
    """Serve ``app`` (from :func:`build_server`) on uvicorn until interrupted (SIGINT / SIGTERM); its admin app,
    when it has one, on ``ADMIN_HOST:config.admin_port`` from a daemon thread (ended with the process)."""
    import threading

    import uvicorn

    level = config.log_level
    admin = getattr(app.state, "admin_app", None)
    if admin is not None:
        server = uvicorn.Server(uvicorn.Config(admin, host=ADMIN_HOST, port=config.admin_port, log_level=level,
                                               access_log=level in ("info", "debug"), lifespan="off"))
        threading.Thread(target=server.run, name="kvkeeper-admin", daemon=True).start()
    uvicorn.run(app, host=config.host, port=config.port, log_level=level, access_log=level in ("info", "debug"),
                ws="none")  # no websocket routes: uvicorn's websocket protocols are not imported
