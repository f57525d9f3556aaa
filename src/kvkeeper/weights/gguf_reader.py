"""Open a GGUF file: ``gguf.GGUFReader`` with its metadata parsed in bulk (same fields, same tensors).

``gguf.GGUFReader`` (gguf-py, the llama.cpp project's reader) builds one ``np.memmap`` view per metadata value: a
262,144-token vocabulary (Gemma 3) is about 786,000 views of the memmap subclass, 10-14 s of the load and some
700 MB of transient memory.  :class:`FastGGUFReader` keeps that reader's parsing and result (every
``ReaderField`` with the same ``parts``, ``data`` indices and ``types``, every ``ReaderTensor``) and changes two
internals: values are sliced from a plain ``np.ndarray`` view of the same map (no memmap subclass per view), and an
array of scalars or strings is read in one pass instead of one recursive call per element.  Tensor data stay
read-only views of the file's memory map (``np.ndarray``, its ``base`` the memmap): nothing is copied.
:func:`open_gguf` falls back to the package's own reader if the subclass fails on a file (an internal of the
package changed), so the result never depends on the fast path.
"""

from __future__ import annotations

import logging

import numpy as np

_log = logging.getLogger(__name__)


def _reader_class():
    import gguf
    from gguf import GGUFValueType as VT

    class FastGGUFReader(gguf.GGUFReader):
        """``gguf.GGUFReader`` with bulk metadata parsing (see the module docstring); same constructor."""

        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            dt, count = np.dtype(dtype), int(count)
            arr = plain[offset:offset + dt.itemsize * count].view(dt)[:count]
            return arr.view(dt.newbyteorder(self.byte_order if override_order is None else override_order))

        def _get_field_parts(self, orig_offs, raw_type):
            if VT(raw_type) != VT.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            offs, n, itype = orig_offs + 12, int(alen[0]), VT(int(raw_itype[0]))
            types = [VT.ARRAY, itype] if n else [VT.ARRAY]
            nptype = self.gguf_scalar_to_np.get(itype)
            if nptype is not None:  # one view, then one part per element as the package makes them
                arr = self._get(offs, nptype, n)
                return 12 + int(arr.nbytes), [raw_itype, alen, *(arr[i:i + 1] for i in range(n))], \
                    list(range(2, 2 + n)), types
            if itype != VT.STRING or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            plain, parts, idxs = self.__dict__["_plain"], [raw_itype, alen], []
            buf, u64 = memoryview(plain), np.dtype(np.uint64).newbyteorder("I")
            for _ in range(n):  # per string: its uint64 length and its bytes (the package's two parts)
                slen = int.from_bytes(buf[offs:offs + 8], "little")
                parts += [plain[offs:offs + 8].view(u64), plain[offs + 8:offs + 8 + slen]]
                idxs.append(len(parts) - 1)
                offs += 8 + slen
            return offs - orig_offs, parts, idxs, types

    return FastGGUFReader


def open_gguf(path):
    """A parsed GGUF file (``gguf.GGUFReader`` interface: ``fields``, ``tensors``), metadata parsed in bulk
    (:class:`FastGGUFReader`).  Raises what ``gguf.GGUFReader`` raises for an unreadable file (ValueError,
    OSError, ...)."""
    import gguf

    try:
        return _reader_class()(str(path))
    except Exception as e:  # noqa: BLE001  (the package's reader decides whether the file is readable)
        _log.debug("fast GGUF parse of %s failed (%s: %s); using gguf.GGUFReader", path, type(e).__name__, e)
        return gguf.GGUFReader(str(path))
