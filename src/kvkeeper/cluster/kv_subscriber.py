"""Following replicas' KV event streams (ZMQ SUB plus replay, :mod:`kvkeeper.kvcache.kv_events.publisher`) into a
:class:`~kvkeeper.cluster.kv_index.KVIndex`.

One SUB socket per replica (its ``endpoint``, subscribed to its ``topic``) and, when it has one, a DEALER on its
``replay_endpoint``.  Per replica the subscriber keeps the last sequence number applied and the timestamp of
that batch, and resyncs through the replay socket:

* the first batch it sees is not seq 0 (it started after the replica): replay from 0;
* a gap (seq > last + 1): replay from last + 1;
* a seq at or below the last one with a newer timestamp: the replica restarted (its publisher counts from 0
  again, and its batch 0 starts with ``AllBlocksCleared``): apply seq 0 as it comes, else replay from 0;
  an older timestamp is a batch already applied (a replay and the live stream overlap): skipped.

A replay covers what the publisher still keeps (``buffer_steps`` batches); ``incomplete`` counts the resyncs
that could not reach back far enough (that replica's entries may then miss blocks, which costs prefix hits,
never correctness: a replica checks every hit against its own cache).  pyzmq is imported when one starts.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass

from ..kvcache.kv_events.wire import decode_batch
from .kv_index import KVIndex

log = logging.getLogger(__name__)

END_SEQ = -1


@dataclass
class Feed:
    """One replica's event stream: its id in the index, the PUB endpoint, the replay endpoint, the topic."""

    replica: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


class _State:
    def __init__(self):
        self.seq: int | None = None
        self.ts = float("-inf")


class KVEventSubscriber:
    """Applies every feed's batches to ``index`` from a thread of its own (:meth:`start`, :meth:`close`), or
    step by step with :meth:`poll` (tests, the simulator).  ``lock`` guards the index: hold it while reading.
    :meth:`follow` and :meth:`forget` add and drop replicas from any thread (a router learns of replicas as they
    come and go); the subscriber's own thread (or the next :meth:`poll`) applies them.

    Counters: ``batches`` (applied), ``replays`` (resyncs asked for), ``incomplete`` (resyncs the publisher's
    buffer could not cover), ``skipped`` (batches seen twice).
    """

    def __init__(self, index: KVIndex, feeds: list[Feed], replay_timeout_s: float = 2.0):
        import zmq

        self._zmq = zmq
        self.index = index
        self.lock = threading.Lock()
        self.replay_timeout_ms = int(replay_timeout_s * 1000)
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        self._subs: dict[object, Feed] = {}
        self._state: dict[str, _State] = {}
        self.batches = self.replays = self.incomplete = self.skipped = 0
        self._changes: deque[tuple[str, object]] = deque()  # ("follow", Feed) / ("forget", replica), any thread
        for f in feeds:
            self.add(f)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, feed: Feed) -> None:
        """Follow one more replica (call before :meth:`start`, or from the subscriber's own thread)."""
        sub = self.ctx.socket(self._zmq.SUB)
        sub.setsockopt(self._zmq.LINGER, 0)
        sub.setsockopt(self._zmq.SUBSCRIBE, feed.topic.encode())
        sub.connect(feed.endpoint)
        self._subs[sub] = feed
        self._state[feed.replica] = _State()
        self.poller.register(sub, self._zmq.POLLIN)

    def follow(self, feed: Feed) -> None:
        """Follow ``feed`` from any thread (a replica already followed under that id is dropped first, its blocks
        forgotten): applied by the subscriber's thread within one poll period."""
        self._changes.append(("follow", feed))

    def forget(self, replica: str) -> None:
        """Stop following ``replica`` and drop its blocks from the index, from any thread (as :meth:`follow`)."""
        self._changes.append(("forget", replica))

    @property
    def followed(self) -> list[str]:
        """The replicas followed now (their ids in the index)."""
        return [f.replica for f in list(self._subs.values())]

    def _apply_changes(self) -> None:
        while self._changes:
            what, arg = self._changes.popleft()
            replica = arg.replica if what == "follow" else arg
            for sock, feed in list(self._subs.items()):
                if feed.replica == replica:
                    self.poller.unregister(sock)
                    sock.close(linger=0)
                    del self._subs[sock]
            self._state.pop(replica, None)
            with self.lock:
                self.index.remove_replica(replica)
            if what == "follow":
                self.add(arg)

    def _replay(self, feed: Feed, start: int) -> None:
        st = self._state[feed.replica]
        if feed.replay_endpoint is None:
            self.incomplete += 1
            return
        self.replays += 1
        dealer = self.ctx.socket(self._zmq.DEALER)
        dealer.setsockopt(self._zmq.LINGER, 0)
        dealer.connect(feed.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
            first = True
            while dealer.poll(self.replay_timeout_ms):
                _, seq_b, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq == END_SEQ:
                    return
                if first and seq > start:
                    self.incomplete += 1
                    log.warning("KV events of %s: replay starts at %d, not %d (raise buffer_steps)", feed.replica,
                                seq, start)
                first = False
                self._apply(feed, seq, payload, st)
            self.incomplete += 1
            log.warning("KV events of %s: the replay socket did not answer", feed.replica)
        finally:
            dealer.close(linger=0)

    def _apply(self, feed: Feed, seq: int, payload: bytes, st: _State) -> None:
        batch = decode_batch(payload)
        with self.lock:
            self.index.apply(feed.replica, batch)
        st.seq, st.ts = seq, batch.ts
        self.batches += 1

    def _on_message(self, feed: Feed, seq: int, payload: bytes) -> None:
        st = self._state[feed.replica]
        if st.seq is None:
            if seq == 0:
                return self._apply(feed, seq, payload, st)
            return self._replay(feed, 0)
        if seq == st.seq + 1:
            return self._apply(feed, seq, payload, st)
        if seq > st.seq + 1:
            return self._replay(feed, st.seq + 1)
        ts = decode_batch(payload).ts
        if ts <= st.ts:
            self.skipped += 1
            return None
        if seq == 0:  # the replica restarted
            return self._apply(feed, seq, payload, st)
        return self._replay(feed, 0)

    def poll(self, timeout_ms: int = 0) -> int:
        """Handle the messages that arrive within ``timeout_ms``; returns how many were handled."""
        self._apply_changes()
        n = 0
        for sock, _ in self.poller.poll(timeout_ms):
            feed = self._subs[sock]
            while True:
                try:
                    topic, seq_b, payload = sock.recv_multipart(self._zmq.NOBLOCK)
                except self._zmq.Again:
                    break
                self._on_message(feed, int.from_bytes(seq_b, "big", signed=True), payload)
                n += 1
        return n

    def last_seq(self, replica: str) -> int | None:
        """The sequence number of the last batch applied for ``replica`` (None before any, or for a replica not
        followed)."""
        st = self._state.get(replica)
        return st.seq if st is not None else None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._subs and not self._changes:  # zmq's poll returns at once without sockets
                    self._stop.wait(0.05)
                    continue
                self.poll(50)
            except Exception:  # a bad message must not stop the router's view of every replica
                log.exception("KV event subscriber: a message could not be applied")

    def start(self) -> "KVEventSubscriber":
        self._thread = threading.Thread(target=self._run, name="kv-events-sub", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for sock in self._subs:
            sock.close(linger=0)
        self.ctx.term()
