"""KV events of N replicas (``kvkeeper serve --replicas N --kv-events-config '{...}'``): one endpoint pair each.

The command line's ``--kv-events-config`` names one PUB endpoint (and optionally one replay endpoint); a cluster
has N publishers, so each replica binds its own pair, derived from its rank on its node (Ray Serve's
``local_rank``, 0..N-1):

* ``tcp://HOST:PORT`` -- replica r binds ``PORT + 2r`` (and the replay endpoint's ``PORT + 2r``): with vLLM's usual
  pair (5557 and 5558) replica 0 binds 5557/5558, replica 1 5559/5560, and so on.  Port 0 lets each replica take a
  free port of the system's.
* ``ipc://PATH`` -- replica r binds ``PATH-r``.

Each replica advertises the endpoints it bound in its routing stats (a wildcard host, ``*`` or ``0.0.0.0``,
replaced by its node's address), and the router subscribes to them.  :func:`check_cluster_events` refuses, before
anything starts, a configuration whose replicas could not all bind: naming the field and how to fix it.
"""

from __future__ import annotations

import dataclasses
import re

from ..kvcache.kv_events.publisher import KVEventsConfig
from ..errors import InvalidRequestError

PORT_STRIDE = 2  # replica r binds the configured ports + PORT_STRIDE * r
_TCP = re.compile(r"^tcp://(\[[^\]]*\]|[^:/\[\]]+):(\d+)$")
_WILDCARD = ("*", "0.0.0.0", "[::]", "::")


def _bad(name: str, why: str):
    raise InvalidRequestError(f"--kv-events-config: {name} {why}", param="kv_events_config")


def _split(endpoint: str, name: str) -> tuple[str, str, int | None]:
    """(scheme, host or path, port or None) of an endpoint a cluster's replicas can each bind a copy of."""
    if endpoint.startswith("ipc://"):
        if len(endpoint) <= len("ipc://"):
            _bad(name, f"needs a path after ipc://, got {endpoint!r}")
        return "ipc", endpoint[len("ipc://"):], None
    m = _TCP.match(endpoint)
    if m is None:
        _bad(name, f"must be tcp://HOST:PORT or ipc://PATH with --replicas (each replica binds its own copy: "
                   f"PORT + {PORT_STRIDE} x its rank, or PATH-rank), got {endpoint!r}")
    port = int(m.group(2))
    if port > 65535:
        _bad(name, f"port {port} is not a TCP port (0..65535)")
    return "tcp", m.group(1), port


def check_cluster_events(cfg: KVEventsConfig, replicas: int) -> None:
    """Refuse (InvalidRequestError naming the field) an active ``cfg`` whose endpoints ``replicas`` replicas on
    one node cannot all bind: not tcp:// or ipc://, a port range past 65535, or replay ports that fall on
    another replica's PUB port.  A config that is off passes."""
    if not cfg.active:
        return
    spans = {}
    for name in ("endpoint", "replay_endpoint"):
        ep = getattr(cfg, name)
        if ep is None:
            continue
        scheme, _, port = _split(ep, name)
        if scheme == "tcp" and port:
            last = port + PORT_STRIDE * (replicas - 1)
            if last > 65535:
                _bad(name, f"port {port}: replica {replicas - 1} of {replicas} would bind port {last} (port + "
                           f"{PORT_STRIDE} x rank), past 65535; give a lower port, or 0 for free ports")
            spans[name] = port
    if len(spans) == 2:
        p, r = spans["endpoint"], spans["replay_endpoint"]
        if (r - p) % PORT_STRIDE == 0 and abs(r - p) < PORT_STRIDE * replicas:
            _bad("replay_endpoint", f"port {r}: with {replicas} replicas a replay port would be another replica's "
                                    f"endpoint port (replica r binds endpoint port {p} + {PORT_STRIDE}r and replay "
                                    f"port {r} + {PORT_STRIDE}r); give it port {p + 1}, or one at least "
                                    f"{PORT_STRIDE * replicas} away from {p}")


def _for_rank(endpoint: str | None, rank: int) -> str | None:
    if endpoint is None:
        return None
    if endpoint.startswith("ipc://"):
        return f"{endpoint}-{rank}"
    m = _TCP.match(endpoint)
    if m is None:  # checked by check_cluster_events; left as it is
        return endpoint
    port = int(m.group(2))
    return f"tcp://{m.group(1)}:{port + PORT_STRIDE * rank if port else 0}"


def replica_config(cfg: KVEventsConfig, local_rank: int) -> KVEventsConfig:
    """The copy of ``cfg`` the replica of rank ``local_rank`` on its node binds (module docstring)."""
    return dataclasses.replace(cfg, endpoint=_for_rank(cfg.endpoint, local_rank),
                               replay_endpoint=_for_rank(cfg.replay_endpoint, local_rank))


def advertised(bound: str | None, node_ip: str) -> str | None:
    """A bound endpoint as others reach it: a wildcard host (``*``, ``0.0.0.0``, ``[::]``) replaced by ``node_ip``."""
    if bound is None:
        return None
    m = _TCP.match(bound)
    if m is None or m.group(1) not in _WILDCARD:
        return bound
    host = f"[{node_ip}]" if ":" in node_ip else node_ip
    return f"tcp://{host}:{m.group(2)}"
