"""A GGUF file's metadata and tensor table, read without touching tensor data.

``gguf.GGUFReader`` builds every metadata value as numpy views of its memory map, one per element: for a
vocabulary of 49,152 tokens and as many merges that is about 250,000 memmap slices, 2.7 s on this machine
before a single weight is read.  :class:`GGUFFile` reads the same header (GGUF versions 2 and 3, little-endian;
layout: ggml's ``docs/gguf.md``) with :mod:`struct`: scalars and numeric arrays at once, a string array as the
offsets of its strings (decoded when asked for), and the tensor table as ``gguf.ReaderTensor`` tuples whose
``data`` is a read-only view of the file's memory map (no tensor byte is read until used), so the code written
for ``GGUFReader`` (``reader.fields[key].contents()``, ``len(field.data)``, ``reader.tensors``) works unchanged.
"""

from __future__ import annotations

import functools
import hashlib
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ModelFormatError

__all__ = ["GGUFFile", "MetaField"]

# GGUF value types (gguf.GGUFValueType): id -> (struct format, numpy dtype) of the scalar ones
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_DEFAULT_ALIGNMENT = 32


@functools.lru_cache(maxsize=4)
def _open_cached(path: Path, size: int, mtime_ns: int) -> "GGUFFile":
    return GGUFFile(path)


class MetaField:
    """One metadata key: ``name``, ``types`` (``gguf.GGUFValueType`` list: the type, then an array's element
    type), ``data`` (indices of the values: ``range(n)`` for an array of n, ``[0]`` for a scalar) and
    :meth:`contents` (as ``gguf.ReaderField.contents``)."""

    def __init__(self, name: str, types: list, value: Any, buf=None):
        self.name, self.types = name, types
        self._value, self._buf = value, buf  # a string array: value is (start offsets,) into buf
        self.data = range(len(value)) if types and int(types[0]) == _ARRAY else [0]

    def _string(self, i: int) -> str:
        off = self._value[i]
        n = _U64.unpack_from(self._buf, off)[0]
        return bytes(self._buf[off + 8: off + 8 + n]).decode("utf-8")

    def contents(self, index: int | slice = slice(None)) -> Any:
        """The value: a Python scalar or str; an array's elements as a list (``index``: one element or a
        slice of them)."""
        if int(self.types[0]) != _ARRAY:
            return self._value
        if int(self.types[-1]) == _STRING:
            if isinstance(index, int):
                return self._string(index)
            return [self._string(i) for i in range(len(self._value))[index]]
        got = self._value[index]
        return got.item() if isinstance(index, int) else got.tolist()


class GGUFFile:
    """The header of a GGUF file: ``fields`` (key -> :class:`MetaField`), ``tensors`` (``gguf.ReaderTensor``
    list, in file order, ``data`` over the memory map), ``alignment`` and ``data_offset`` (bytes).

    Raises :class:`ModelFormatError` for a file that is not GGUF, of an unsupported version or byte order,
    or whose header is truncated or inconsistent (duplicate keys or tensors, a tensor past the end).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._parse()
        except (struct.error, ValueError, IndexError, UnicodeDecodeError, OSError) as e:
            raise ModelFormatError(f"{self.path} is not a readable GGUF file ({type(e).__name__}: {e})") from e

    @classmethod
    def open(cls, path: str | Path) -> "GGUFFile":
        """The file's header, read once per process while the file stays the same (its resolved path, size and
        modification time): the memory-fit check and the loader read the same header at every start (its
        vocabulary's 49,152 strings are walked one by one).  The object is shared: treat it as read-only.
        Raises as the constructor."""
        p = Path(path).resolve()
        try:
            st = p.stat()
        except OSError as e:
            raise ModelFormatError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from e
        return _open_cached(p, st.st_size, st.st_mtime_ns)

    def _parse(self) -> None:
        import gguf

        buf = self._mm
        if buf[:4] != b"GGUF":
            raise ValueError(f"magic {bytes(buf[:4])!r}, expected b'GGUF'")
        version = _U32.unpack_from(buf, 4)[0]
        if version & 0xFFFF == 0:
            raise ValueError("the file is big-endian; only little-endian GGUF files are supported")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}; versions 2 and 3 are supported")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        off = 24
        self.fields: dict[str, MetaField] = {}
        self._spans: dict[str, tuple[int, int]] = {}  # key -> its bytes in the file (name, type, value)
        for _ in range(n_kv):
            start = off
            name, off = self._str(off)
            vtype = _U32.unpack_from(buf, off)[0]
            field, off = self._value(name, vtype, off + 4)
            if name in self.fields:
                raise ValueError(f"duplicate metadata key {name!r}")
            self.fields[name] = field
            self._spans[name] = (start, off)
        infos = []
        for _ in range(n_tensors):
            name, off = self._str(off)
            n_dims = _U32.unpack_from(buf, off)[0]
            dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
            off += 4 + 8 * n_dims
            ttype, t_off = struct.unpack_from("<IQ", buf, off)
            infos.append((name, dims, ttype, t_off))
            off += 12
        align = self.fields.get("general.alignment")
        self.alignment = int(align.contents()) if align is not None else _DEFAULT_ALIGNMENT
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ValueError(f"general.alignment {self.alignment} is not a power of two")
        self.data_offset = off + (-off % self.alignment)
        self._data = np.memmap(self.path, mode="r")
        self.tensors = [self._tensor(gguf, *info) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("duplicate tensor names")

    def metadata_digest(self, keys: tuple[str, ...], prefixes: tuple[str, ...] = ()) -> str:
        """SHA-256 (hex) of the stored bytes (name, type and value) of the metadata keys named in ``keys`` or
        starting with one of ``prefixes``, in file order: two files whose selected keys are stored alike share it,
        whatever their tensors, paths or modification times."""
        h = hashlib.sha256()
        for name, (start, end) in self._spans.items():
            if name in keys or name.startswith(prefixes):
                h.update(self._mm[start:end])
        return h.hexdigest()

    def _str(self, off: int) -> tuple[str, int]:
        n = _U64.unpack_from(self._mm, off)[0]
        end = off + 8 + n
        if end > len(self._mm):
            raise ValueError(f"a string at byte {off} runs past the end of the file")
        return self._mm[off + 8: end].decode("utf-8"), end

    def _value(self, name: str, vtype: int, off: int) -> tuple[MetaField, int]:
        import gguf

        buf, T = self._mm, gguf.GGUFValueType
        if vtype == _STRING:
            s, off = self._str(off)
            return MetaField(name, [T.STRING], s), off
        if vtype in _SCALARS:
            fmt = _SCALARS[vtype][0]
            return MetaField(name, [T(vtype)], struct.unpack_from(fmt, buf, off)[0]), off + struct.calcsize(fmt)
        if vtype != _ARRAY:
            raise ValueError(f"metadata key {name!r} has unknown value type {vtype}")
        etype, n = struct.unpack_from("<IQ", buf, off)
        off += 12
        if etype == _STRING:
            starts = []
            for _ in range(n):
                starts.append(off)
                off += 8 + _U64.unpack_from(buf, off)[0]
            if off > len(buf):
                raise ValueError(f"metadata key {name!r} runs past the end of the file")
            return MetaField(name, [T.ARRAY, T.STRING], starts, buf), off
        if etype not in _SCALARS:
            raise ValueError(f"metadata key {name!r} is an array of unsupported type {etype}")
        dt = np.dtype(_SCALARS[etype][1]).newbyteorder("<")
        arr = np.frombuffer(buf, dtype=dt, count=n, offset=off).copy()
        return MetaField(name, [T.ARRAY, T(etype)], arr), off + n * dt.itemsize

    def _tensor(self, gguf, name: str, dims: tuple[int, ...], ttype: int, t_off: int):
        """A ``gguf.ReaderTensor`` over the memory map, shaped as ``GGUFReader`` shapes it."""
        qtype = gguf.GGMLQuantizationType(ttype)
        n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n_bytes = n_elems * type_size // block
        np_dims = tuple(reversed(dims))
        plain = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}.get(qtype.name)
        if plain is None:
            item, count, np_dims = np.uint8, n_bytes, gguf.quants.quant_shape_to_byte_shape(np_dims, qtype)
        else:
            item, count = plain, n_elems
        start = self.data_offset + t_off
        if start + n_bytes > len(self._data):
            raise ValueError(f"tensor {name!r} ({n_bytes} bytes at {start}) runs past the end of the file "
                             f"({len(self._data)} bytes): the file may be truncated")
        data = self._data[start: start + n_bytes].view(item)[:count].reshape(np_dims)
        return gguf.ReaderTensor(name=name, tensor_type=qtype, shape=np.array(dims, dtype=np.uint64),
                                 n_elements=n_elems, n_bytes=n_bytes, data_offset=start, data=data, field=None)
