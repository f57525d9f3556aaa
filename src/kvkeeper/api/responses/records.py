"""Records kept as one JSON file each under a directory (stored responses, conversations): written atomically
(a temporary file, then ``os.replace``), removed on delete, read back at start.  Named by the owning tenant and
the record's id (:func:`~kvkeeper.sessions.disk.session_dir_name` of their session key), so two tenants' records
of one id never share a file."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict
from pathlib import Path

from ...sessions.disk import session_dir_name
from ...sessions.session import session_key
from ..common.errors import APIError

log = logging.getLogger(__name__)


class JsonRecords:
    """The JSON files of ``root`` (created when missing; None: nothing is written or read)."""

    def __init__(self, root: str | os.PathLike | None):
        self.root = Path(root) if root is not None else None
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, tenant: str | None, rid: str) -> Path:
        return self.root / f"{session_dir_name(session_key(tenant, rid))}.json"

    def load(self) -> list[dict]:
        """Every readable record (unreadable files are logged and skipped)."""
        out = []
        for p in sorted(self.root.glob("*.json")) if self.root is not None else []:
            try:
                out.append(json.loads(p.read_text()))
            except (OSError, ValueError) as e:
                log.warning("skipping %s: %s", p, e)
        return out

    def write(self, tenant: str | None, rid: str, record: dict) -> None:
        if self.root is None:
            return
        path = self._path(tenant, rid)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, ensure_ascii=False))
        os.replace(tmp, path)

    def remove(self, tenant: str | None, rid: str) -> None:
        if self.root is not None:
            self._path(tenant, rid).unlink(missing_ok=True)


class OwnedRecords:
    """Records of a dataclass ``kind`` (with ``id``, ``tenant`` and a set ``call_ids``) owned by tenants: in memory
    in the order they were saved first, and as files under ``root`` (None: memory only), read back in the order of
    ``order`` (a record's creation time).  ``noun`` and ``code`` name the record in a 404."""

    def __init__(self, kind: type, noun: str, code: str, root: str | os.PathLike | None, order):
        self.kind, self.noun, self.code = kind, noun, code
        self.files = JsonRecords(root)
        self.by_key: dict[tuple[str | None, str], object] = {}
        self.used: dict[tuple[str | None, str], float] = {}  # time.monotonic() of the last get or save
        found = []
        for d in self.files.load():
            try:
                found.append(kind(**{**d, "call_ids": set(d["call_ids"])}))
            except (TypeError, KeyError) as e:
                log.warning("skipping a %s: %s", noun, e)
        for r in sorted(found, key=order):
            self.by_key[(r.tenant, r.id)] = r
            self.used[(r.tenant, r.id)] = time.monotonic()

    def get(self, tenant: str | None, rid: str, param: str | None = None):
        """``tenant``'s record ``rid``; APIError 404 for an unknown id (another tenant's included)."""
        r = self.by_key.get((tenant, rid))
        if r is not None:
            self.used[(tenant, rid)] = time.monotonic()
        if r is None:
            raise APIError(404, f"no {self.noun} {rid!r} (it was never stored, was deleted, or belongs to another API "
                                "key)", type="not_found_error", param=param, code=self.code)
        return r

    def save(self, r) -> None:
        """Keep ``r`` (new or changed)."""
        self.by_key[(r.tenant, r.id)] = r
        self.used[(r.tenant, r.id)] = time.monotonic()
        self.files.write(r.tenant, r.id, {**asdict(r), "call_ids": sorted(r.call_ids)})

    def delete(self, tenant: str | None, rid: str):
        """Forget ``tenant``'s record ``rid`` and return it; APIError 404 as :meth:`get`."""
        r = self.get(tenant, rid)
        del self.by_key[(tenant, rid)]
        self.used.pop((tenant, rid), None)
        self.files.remove(tenant, rid)
        return r

    def expire(self, ttl_s: float | None) -> int:
        """Delete the records unused (neither read nor saved) for ``ttl_s`` seconds (None: none); returns how many."""
        if ttl_s is None:
            return 0
        now = time.monotonic()
        old = [k for k, t in self.used.items() if now - t >= ttl_s]
        for k in old:
            self.delete(*k)
        return len(old)

    def __len__(self) -> int:
        return len(self.by_key)
