"""Document-level translation as multi-turn sessions, for the terminology evaluation (``kvkeeper eval terms``).

Each document is one session: the system message says what to do (and, under a glossary condition, lists
the document's terms), then each segment is one user turn (:data:`USER`), answered greedily; the reply is the segment's
translation (whitespace collapsed, so a reply over several lines stays one hypothesis line).  Conditions:

* ``none``: no glossary;
* ``glossary``: the document's terms (source words and their first allowed target form), in order of
  first occurrence, in the system message;
* ``random``: the same entries with wrong target forms of the same shape (another term's form with the
  same number of words, drawn with a fixed seed): a control that shows how much the model copies the
  glossary rather than translating.

Two translators run the turns: :class:`LocalTranslator` (a kvkeeper engine and its sessions; ``reuse=False``
recomputes every turn, a ``KVCompression`` compresses each turn's prompt KV) and :class:`ServerTranslator`
(any OpenAI-compatible server through the official ``openai`` client; ``X-Session-ID`` makes a kvkeeper
server keep the session, ``cache_salt`` per request turns reuse off where supported).
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import asdict, dataclass

from ..errors import InvalidRequestError, KVKeeperError
from ..sampling.params import SamplingParams
from .terms import Segment
from ..engine.handle import EngineHandle

CONDITIONS = ("none", "glossary", "random")
INSTRUCTION = ("You are a translator from English to French. Translate each message into French; reply with the "
               "French translation only.")
USER = "Translate into French: {src}"  # one turn: the segment's source (detokenized)


@dataclass
class TurnRecord:
    """One translated segment: the reply, its token ids (when known), prompt and cached tokens, seconds."""

    doc_id: str
    text: str
    token_ids: list[int] | None
    prompt_tokens: int
    cached_tokens: int | None
    seconds: float
    intervention_ms: float | None = None  # the KV intervention applied after the turn (LocalTranslator), if any


def documents(segments: list[Segment], doc_ids: list[str] | None = None, max_docs: int | None = None,
              max_segments: int | None = None) -> dict[str, list[Segment]]:
    """The segments grouped by document, in file order: only ``doc_ids`` when given, the first ``max_docs``
    documents and the first ``max_segments`` segments of each.  Raises :class:`InvalidRequestError` for an
    unknown document id."""
    docs: dict[str, list[Segment]] = {}
    for s in segments:
        docs.setdefault(s.doc_id, []).append(s)
    if doc_ids:
        unknown = [d for d in doc_ids if d not in docs]
        if unknown:
            raise InvalidRequestError(f"unknown document {unknown[0]!r}; the terms file has: {', '.join(docs)}")
        docs = {d: docs[d] for d in doc_ids}
    keep = list(docs)[:max_docs] if max_docs else list(docs)
    return {d: docs[d][:max_segments] if max_segments else docs[d] for d in keep}


def glossary(segs: list[Segment]) -> list[tuple[str, str]]:
    """(source term, target form) for each distinct term id of a document, in order of first occurrence."""
    seen, out = set(), []
    for s in segs:
        for t in s.terms:
            if t.id not in seen and t.forms:
                seen.add(t.id)
                out.append((t.src, t.forms[0]))
    return out


def random_glossary(entries: list[tuple[str, str]], all_segments: list[Segment], seed: int = 0) -> list[tuple[str, str]]:
    """The entries with wrong target forms of the same shape: for each, another term's form with as many words
    (any other form when none has), never one of the entry's own allowed forms; deterministic for ``seed``."""
    allowed: dict[str, set[str]] = {}
    for s in all_segments:
        for t in s.terms:
            allowed.setdefault(t.src, set()).update(t.forms)
    pool = sorted({f for forms in allowed.values() for f in forms})
    rng = random.Random(seed)
    out = []
    for src, tgt in entries:
        own = allowed.get(src, set()) | {tgt}
        same = [f for f in pool if len(f.split()) == len(tgt.split()) and f not in own]
        cands = same or [f for f in pool if f not in own] or [tgt[::-1]]
        out.append((src, rng.choice(cands)))
    return out


def system_message(entries: list[tuple[str, str]] | None) -> str:
    """The instruction, plus a glossary block when ``entries`` is not None."""
    if entries is None:
        return INSTRUCTION
    lines = "\n".join(f"- {s} = {t}" for s, t in entries) or "- (no terms)"
    return f"{INSTRUCTION}\nUse these French terms (English = French):\n{lines}"


def source_text(seg: Segment, detok) -> str:
    """The user message of a segment: :data:`USER` with its source as a user would type it (the task's text is
    Moses-tokenized)."""
    return USER.format(src=detok.detokenize(seg.src.split()))


def one_line(text: str) -> str:
    return " ".join(text.split())


class LocalTranslator:
    """Turns through a kvkeeper engine: one session per document (``reuse=False``: every turn recomputes its
    whole prompt), greedy, ``max_tokens`` per reply, ``compression`` (a ``KVCompression`` or None) applied to
    each turn.  Conversations longer than the context drop their oldest turns (the system message stays).

    intervention: a :class:`~kvkeeper.kvcache.intervention.KVIntervention` applied at each sentence boundary (the
    end of each turn: one segment is one sentence) to the KV of the turn just finished (its user message and
    reply), with the system message as the fresh recompute's anchor; each session then holds its KV in a
    namespace of its own (no prefix-cache sharing across documents), and so does every session when
    ``isolated`` is set (a baseline comparable with an intervention run).  Needs ``reuse``.
    """

    def __init__(self, engine: EngineHandle, max_tokens: int = 96, reuse: bool = True, compression=None, intervention=None,
                 isolated: bool = False):
        from ..sessions.manager import SessionManager

        if intervention is not None and not reuse:
            raise InvalidRequestError("a KV intervention rewrites the session's reused KV: it needs reuse on")
        self.engine, self.reuse, self.compression = engine, reuse, compression
        self.intervention, self.isolated = intervention, isolated or intervention is not None
        self.params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        self.sessions = SessionManager(engine)

    def translate(self, doc_id: str, system: str, sources: list[str]) -> list[TurnRecord]:
        s = self.sessions.open(system=system, reuse=self.reuse, params=self.params)
        s.trim_budget = self.engine.context_length - self.params.max_tokens
        request = {"namespace": self.engine.isolated_namespace("terms")} if self.isolated else {}
        anchor = end = None
        out = []
        try:
            for src in sources:
                t0 = time.perf_counter()
                seq = s.begin_turn(messages=s.messages + [{"role": "user", "content": src}],
                                   compression=self.compression, **request)
                self.engine.run_until_done([seq])
                if seq.finish_reason == "error":
                    raise KVKeeperError(f"{doc_id}: turn {len(s.turns) + 1} failed: {seq.error}")
                r = s.turns[-1]
                ms = None
                if self.intervention is not None:
                    if anchor is None:
                        anchor = end = self._system_tokens(system, s.kv.token_ids)
                    ms = self._intervene(s, anchor, end)
                    end = s.kv.num_computed
                out.append(TurnRecord(doc_id, one_line(r.text), list(r.token_ids), r.prompt_tokens, r.cached_tokens,
                                      time.perf_counter() - t0, ms))
        finally:
            s.close()
        return out

    def _system_tokens(self, system: str, ids: list[int]) -> int:
        """Tokens of the rendered system message at the head of the session's ids (the intervention's anchor)."""
        sys_ids = self.engine.encode_chat([{"role": "system", "content": system}], add_generation_prompt=False)
        if list(ids[: len(sys_ids)]) != list(sys_ids):
            raise KVKeeperError("the chat template does not render the system message as a prefix of the "
                                "conversation; the intervention's anchor is undefined")
        return len(sys_ids)

    def _intervene(self, session, anchor: int, start: int) -> float:
        """Apply the intervention to the session's KV of ``[start, num_computed)`` (the turn just finished), the
        first ``anchor`` tokens as the fresh context; returns its milliseconds."""
        from .intervention import intervene

        st = session.kv
        if st.num_computed <= start:
            return 0.0
        return intervene(self.engine, st, start, st.num_computed, anchor, self.intervention)["ms"]


class ServerTranslator:
    """Turns through an OpenAI-compatible server (``url``: its base, e.g. ``http://127.0.0.1:8000/v1``) with the
    official ``openai`` client: the whole conversation each turn, ``temperature=0``, ``X-Session-ID`` per
    document; ``reuse=False`` sends a fresh ``cache_salt`` with each request, ``compression`` kvkeeper's
    ``kv_compression`` field.  ``model`` None: the server's first listed model."""

    def __init__(self, url: str, model: str | None = None, max_tokens: int = 96, reuse: bool = True,
                 compression=None, api_key: str = "none", timeout_s: float = 600):
        from openai import OpenAI

        base = url.rstrip("/")
        self.client = OpenAI(base_url=base if base.endswith("/v1") else base + "/v1", api_key=api_key,
                             timeout=timeout_s, max_retries=0)
        self.model = model or self.client.models.list().data[0].id
        self.max_tokens, self.reuse, self.compression = max_tokens, reuse, compression

    def _extra(self) -> dict:
        extra: dict = {}
        if not self.reuse:
            extra["cache_salt"] = uuid.uuid4().hex
        if self.compression is not None:
            extra["kv_compression"] = {"policy": self.compression.policy, "ratio": self.compression.ratio}
        return extra

    def translate(self, doc_id: str, system: str, sources: list[str]) -> list[TurnRecord]:
        sid = f"terms-{doc_id}-{uuid.uuid4().hex[:8]}"[-128:]
        messages = [{"role": "system", "content": system}]
        out = []
        for src in sources:
            messages.append({"role": "user", "content": src})
            t0 = time.perf_counter()
            r = self.client.chat.completions.create(
                model=self.model, messages=messages, temperature=0.0, max_tokens=self.max_tokens,
                extra_headers={"X-Session-ID": sid}, extra_body=self._extra() or None)
            text = r.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            details = getattr(r.usage, "prompt_tokens_details", None)
            cached = getattr(details, "cached_tokens", None) if details is not None else None
            out.append(TurnRecord(doc_id, one_line(text), None, r.usage.prompt_tokens, cached,
                                  time.perf_counter() - t0))
        return out


def translate_condition(translator, docs: dict[str, list[Segment]], condition: str, all_segments: list[Segment],
                        seed: int = 0, progress=None) -> dict:
    """Translate every document under one condition (:data:`CONDITIONS`).

    Returns ``{"condition", "hyps": [one line per segment, documents in order], "turns": [TurnRecord dicts],
    "systems": {doc_id: system message}}``.  progress: called with (doc_id, turns) after each document.
    """
    if condition not in CONDITIONS:
        raise InvalidRequestError(f"unknown condition {condition!r}; choose from {', '.join(CONDITIONS)}")
    from sacremoses import MosesDetokenizer

    detok = MosesDetokenizer(lang="en")
    hyps, turns, systems = [], [], {}
    for doc_id, segs in docs.items():
        entries = None if condition == "none" else glossary(segs)
        if condition == "random":
            entries = random_glossary(entries, all_segments, seed)
        systems[doc_id] = system_message(entries)
        recs = translator.translate(doc_id, systems[doc_id], [source_text(s, detok) for s in segs])
        hyps += [r.text for r in recs]
        turns += [asdict(r) for r in recs]
        if progress is not None:
            progress(doc_id, recs)
    return {"condition": condition, "hyps": hyps, "turns": turns, "systems": systems}


def cache_summary(turns: list[dict]) -> dict:
    """Prompt and cached tokens summed over the turns, and the seconds they took."""
    known = [t["cached_tokens"] for t in turns if t["cached_tokens"] is not None]
    return {"turns": len(turns), "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
            "cached_tokens": sum(known) if known else None, "seconds": sum(t["seconds"] for t in turns)}
