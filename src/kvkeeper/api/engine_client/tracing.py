"""OpenTelemetry traces of served requests (off by default).

Each finished request becomes one span named ``"{operation} {model}"`` (kind SERVER)
with, per choice, three child spans laid end to end:

* ``queued``  -- arrival to the first admission by the scheduler;
* ``prefill`` -- admission to the first output token (TTFT minus queueing);
* ``decode``  -- first to last output token.

Spans are written when the request finishes, from the timestamps the engine keeps
on each :class:`~kvkeeper.engine.sequence.Sequence` (``time.perf_counter`` seconds,
converted to epoch nanoseconds), so tracing adds nothing to the step loop while a
request runs.  Attributes follow the OpenTelemetry GenAI semantic conventions
(``gen_ai.operation.name``, ``gen_ai.provider.name``, ``gen_ai.request.*``,
``gen_ai.response.*``, ``gen_ai.usage.*``), plus ``kvkeeper.*`` for what those
conventions do not name (cached prompt tokens, session, preemptions).  The cache
salt itself is never written to a trace, only whether one was set.

Exporters: ``console`` (JSON lines on stdout) or ``otlp`` (OTLP over HTTP/protobuf,
needs the ``otlp`` extra: ``pip install 'kvkeeper[otlp]'``; the endpoint comes from
``--otlp-traces-endpoint`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from opentelemetry.trace import Tracer

EXPORTERS = ("none", "console", "otlp")
_PROVIDERS: list = []  # the tracer providers configure_tracing built (flushed by flush_traces at shutdown)


def configure_tracing(exporter: str = "none", endpoint: str | None = None,
                      service_name: str = "kvkeeper") -> "Tracer | None":
    """Build a tracer for ``exporter`` ("none", "console" or "otlp"); None for "none".

    The provider is private to the server (the global OpenTelemetry provider is not touched).
    Raises ValueError for an unknown exporter and ImportError, with the install line, when the
    OTLP exporter package is missing.
    """
    if exporter not in EXPORTERS:
        raise ValueError(f"unknown trace exporter {exporter!r}; choose one of {', '.join(EXPORTERS)}")
    if exporter == "none":
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if exporter == "console":
        span_exporter = ConsoleSpanExporter()
    else:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as e:
            raise ImportError("the OTLP trace exporter is not installed: pip install 'kvkeeper[otlp]' "
                              "(opentelemetry-exporter-otlp-proto-http)") from e
        span_exporter = OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(span_exporter))
    _PROVIDERS.append(provider)
    return provider.get_tracer("kvkeeper.api")


def flush_traces(timeout_ms: int = 5000) -> None:
    """Export the spans still queued in every provider :func:`configure_tracing` built (waits up to
    ``timeout_ms`` milliseconds each).  The server calls it when it stops: on SIGTERM uvicorn re-raises the
    signal after its shutdown, so the provider's own exit hook would never run and the last spans were lost."""
    for provider in _PROVIDERS:
        provider.force_flush(timeout_ms)


def _ns(perf_s: float, offset_s: float) -> int:
    return int((perf_s + offset_s) * 1e9)


class RequestTracer:
    """Turns a finished request's sequences into spans on ``tracer``."""

    def __init__(self, tracer: "Tracer", model_name: str):
        self.tracer = tracer
        self.model_name = model_name

    def record(self, request_id: str, operation: str, seqs: list, usage, session_id: str | None,
               salted: bool) -> None:
        """Write the spans of one finished request.

        seqs: its finished sequences (one per choice).  usage: the request's Usage.
        operation: "chat" or "text_completion".
        """
        from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

        offset = time.time() - time.perf_counter()
        now = time.perf_counter()
        start = min(s.t_arrival for s in seqs)
        end = max((s.t_finished or now) for s in seqs)
        attrs = self._attributes(request_id, operation, seqs, usage, session_id, salted)
        root = self.tracer.start_span(f"{operation} {self.model_name}", kind=SpanKind.SERVER, attributes=attrs,
                                      start_time=_ns(start, offset))
        if any(s.finish_reason == "error" for s in seqs):
            root.set_status(Status(StatusCode.ERROR, next(s.error or "error" for s in seqs
                                                          if s.finish_reason == "error")))
        ctx = set_span_in_context(root)
        for i, s in enumerate(seqs):
            self._choice_spans(ctx, i, s, offset, now)
        root.end(end_time=_ns(end, offset))

    def _attributes(self, request_id: str, operation: str, seqs: list, usage, session_id: str | None,
                    salted: bool) -> dict:
        """The root span's GenAI (and ``kvkeeper.*``) attributes."""
        p = seqs[0].params
        attrs = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "kvkeeper",
            "gen_ai.request.model": self.model_name,
            "gen_ai.request.temperature": float(p.temperature),
            "gen_ai.request.top_p": float(p.top_p),
            "gen_ai.request.choice.count": len(seqs),
            "gen_ai.response.id": request_id,
            "gen_ai.response.model": self.model_name,
            "gen_ai.response.finish_reasons": [s.finish_reason or "unknown" for s in seqs],
            "gen_ai.usage.input_tokens": usage.prompt_tokens,
            "gen_ai.usage.output_tokens": usage.completion_tokens,
            "kvkeeper.usage.cached_tokens": usage.cached_tokens,
            "kvkeeper.cache_salt.set": salted,
            "kvkeeper.num_preemptions": sum(s.num_preemptions for s in seqs),
        }
        if p.max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = int(p.max_tokens)
        if p.top_k:
            attrs["gen_ai.request.top_k"] = float(p.top_k)
        if p.seed is not None:
            attrs["gen_ai.request.seed"] = int(p.seed)
        if p.stop:
            attrs["gen_ai.request.stop_sequences"] = list(p.stop)
        if session_id is not None:
            attrs["kvkeeper.session.id"] = session_id
        return attrs

    def _choice_spans(self, ctx, i: int, s, offset: float, now: float) -> None:
        """The queued / prefill / decode spans of choice ``i`` (sequence ``s``), end to end."""
        t_sched = s.t_scheduled if s.t_scheduled is not None else (s.t_finished or now)
        phases = [("queued", s.t_arrival, t_sched)]
        if s.t_scheduled is not None:
            first = s.t_first_token if s.t_first_token is not None else (s.t_finished or now)
            phases.append(("prefill", s.t_scheduled, first))
            if s.t_first_token is not None:
                phases.append(("decode", s.t_first_token, s.t_last_token or s.t_first_token))
        for name, a, b in phases:
            span = self.tracer.start_span(name, context=ctx, start_time=_ns(a, offset),
                                          attributes={"kvkeeper.choice.index": i})
            if name == "prefill":
                span.set_attribute("kvkeeper.prefill.new_tokens", s.num_prompt_tokens - (s.num_cached_tokens or 0))
            elif name == "decode":
                span.set_attribute("kvkeeper.decode.output_tokens", s.num_output_tokens)
            span.end(end_time=_ns(max(a, b), offset))
