"""Publishing an engine's KV cache events on ZMQ, as vLLM does (``--kv-events-config``).

:class:`KVEventsConfig` has vLLM's field names (``vllm.config.KVEventsConfig``): ``enable_kv_cache_events``,
``publisher`` (``"zmq"`` or ``"null"``), ``endpoint`` (the PUB socket, bound; default ``tcp://*:5557``),
``replay_endpoint`` (a ROUTER socket, bound, None for none), ``buffer_steps`` (batches kept for replay),
``hwm`` (the PUB socket's send high-water mark, messages), ``max_queue_size`` (events waiting to be sent at
most), ``topic`` (the first frame of every message); plus kvkeeper's ``include_token_ids`` (off: no token id
leaves the replica).  An unknown field or a bad value is refused (:func:`parse_kv_events_config`).

Wire protocol (vLLM's ``ZmqEventPublisher``): each batch goes out on the PUB socket as the three frames
``[topic, seq, payload]``, ``seq`` a signed 64-bit big-endian sequence number counting from 0 for each
publisher (the batch with seq 0 starts with ``AllBlocksCleared``), ``payload`` the msgpack batch of
:mod:`kvkeeper.kvcache.kv_events.wire`.  A subscriber that missed batches (it started late, it restarted, it saw a
gap in ``seq``) sends ``[start_seq]`` (8 bytes, big-endian) to the replay socket and gets ``["", seq, payload]``
for every kept batch from ``start_seq`` on, then ``["", -1, ""]``.

An idle publisher sends an empty batch (a heartbeat, with its own sequence number) every :data:`HEARTBEAT_S`
seconds, so a subscriber notices within a second that it missed batches (ZMQ drops what a PUB socket sends
before a subscriber has reconnected, as after a replica's restart) and asks for a replay.
Batches are taken from the pool's :class:`~kvkeeper.kvcache.kv_events.EventRecorder` by the publisher's own
thread as soon as events wait, so a batch holds what happened since the last one (one or a few engine steps).
pyzmq and msgpack (the ``events`` extra) are imported only when a ``zmq`` publisher starts.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

from ...errors import InvalidRequestError
from ...argtypes import parse_json_config
from .wire import EventBatch, EventRecorder, encode_batch

log = logging.getLogger(__name__)

END_SEQ = -1  # the sequence number closing a replay
HEARTBEAT_S = 1.0  # an idle publisher sends an empty batch this often (seconds): a subscriber that missed the
# last batches (a replica restarted before its subscribers reconnected) sees the gap within a second
PUBLISHERS = ("zmq", "null")
_HINT = ('e.g. --kv-events-config \'{"enable_kv_cache_events": true, "publisher": "zmq", '
         '"endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://127.0.0.1:5558"}\'')


@dataclass
class KVEventsConfig:
    """KV event publishing (vLLM's field names; counts in batches, messages and events)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # None: "zmq" when enabled, else "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    include_token_ids: bool = False

    def __post_init__(self):
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        _check(self)

    @property
    def active(self) -> bool:
        """Whether events are recorded and published (enabled, with the zmq publisher)."""
        return bool(self.enable_kv_cache_events) and self.publisher == "zmq"


def _check(cfg: KVEventsConfig) -> None:
    def bad(name: str, why: str):
        raise InvalidRequestError(f"--kv-events-config: {name} {why} ({_HINT})", param="kv_events_config")

    if not isinstance(cfg.enable_kv_cache_events, bool):
        bad("enable_kv_cache_events", f"must be true or false, got {cfg.enable_kv_cache_events!r}")
    if not isinstance(cfg.include_token_ids, bool):
        bad("include_token_ids", f"must be true or false, got {cfg.include_token_ids!r}")
    if cfg.publisher not in PUBLISHERS:
        bad("publisher", f"must be one of {', '.join(PUBLISHERS)}, got {cfg.publisher!r}")
    for name in ("endpoint", "replay_endpoint"):
        v = getattr(cfg, name)
        if v is None and name == "replay_endpoint":
            continue
        if not isinstance(v, str) or "://" not in v:
            bad(name, f"must be a ZMQ endpoint such as tcp://127.0.0.1:5557 or ipc:///tmp/kv-events, got {v!r}")
    if cfg.replay_endpoint is not None and cfg.replay_endpoint == cfg.endpoint:
        bad("replay_endpoint", "must differ from endpoint")
    for name in ("buffer_steps", "hwm", "max_queue_size"):
        v = getattr(cfg, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            bad(name, f"must be a whole number >= 1, got {v!r}")
    if not isinstance(cfg.topic, str):
        bad("topic", f"must be a string, got {cfg.topic!r}")


def parse_kv_events_config(raw) -> KVEventsConfig:
    """A :class:`KVEventsConfig` from JSON text, a dict or a config.  Raises InvalidRequestError naming the field
    that is unknown or wrong (or saying the text is not a JSON object)."""
    return parse_json_config(raw, KVEventsConfig, "--kv-events-config", _HINT, "kv_events_config")


class ZmqEventPublisher:
    """Publishes ``recorder``'s batches on a bound PUB socket, keeps the last ``buffer_steps`` for the replay socket.

    The sockets are bound here (raises InvalidRequestError when an endpoint cannot be bound: in use, bad
    address) and then used only by the publisher's thread.  :meth:`close` stops it (pending events are sent).
    Attributes: ``seq`` (the last sequence number sent, -1 before the first), ``dropped`` (events left out when
    more than ``max_queue_size`` waited).
    """

    def __init__(self, cfg: KVEventsConfig, recorder: EventRecorder):
        try:
            import msgpack  # noqa: F401  (encode_batch's)
            import zmq
        except ImportError as e:
            raise InvalidRequestError(f"--kv-events-config: the zmq publisher needs pyzmq and msgpack ({e}); install "
                                      f"them with pip install 'kvkeeper[events]'", param="kv_events_config") from None

        self.cfg, self.recorder = cfg, recorder
        self._zmq = zmq
        self.ctx = zmq.Context()
        self.pub = self.replay = None
        try:
            self.pub = self._bind(zmq.PUB, cfg.endpoint, "endpoint")
            if cfg.replay_endpoint:
                self.replay = self._bind(zmq.ROUTER, cfg.replay_endpoint, "replay_endpoint")
        except InvalidRequestError:
            for s in (self.pub, self.replay):
                if s is not None:
                    s.close(linger=0)
            self.ctx.term()
            raise
        self.topic = cfg.topic.encode()
        self.seq = -1
        self.dropped = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._last_send = time.monotonic()
        self._sending = threading.Lock()  # held from taking a batch to sending it (flushed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def _bind(self, kind, endpoint: str, name: str):
        sock = self.ctx.socket(kind)
        sock.setsockopt(self._zmq.LINGER, 0)
        if kind == self._zmq.PUB:
            sock.set_hwm(self.cfg.hwm)
        try:
            sock.bind(endpoint)
        except self._zmq.ZMQError as e:
            sock.close(linger=0)
            raise InvalidRequestError(f"--kv-events-config: cannot bind {name} {endpoint!r}: {e} (choose a free "
                                      f"port, or another address)", param="kv_events_config") from None
        return sock

    @property
    def bound_endpoint(self) -> str:
        """The PUB socket's endpoint as bound (a ``tcp://...:0`` endpoint gets its port here)."""
        return self.pub.getsockopt_string(self._zmq.LAST_ENDPOINT)

    @property
    def bound_replay_endpoint(self) -> str | None:
        return self.replay.getsockopt_string(self._zmq.LAST_ENDPOINT) if self.replay is not None else None

    def flushed(self) -> bool:
        """Whether every event recorded so far went out (has its sequence number in :attr:`seq`)."""
        with self._sending:
            return not self.recorder.pending.is_set()

    def _send_pending(self) -> None:
        with self._sending:
            self._send_batch()

    def _send_batch(self, heartbeat: bool = False) -> None:
        batch = self.recorder.take()
        if batch is None:
            if not heartbeat:
                return
            batch = EventBatch(time.time(), [])
        if len(batch.events) > self.cfg.max_queue_size:  # keep the newest (vLLM drops when its queue is full)
            self.dropped += len(batch.events) - self.cfg.max_queue_size
            log.warning("KV events: %d events over max_queue_size left out", self.dropped)
            batch.events = batch.events[-self.cfg.max_queue_size:]
        self.seq += 1
        payload = encode_batch(batch)
        self._buffer.append((self.seq, payload))
        self.pub.send_multipart([self.topic, self.seq.to_bytes(8, "big", signed=True), payload])
        self._last_send = time.monotonic()

    def _serve_replay(self) -> None:
        ident, *frames = self.replay.recv_multipart()
        try:
            start = int.from_bytes(frames[-1], "big", signed=True)
        except (IndexError, ValueError):
            start = 0
        for seq, payload in list(self._buffer):
            if seq >= start:
                self.replay.send_multipart([ident, b"", seq.to_bytes(8, "big", signed=True), payload])
        self.replay.send_multipart([ident, b"", END_SEQ.to_bytes(8, "big", signed=True), b""])

    def _run(self) -> None:
        poller = self._zmq.Poller()
        if self.replay is not None:
            poller.register(self.replay, self._zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if self.replay is not None:
                    if poller.poll(10):
                        self._serve_replay()
                else:
                    self.recorder.pending.wait(0.05)
                if time.monotonic() - self._last_send >= HEARTBEAT_S:
                    with self._sending:
                        self._send_batch(heartbeat=True)
                else:
                    self._send_pending()
            self._send_pending()
        except Exception:  # events must never take the engine down
            log.exception("the KV event publisher stopped")
        finally:
            for s in (self.pub, self.replay):
                if s is not None:
                    s.close(linger=100)

    def close(self) -> None:
        """Send what waits, stop the thread, close the sockets."""
        self._stop.set()
        self._thread.join(timeout=5)
        self.ctx.term()


def start_kv_events(pool, cfg: KVEventsConfig | None, medium: str = "CPU") -> ZmqEventPublisher | None:
    """Attach an event recorder to ``pool`` and start the publisher when ``cfg`` is active; None otherwise."""
    if cfg is None or not cfg.active:
        return None
    recorder = EventRecorder(pool.block_size, cfg.include_token_ids, medium)
    publisher = ZmqEventPublisher(cfg, recorder)  # binds first: a bad endpoint leaves the pool untouched
    pool.attach_events(recorder)
    return publisher
