"""The drafter: proposes drafts for decode rows, adapts each sequence's draft length from the cost model, records
and verifies drafts (see the package docstring)."""

from __future__ import annotations

from collections import deque

import torch

from ..engine.sequence import Sequence
from .config import SpeculativeConfig
from .cost_model import StepCost, best_length
from .metrics import PAUSE_TOKENS, SpecState, SpecStats
from .ngram_proposer import NgramIndex
from .prediction_proposer import from_prediction
from .suffix_proposer import SuffixTable
from .verify import verify

MAX_PAUSE_TOKENS = 512
DECAY = 0.85  # weight of a sequence's earlier acceptance counts at each verify step
PRIOR = {"lookup": (1.0, 1.0), "prediction": (4.0, 1.0)}  # (accepted, rejected) pseudo-counts of a new estimate
PREDICTION_TOKENS = 8  # draft length for a request's prediction when the engine runs without --speculative-config


class Drafter:
    """Proposes drafts for decode rows and adapts each sequence's draft length (see the module docstring).

    config: the engine's :class:`SpeculativeConfig` (None: only requests that send a prediction draft, up to
    :data:`PREDICTION_TOKENS` tokens, n-grams of 1 to 4 tokens for re-synchronising).
    """

    def __init__(self, config: SpeculativeConfig | None):
        self.config = config
        self.max_k = config.num_speculative_tokens if config is not None else PREDICTION_TOKENS
        self.n_min = config.prompt_lookup_min if config is not None else 2
        self.n_max = config.prompt_lookup_max if config is not None else 4
        self.stats = SpecStats(accepted_per_position=[0] * self.max_k)
        self.cost = StepCost()
        # method "suffix": one SuffixTable per cache namespace (its key), and the documents they hold, oldest first
        self.suffix = config is not None and config.method == "suffix"
        self.tables: dict[str, SuffixTable] = {}
        self.table_docs: deque[tuple[str, list[int]]] = deque()

    def describe(self, supported: bool = True) -> str:
        """What speculative decoding runs, in words (the load line's); ``supported``: the engine can verify."""
        if not supported:
            return "no speculative decoding (hybrid KV cache)"
        return self.config.describe() if self.config is not None else "speculative decoding from predictions only"

    def start(self, seq: Sequence, prediction: list[int] | None, supported: bool) -> None:
        """Give ``seq`` its :class:`SpecState` when it will draft: its request did not opt out
        (``params.speculative``), the engine can verify it (``supported``) and there is a source (an n-gram
        config, or a non-empty prediction)."""
        if not (seq.params.speculative and supported) or (self.config is None and not prediction):
            return
        st = SpecState(*PRIOR["prediction" if prediction else "lookup"])
        if self.config is not None:
            st.lookup = NgramIndex(self.n_min, self.n_max)
        if prediction:
            st.prediction = list(prediction)
            st.pred_index = NgramIndex(1, self.n_max)
            st.pred_index.sync(st.prediction, len(st.prediction))
        seq.spec = st

    def propose(self, seq: Sequence, budget: int, batch: int) -> list[int]:
        """Draft tokens for ``seq``'s next decode row (``[]``: plain decode): as many as make a step of ``batch``
        running sequences fastest in tokens per second (:meth:`length`), what ``budget`` tokens of the step allow
        beside its own and what its ``max_tokens`` leaves room for."""
        st = seq.spec
        seq.spec_tokens = []
        if st is None or seq.num_uncomputed != 1 or not seq.num_output_tokens:
            return []
        gate = self.config.disable_by_batch_size if self.config is not None else None
        if (gate is not None and batch > gate) or seq.num_output_tokens < st.paused_until:
            return []
        room = min(self.length(st, batch), budget - 1, seq.max_total_tokens - len(seq.token_ids))  # (may end it)
        if room < 1:
            self._pause(seq, st)
            return []
        drafts = from_prediction(seq, st, room)
        st.source = "prediction" if drafts else ""
        if not drafts and st.lookup is not None:
            toks = seq.token_ids
            st.lookup.sync(toks, len(toks) - 1)
            end = st.lookup.latest(toks, room)
            drafts = toks[end:end + room] if end is not None else []
            st.source = "lookup" if drafts else ""
        if not drafts and self.suffix:
            table = self.tables.get(seq.namespace.key)  # this namespace's (tenant's) table only
            if table is not None:
                drafts = table.draft(seq.token_ids, room, self.config.suffix_decoding_min_token_prob)
                st.source = "suffix" if drafts else ""
        return drafts

    def finish(self, seq: Sequence) -> None:
        """Method "suffix": add a finished sequence's tokens to its namespace's :class:`SuffixTable` (the prompt
        from a few tokens before its prefix-cache hit: what earlier requests added already is not counted twice, so
        a session's turn adds its new message and its reply), dropping the oldest documents beyond
        ``suffix_decoding_max_cached_requests``.  Only sequences that drafted (``seq.spec``: not opted out) and
        ended normally (stop, length) are added."""
        if not self.suffix or seq.spec is None or seq.finish_reason not in ("stop", "length"):
            return
        start = max(0, (seq.num_cached_tokens or 0) - self.n_max)
        doc = list(seq.token_ids[start:])
        key = seq.namespace.key
        table = self.tables.get(key)
        if table is None:
            table = self.tables[key] = SuffixTable(self.n_min, self.n_max)
        table.add(doc)
        self.table_docs.append((key, doc))
        while len(self.table_docs) > self.config.suffix_decoding_max_cached_requests:
            old_key, old = self.table_docs.popleft()
            t = self.tables[old_key]
            t.add(old, -1)
            if t.docs == 0:
                del self.tables[old_key]

    def length(self, st: SpecState, batch: int) -> int:
        """The draft length that makes the step's tokens per second highest for ``st``'s sequence in a step of
        ``batch`` sequences (:func:`~kvkeeper.spec_decode.cost_model.best_length`); ``max_k`` when the config is
        not adaptive (the counts then depend on the tokens only)."""
        if self.config is not None and not self.config.adaptive:
            return self.max_k
        return best_length(st.rate, self.cost, batch, self.max_k)

    def _pause(self, seq: Sequence, st: SpecState) -> None:
        """No draft is worth its row now: none for a pause (doubling), then a fresh start from the prior."""
        st.paused_until = seq.num_output_tokens + st.pause
        st.pause = min(MAX_PAUSE_TOKENS, 2 * st.pause)
        st.hits, st.misses = PRIOR["prediction" if st.prediction else "lookup"]

    def record(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """Count one verified draft: the engine's counters, the sequence's, and its acceptance estimate (``accepted``
        successes, then one failure unless every draft was accepted)."""
        st, s = seq.spec, self.stats
        st.drafted += drafted
        st.accepted += accepted
        if st.source == "prediction":
            st.prediction_accepted += accepted
            st.prediction_rejected += drafted - accepted
        s.num_drafts += 1
        s.num_draft_tokens += drafted
        s.num_accepted_tokens += accepted
        for i in range(accepted):
            s.accepted_per_position[i] += 1
        st.hits = DECAY * st.hits + accepted
        st.misses = DECAY * st.misses + (accepted < drafted)



    def verify(self, seq: Sequence, logits: torch.Tensor, processor, kv) -> list[Sequence]:
        """Take a verify row's tokens (:func:`~kvkeeper.spec_decode.verify.verify`), count them, then count as
        computed the K/V of the tokens emitted but the last (the accepted drafts'), give back the blocks only the
        rejected drafts used and register the blocks that became full; returns ``[seq]`` when it finished.

        logits: (k + 1, vocab) float32, the rows of the token before the k drafts and of each draft.  processor: the
        engine's :class:`~kvkeeper.engine.output_processor.OutputProcessor`; kv: its
        :class:`~kvkeeper.kvcache.manager.KVCacheManager`.  The caller finishes the sequences returned."""
        drafts, c = seq.spec_tokens, seq.num_computed - 1
        seq.spec_tokens = []
        got = verify(seq, logits, drafts, processor)
        self.record(seq, len(drafts), got.accepted)
        seq.num_computed = c + max(1, got.emitted)
        kv.trim_to_computed(seq)
        kv.commit(seq)
        return got.finished

    def observe_step(self, scheduled: list[tuple[Sequence, int]], num_tokens: int, seconds: float) -> None:
        """Feed the cost model a step's time when the step held decode rows only (each of 1 + its drafts' tokens)."""
        if all(s.num_output_tokens and n == 1 + len(s.spec_tokens) for s, n in scheduled):
            self.cost.observe(num_tokens, seconds)
