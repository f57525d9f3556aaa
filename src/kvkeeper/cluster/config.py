"""Options of ``kvkeeper serve --replicas N`` (no Ray import: the CLI reads them before choosing a server)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..argtypes import positive_int
from ..options import option

DEFAULT_SUMMARY_SIZE = 2048  # block hashes a replica publishes at most (kvkeeper.cluster.router; defined here so
# that the command line's options import neither the router nor prometheus_client)

ROUTERS = ("kvkeeper", "default")


def _positive_float(raw: str) -> float:
    v = float(raw)
    if not v > 0:
        raise ValueError(f"must be > 0, got {raw}")
    return v


@dataclass
class ClusterConfig:
    """Ray Serve deployment of N engine replicas (CPUs per replica, seconds, hashes)."""

    replicas: int | None = field(default=None, metadata=option(
        "--replicas", "serve with N engine replicas on Ray Serve behind its HTTP proxy (needs kvkeeper[cluster]; "
        "default: one process, no Ray)", type=positive_int, metavar="N"))
    ray_address: str | None = field(default=None, metadata=option(
        "--ray-address", "join this Ray cluster (e.g. auto, or ray://HEAD:10001) instead of starting a local one",
        metavar="ADDR"))
    replica_cpus: float = field(default=1.0, metadata=option(
        "--replica-cpus", "CPUs Ray reserves per replica (two replicas of 1 fit on 2 cores)", type=_positive_float,
        metavar="C"))
    torch_threads: int = field(default=1, metadata=option(
        "--torch-threads", "torch threads per replica", type=positive_int, metavar="N"))
    router: str = field(default="kvkeeper", metadata=option(
        "--router", "request router: kvkeeper (session, prefix, then load) or default (Ray Serve's power of two "
        "choices)", choices=ROUTERS))
    affinity_wait_s: float = field(default=2.0, metadata=option(
        "--affinity-wait-s", "seconds a request routed by affinity (session, prompt_cache_key, cached prefix) waits "
        "for its replica before the other replicas are offered (default: 2; longer on a busy machine keeps sessions "
        "home, shorter moves them sooner)", type=_positive_float, metavar="S"))
    routing_stats_period_s: float = 1.0
    summary_size: int = DEFAULT_SUMMARY_SIZE
    max_ongoing_requests: int = 64
    retry_after_s: int = 2


@dataclass
class ReplicaSpec:
    """What one engine replica is built from: the engine, server, session, breaker, audit and health configs."""

    engine: Any
    server: Any
    sessions: Any
    breaker: Any = None
    audit: Any = None
    torch_threads: int = 1
    summary_size: int = DEFAULT_SUMMARY_SIZE
    health: Any = None
