"""Speculative decoding from the conversation itself: draft tokens from what the sequence already holds, verify
them in one engine step, keep what the target model would have produced.

Draft sources (cheapest first; only method "suffix" drafts from other requests, and only from those of the same
cache namespace, so no draft crosses a tenant or a cache salt):

* **Predicted Outputs** (OpenAI's ``prediction``): the text the client expects back (a file being edited),
  tokenized once; a pointer follows the output through it and re-synchronises after a divergence on the first
  later occurrence of the output's last n-gram (``prompt_lookup_max`` down to 1 token).
* **Prompt lookup** (``method: "ngram"``, as vLLM's n-gram proposer and transformers' prompt lookup decoding,
  Saxena 2023): the longest suffix n-gram of the sequence's own tokens (prompt, which holds the session's earlier
  turns, plus output), ``prompt_lookup_max`` down to ``prompt_lookup_min`` tokens, looked up among its earlier
  occurrences (the latest one followed by a whole draft's worth of tokens, else the latest); the tokens that followed
  it are the draft.  An incremental index keeps this
  O(n-gram sizes) per token.
* **Suffix** (``method: "suffix"``, as vLLM names it; SuffixDecoding, Oliaro et al., 2024): prompt lookup first,
  then, when the sequence's own tokens hold no match, a suffix tree over the earlier requests of the *same cache
  namespace* (model, adapter, tenant and cache salt: :class:`SuffixTable`, one per namespace, never shared across
  tenants or namespaces): their prompts (the part the prefix cache did not already hold: a session's new turn) and
  outputs, with each continuation's frequency; the draft follows the most frequent continuation while its
  estimated probability is at least ``suffix_decoding_min_token_prob``.

Verification (:func:`verify`): a decode row carrying k drafts is scored in one step as k + 1 decode rows of the
sequence (token i attends to the cache through itself; every row's K/V is written before any row's attention, so
the rows see the drafts before them), which on the default CPU path runs inside the fused decode step and, the
kernels being batch invariant (issue 26), gives each row's logits bit for bit as plain decoding would.  Tokens are
then taken row by row exactly as plain decoding takes them (processors, logprobs, stop strings, EOS, max_tokens)
until a row's token differs from the draft it scored: the accepted drafts plus one token from the first rejected
row (or the bonus row after the last draft) are emitted.  With temperature > 0 a draft is accepted with the
standard speculative-sampling rule (:func:`kvkeeper.sampling.sampler.speculative_sample`), so the output
distribution is the target model's.

Adaptive (:class:`Drafter`), from a cost model: a step of R decode rows takes about ``base + per_row * R`` seconds
(:class:`StepCost`, fitted online to the engine's decode-only steps: on this CPU a row's quantized matmuls make
``per_row`` a large share of a step, on a GPU it is small).  Each sequence keeps a decayed estimate ``a`` of the chance
that its next draft token is accepted given the previous one was (:attr:`SpecState.rate`; prior 1/2, 4/5 for a
prediction), so k drafts bring E(k) = 1 + a + ... + a^k tokens.  Its draft length is the k (at most
``num_speculative_tokens``) that makes the step's tokens per second highest, the other S - 1 sequences of the step
making one token each: (S - 1 + E(k)) / (base + per_row * (S + k)) (:meth:`Drafter.length`).  A single stream whose
drafts are accepted drafts long ones; a large batch is compute-bound (its step time grows with every row) and drafts
nothing.  Until the step timings fit it, a row costs :data:`ROW_COST` of a one-row step (measured on the
embedded model on this CPU: 19 ms for one row, about 2.6 ms more per row).  A sequence whose estimate admits no draft
pauses drafting for ``PAUSE_TOKENS`` output tokens (doubling
each time, up to ``MAX_PAUSE_TOKENS``), then tries again from the prior.  vLLM's ``disable_by_batch_size`` stays as
a hard gate.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

import torch

from ..errors import InvalidRequestError
from ..sampling.sampler import NO_TOKEN, sample, speculative_sample
from .json_config import parse_json_config
from .sequence import Sequence

METHODS = ("ngram", "suffix")
PAUSE_TOKENS = 16  # output tokens of the first pause (doubling each time)
MAX_PAUSE_TOKENS = 512
DECAY = 0.85  # weight of a sequence's earlier acceptance counts at each verify step
PRIOR = {"lookup": (1.0, 1.0), "prediction": (4.0, 1.0)}  # (accepted, rejected) pseudo-counts of a new estimate
ROW_COST = 0.12  # per_row / (base + per_row) until the step timings tell it (measured: 2.6 ms of 21.6 ms)
PREDICTION_TOKENS = 8  # draft length for a request's prediction when the engine runs without --speculative-config
_HINT = ("e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
         "\"prompt_lookup_min\": 2}'")


@dataclass
class SpeculativeConfig:
    """vLLM's ``--speculative-config`` for n-gram (prompt lookup) and suffix drafting.

    method: "ngram" (prompt lookup) or "suffix" (prompt lookup, then the namespace's :class:`SuffixTable`); vLLM's
    draft-model, EAGLE and MTP methods are refused by name.
    num_speculative_tokens: draft tokens per step at most (k >= 1).  prompt_lookup_max / prompt_lookup_min: the
    longest and shortest suffix n-gram looked up (tokens, max >= min >= 1).  disable_by_batch_size: a step with
    more running sequences than this drafts nothing (None: the cost model alone decides, see the module docstring).
    suffix_decoding_max_cached_requests (suffix): finished requests whose tokens the suffix tables hold, all
    namespaces together (the oldest leave first).  suffix_decoding_min_token_prob (suffix): a table draft stops at
    the first token whose estimated probability (its count over its context's) is below this (0..1).  adaptive:
    true (default) sizes each draft from the cost model and the acceptance estimate; false drafts
    ``num_speculative_tokens`` every step (what the step's budget and max_tokens leave), so the counts depend on the
    tokens only, never on the step timings (reproducible tests and measurements).
    Raises :class:`InvalidRequestError` naming the field.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    disable_by_batch_size: int | None = None
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    suffix_decoding_max_cached_requests: int = 256
    suffix_decoding_min_token_prob: float = 0.1
    adaptive: bool = True

    def __post_init__(self):
        if type(self.adaptive) is not bool:
            raise InvalidRequestError(f"--speculative-config: adaptive must be true or false, got {self.adaptive!r}",
                                      param="speculative_config.adaptive")
        p = self.suffix_decoding_min_token_prob
        if type(p) not in (int, float) or not 0 <= p <= 1:
            raise InvalidRequestError(f"--speculative-config: suffix_decoding_min_token_prob must be a number in "
                                      f"[0, 1], got {p!r}", param="speculative_config.suffix_decoding_min_token_prob")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size",
                     "suffix_decoding_max_cached_requests"):
            v = getattr(self, name)
            if v is None and name == "disable_by_batch_size":
                continue
            if type(v) is not int or v < 1:
                raise InvalidRequestError(f"--speculative-config: {name} must be an integer >= 1, got {v!r}",
                                          param=f"speculative_config.{name}")
        if self.method not in METHODS:
            raise InvalidRequestError(f"--speculative-config: method {self.method!r} is not implemented; use "
                                      f"\"ngram\" (prompt lookup) or \"suffix\" (prompt lookup, then the "
                                      f"namespace's earlier requests)", param="speculative_config.method")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidRequestError(f"--speculative-config: prompt_lookup_min ({self.prompt_lookup_min}) is above "
                                      f"prompt_lookup_max ({self.prompt_lookup_max})",
                                      param="speculative_config.prompt_lookup_min")

    def describe(self) -> str:
        """One line for the load line: what runs."""
        gate = "" if self.disable_by_batch_size is None else f", off above {self.disable_by_batch_size} sequences"
        table = (f", suffix tables per namespace over the last {self.suffix_decoding_max_cached_requests} requests"
                 if self.method == "suffix" else "")
        return (f"{self.method} speculation (up to {self.num_speculative_tokens} draft tokens, "
                f"{'adaptive' if self.adaptive else 'fixed length'}, n-grams "
                f"{self.prompt_lookup_min}-{self.prompt_lookup_max}{table}{gate})")


def parse_speculative_config(raw) -> SpeculativeConfig | None:
    """A :class:`SpeculativeConfig` from JSON text, a dict or a config (None stays None).  Raises
    :class:`InvalidRequestError` naming an unknown field or a wrong value, or saying the text is not a JSON object."""
    if raw is None:
        return None
    return parse_json_config(raw, SpeculativeConfig, "--speculative-config", _HINT, "speculative_config")


class NgramIndex:
    """Where each n-gram (n_min <= n <= n_max tokens) of a growing token list ends, kept up to date incrementally.

    ``ends[gram]``: the ascending end positions (exclusive) of its occurrences among the indexed ones.
    :meth:`latest` and :meth:`first_from` look up the longest suffix n-gram of the list among its *earlier*
    occurrences (an occurrence ending at the list's end is not indexed yet).
    """

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.ends: dict[tuple, list[int]] = {}
        self.upto = 0  # n-grams ending at or before this position are indexed

    def sync(self, tokens: list[int], upto: int) -> None:
        """Index the n-grams of ``tokens`` that end after ``self.upto`` and at or before ``upto``."""
        for end in range(self.upto + 1, upto + 1):
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.ends.setdefault(tuple(tokens[end - n:end]), []).append(end)
        self.upto = max(self.upto, upto)

    def latest(self, key_tokens: list[int], room: int = 0) -> int | None:
        """End of the latest indexed occurrence of the longest suffix n-gram of ``key_tokens`` (None: none); with
        ``room``, the latest one followed by ``room`` tokens of ``key_tokens`` when there is one (an occurrence just
        before the end leaves a short continuation)."""
        for n in range(min(self.n_max, len(key_tokens)), self.n_min - 1, -1):
            hit = self.ends.get(tuple(key_tokens[len(key_tokens) - n:]))
            if hit:
                limit = len(key_tokens) - room
                for end in reversed(hit[-4:]):  # a few of the latest: the lookup stays O(1) per token
                    if end <= limit:
                        return end
                return hit[-1]
        return None

    def first_from(self, key_tokens: list[int], start: int) -> int | None:
        """End of the first indexed occurrence at or after ``start`` of the longest suffix n-gram that has one."""
        for n in range(min(self.n_max, len(key_tokens)), self.n_min - 1, -1):
            hit = self.ends.get(tuple(key_tokens[len(key_tokens) - n:]))
            if hit:
                i = bisect.bisect_left(hit, start)
                if i < len(hit):
                    return hit[i]
        return None


class SuffixTable:
    """A suffix tree of the documents added (token lists), cut at depth ``n_max + 1`` and kept as the hash of its
    nodes: for each context of ``n_min``..``n_max`` tokens, the count of each token that followed it (SuffixDecoding,
    Oliaro et al., 2024, keeps the whole tree with such counts; a depth-limited walk re-matched after every drafted
    token reads the same counts).  :meth:`draft` follows the most frequent continuation of the longest context that
    occurs.  Adding or removing a document of n tokens costs O(n * (n_max - n_min + 1)) dict operations.
    """

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self.next: dict[tuple, dict[int, int]] = {}
        self.docs = 0

    def add(self, tokens: list[int], sign: int = 1) -> None:
        """Count (``sign`` 1) or uncount (-1, a document leaving) every (context, next token) pair of ``tokens``."""
        self.docs += sign
        for i in range(1, len(tokens)):
            tok = tokens[i]
            for n in range(self.n_min, min(self.n_max, i) + 1):
                key = tuple(tokens[i - n:i])
                counts = self.next.get(key)
                if counts is None:
                    counts = self.next[key] = {}
                c = counts.get(tok, 0) + sign
                if c > 0:
                    counts[tok] = c
                else:
                    counts.pop(tok, None)
                    if not counts:
                        del self.next[key]

    def draft(self, context: list[int], k: int, min_prob: float) -> list[int]:
        """Up to ``k`` tokens continuing ``context``: at each step the most frequent successor of the longest suffix
        of (context + drafted tokens) that the table holds, while its count over the context's total is at least
        ``min_prob``; ``[]`` when no suffix of at least ``n_min`` tokens occurs."""
        ctx, out = list(context[-self.n_max:]), []
        while len(out) < k:
            counts = None
            for n in range(min(self.n_max, len(ctx)), self.n_min - 1, -1):
                counts = self.next.get(tuple(ctx[len(ctx) - n:]))
                if counts:
                    break
            if not counts:
                break
            tok, c = max(counts.items(), key=lambda kv: kv[1])
            if c < min_prob * sum(counts.values()):
                break
            out.append(tok)
            ctx = (ctx + [tok])[-self.n_max:]
        return out


@dataclass
class SpecState:
    """One sequence's speculation: its indexes, acceptance estimate and counters (tokens).

    hits / misses: decayed counts of draft tokens accepted and of first rejections (:attr:`rate`); paused_until:
    output tokens before drafting resumes; pause: the next pause's length.  drafted / accepted: draft tokens scored
    and accepted; prediction_accepted / prediction_rejected: of those, the ones taken from the request's prediction
    (OpenAI's ``accepted_prediction_tokens`` / ``rejected_prediction_tokens``).  source: where the drafts scheduled
    now came from ("prediction", "lookup" or "suffix").
    """

    hits: float = 1.0
    misses: float = 1.0
    lookup: NgramIndex | None = None
    prediction: list[int] | None = None
    pred_index: NgramIndex | None = None
    pred_ptr: int | None = 0  # prediction position aligned with the output's end (None: lost until a resync)
    pred_seen: int = 0  # output tokens the pointer has followed
    paused_until: int = 0
    pause: int = PAUSE_TOKENS
    drafted: int = 0
    accepted: int = 0
    prediction_accepted: int = 0
    prediction_rejected: int = 0
    source: str = ""

    @property
    def rate(self) -> float:
        """The estimated chance that a draft token is accepted when the one before it was (0..1)."""
        return self.hits / (self.hits + self.misses)


class StepCost:
    """The time of a decode-only step as ``base + per_row * rows`` (seconds), by least squares over the recent steps
    (sums decayed by ``decay`` per step); until steps of two sizes were seen, ``per_row / (base + per_row)`` is
    :data:`ROW_COST`."""

    def __init__(self, decay: float = 0.98):
        self.decay = decay
        self.sums = [0.0] * 5  # weight, rows, seconds, rows^2, rows * seconds
        self.base, self.per_row = 1.0 - ROW_COST, ROW_COST

    def observe(self, rows: int, seconds: float) -> None:
        """Count one decode-only step of ``rows`` rows that ran in ``seconds``."""
        w, x, y, xx, xy = (v * self.decay for v in self.sums)
        self.sums = [w + 1, x + rows, y + seconds, xx + rows * rows, xy + rows * seconds]
        w, x, y, xx, xy = self.sums
        var = xx * w - x * x
        if var > 1e-6 * w * w:  # steps of several sizes: a fit
            slope = (xy * w - x * y) / var
            base = (y - slope * x) / w
            if slope > 0 and base > 0:
                self.base, self.per_row = base, slope


@dataclass
class SpecStats:
    """Engine-wide counters (vLLM's spec-decode metrics): drafts (verify rows carrying drafts), draft tokens,
    accepted tokens, and accepted tokens per draft position (index 0: the first draft token)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


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
        drafts = self._from_prediction(seq, st, room)
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
        """The draft length that makes the step's tokens per second highest (see the module docstring): k in
        0..``max_k`` maximising (S - 1 + E(k)) / (base + per_row * (S + k)), E(k) = 1 + a + ... + a^k the expected
        tokens of this row with k drafts, S = ``batch`` sequences each making at least one token."""
        if self.config is not None and not self.config.adaptive:
            return self.max_k  # fixed length: the counts are a function of the tokens only
        a, c, n = st.rate, self.cost, max(1, batch)
        best_k, best = 0, n / (c.base + c.per_row * n)
        e = term = 1.0
        for k in range(1, self.max_k + 1):
            term *= a
            e += term
            v = (n - 1 + e) / (c.base + c.per_row * (n + k))
            if v > best:
                best_k, best = k, v
        return best_k

    def _pause(self, seq: Sequence, st: SpecState) -> None:
        """No draft is worth its row now: none for a pause (doubling), then a fresh start from the prior."""
        st.paused_until = seq.num_output_tokens + st.pause
        st.pause = min(MAX_PAUSE_TOKENS, 2 * st.pause)
        st.hits, st.misses = PRIOR["prediction" if st.prediction else "lookup"]

    def _from_prediction(self, seq: Sequence, st: SpecState, room: int) -> list[int]:
        """The next tokens of the prediction after the output's end (following the output through it)."""
        if st.prediction is None:
            return []
        pred, out = st.prediction, seq.output_token_ids
        for i in range(st.pred_seen, len(out)):
            if st.pred_ptr is not None and st.pred_ptr < len(pred) and pred[st.pred_ptr] == out[i]:
                st.pred_ptr += 1
            else:  # diverged (or lost): the first later occurrence of the output's last n-gram
                start = st.pred_ptr or 0
                st.pred_ptr = st.pred_index.first_from(out[: i + 1], start)
                if st.pred_ptr is None:
                    st.pred_ptr = st.pred_index.latest(out[: i + 1])
        st.pred_seen = len(out)
        if st.pred_ptr is None:
            return []
        return pred[st.pred_ptr: st.pred_ptr + room]

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


@dataclass
class Verified:
    """What :func:`verify` did: tokens emitted, drafts accepted, finished sequences (this one or none)."""

    emitted: int
    accepted: int
    finished: list[Sequence]


def verify(seq: Sequence, logits: torch.Tensor, drafts: list[int], processor) -> Verified:
    """Take ``seq``'s tokens from its verify rows: row i (logits of the token before draft i) gives a token exactly
    as plain decoding would (greedy: the processors' argmax; sampling: :func:`speculative_sample` of draft i, the
    bonus row a plain sample); the next row is read only while the token equals its draft and the sequence has not
    finished (stop string, EOS, max_tokens, no allowed token).

    logits: (k + 1, vocab) float32, the rows of the token before the drafts and of each draft.  processor: the
    engine's :class:`~kvkeeper.engine.output_processor.OutputProcessor` (it appends, detokenizes, checks stops).
    """
    p, gen, procs = seq.params, seq.generator, seq.processors
    fast = p.greedy and p.logprobs is None and procs is None
    greedy_ids = logits.argmax(-1).tolist() if fast else None
    emitted = accepted = 0
    for i in range(len(drafts) + 1):
        if fast:
            tok, lp = greedy_ids[i], None
        elif p.greedy or i == len(drafts):
            ids, lps = sample(logits[i:i + 1], [p], [gen], [procs])
            tok, lp = ids[0], lps[0]
        else:
            tok, lp = speculative_sample(logits[i], p, gen, procs, drafts[i])
        done = processor.process([seq], [tok], [lp])
        emitted += tok != NO_TOKEN
        hit = i < len(drafts) and tok == drafts[i]
        accepted += hit
        if done or not hit:
            return Verified(emitted, accepted, done)
    return Verified(emitted, accepted, [])
