"""A lean GGUF reader: the header, the metadata and where each tensor's blocks lie.

`gguf.GGUFReader` turns every metadata array element into a numpy memmap view: on a
262,144-token vocabulary (three arrays of that length) it takes 40 s before the first
tensor. Serving needs the scalars and the tensor table; the vocabulary arrays are only
read when the tokenizer is converted (once per file, gguf_checkpoint.py). So this
reader walks the file once with `struct` and keeps an array's elements only when it is
short (`MAX_ARRAY_ITEMS`), recording the length of the others. Tensor data is a view of
one read-only memory map of the file (GGUF v2 and v3, little-endian).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from encoders.weights import CheckpointError

MAX_ARRAY_ITEMS = 4096  # longer metadata arrays (vocabularies, merges) keep only their length
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class LongArray:
    """A metadata array too long to keep: its element type and length."""

    item_type: int
    length: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: int  # a gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # numpy order: rows first (GGUF lists ne0, the row length, first)
    offset: int  # from the start of the file
    num_bytes: int


class GGUFFile:
    """One GGUF file: `metadata` (key -> value, LongArray for long arrays), `tensors`
    (in file order) and `raw(info)`, a tensor's stored bytes as uint8 [rows, row bytes]."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError) as exc:
            raise CheckpointError(f"{self.path}: not a readable GGUF file ({exc})") from exc

    def _parse(self) -> None:
        from gguf.constants import GGML_QUANT_SIZES

        magic, version = self._unpack("<4sI")
        if magic != b"GGUF" or version not in (2, 3):
            raise CheckpointError(f"{self.path}: not a GGUF v2/v3 file (magic {magic!r})")
        num_tensors, num_kv = self._unpack("<QQ")
        self.metadata: dict[str, object] = {}
        for _ in range(num_kv):
            key = self._string()
            (value_type,) = self._unpack("<I")
            self.metadata[key] = self._value(value_type)
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            (num_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{num_dims}Q")
            qtype, offset = self._unpack("<IQ")
            infos.append((name, dims, qtype, offset))
        alignment = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // alignment) * alignment
        self.tensors: list[TensorInfo] = []
        for name, dims, qtype, offset in infos:
            if qtype not in GGML_QUANT_SIZES:
                raise CheckpointError(f"{self.path}: tensor {name} has unknown type {qtype}")
            block, block_bytes = GGML_QUANT_SIZES[qtype]
            count = int(np.prod(dims))
            shape = tuple(int(d) for d in reversed(dims))
            self.tensors.append(
                TensorInfo(name, qtype, shape, start + offset, count // block * block_bytes)
            )

    def raw(self, info: TensorInfo) -> np.ndarray:
        """The tensor's stored bytes, uint8 [rows..., bytes per row] (a read-only view)."""
        from gguf.quants import quant_shape_to_byte_shape

        data = np.frombuffer(self._map, np.uint8, info.num_bytes, info.offset)
        return data.reshape(quant_shape_to_byte_shape(info.shape, info.qtype))

    def field(self, key: str, default: object = None) -> object:
        return self.metadata.get(key, default)

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        text = bytes(self._map[self._pos : self._pos + length]).decode("utf-8")
        self._pos += length
        return text

    def _value(self, value_type: int) -> object:
        if value_type in _SCALARS:
            return self._unpack("<" + _SCALARS[value_type])[0]
        if value_type == _STRING:
            return self._string()
        if value_type != _ARRAY:
            raise CheckpointError(f"{self.path}: unknown metadata type {value_type}")
        item_type, length = self._unpack("<IQ")
        if length <= MAX_ARRAY_ITEMS:
            return [self._value(item_type) for _ in range(length)]
        if item_type in _SCALARS:  # skipped whole
            self._pos += length * struct.calcsize(_SCALARS[item_type])
        else:  # strings (or nested arrays): walked, not kept
            for _ in range(length):
                self._skip(item_type)
        return LongArray(item_type, length)

    def _skip(self, value_type: int) -> None:
        if value_type == _STRING:
            (length,) = struct.unpack_from("<Q", self._map, self._pos)
            self._pos += 8 + length
        else:
            self._value(value_type)
