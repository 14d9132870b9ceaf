"""A GGUF file's metadata and tensor table, read in one pass over its header.

gguf-py's GGUFReader builds a numpy view for every value it meets, the
tokenizer's arrays included (SmolLM2: 49,152 tokens, 48,900 merges): 4.6 s
a file on the benchmark machine, paid by each torch load (footprint, then
weights) and each LoRA check of a llama.cpp base. What those need is the
scalar and string fields and where each tensor lies, so this reader steps
over arrays (strings by their lengths, numbers by arithmetic) and keeps
them as their type and length: 0.1 s for the same file. The layout is
GGUF's (version 2 and 3, little-endian): magic, version, tensor and
key-value counts, the key-value pairs, the tensor infos, then the data
from the next multiple of `general.alignment` (32 by default).

Tensor data is handed out as uint8 views of a read-only map of the file,
shaped as gguf.quants.dequantize takes them.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_SIZES = {t: struct.calcsize(f) for t, f in _SCALARS.items()}
_MAX_DIMS = 8  # ggml's GGML_MAX_DIMS is 4; anything far past it is not a tensor table


class GGUFHeaderError(ValueError):
    """The bytes are not a GGUF header this reader understands (the message says where)."""


@dataclass(frozen=True)
class ArrayField:
    """An array value, not read: its item type (GGUF's code) and length."""

    item_type: int
    count: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF's order: ne[0], the fastest-varying dimension, first
    tensor_type: int  # a ggml type (gguf.GGMLQuantizationType's value)
    offset: int  # of its first byte, from the start of the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        count = 1
        for d in self.shape:
            count *= d
        return count


class GGUFHeader:
    def __init__(self, path: Path) -> None:
        with Path(path).open("rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file cannot be mapped
                raise GGUFHeaderError("the file is empty") from None
        self._pos = 0
        self.fields: dict[str, object] = {}
        self.tensors: tuple[TensorInfo, ...] = ()
        self._parse()

    def get(self, key: str, default=None):
        value = self.fields.get(key, default)
        return default if isinstance(value, ArrayField) else value

    def tensor_bytes(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array of shape (ne[n-1], ..., ne[1], row bytes)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        shape = tuple(reversed(tensor.shape))
        data = np.frombuffer(self._map, dtype=np.uint8, count=tensor.nbytes, offset=tensor.offset)
        return data.reshape(quant_shape_to_byte_shape(shape, GGMLQuantizationType(tensor.tensor_type)))

    # -- parsing ---------------------------------------------------------------------

    def _take(self, n: int) -> int:
        start = self._pos
        if n < 0 or start + n > len(self._map):
            raise GGUFHeaderError(f"truncated at byte {start}: {n} more bytes needed")
        self._pos = start + n
        return start

    def _scalar(self, value_type: int):
        fmt = _SCALARS.get(value_type)
        if fmt is None:
            raise GGUFHeaderError(f"unknown value type {value_type} at byte {self._pos}")
        return struct.unpack_from(fmt, self._map, self._take(_SIZES[value_type]))[0]

    def _string(self) -> str:
        n = self._scalar(10)
        return bytes(self._map[self._take(n):self._pos]).decode("utf-8", errors="replace")

    def _value(self, value_type: int):
        if value_type == _STRING:
            return self._string()
        if value_type != _ARRAY:
            return self._scalar(value_type)
        item_type, count = self._scalar(4), self._scalar(10)
        if item_type == _STRING:
            for _ in range(count):  # each string is its length, then that many bytes
                self._take(self._scalar(10))
        elif item_type in _SIZES:
            self._take(count * _SIZES[item_type])
        else:
            raise GGUFHeaderError(f"an array of type {item_type} at byte {self._pos} cannot be read")
        return ArrayField(item_type, count)

    def _count(self, n: int, smallest: int, what: str) -> int:
        # each entry takes at least `smallest` bytes: a count the file cannot hold is garbage
        if n * smallest > len(self._map) - self._pos:
            raise GGUFHeaderError(f"the header claims {n} {what}, more than the file can hold")
        return n

    def _parse(self) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        if bytes(self._map[self._take(4):self._pos]) != _MAGIC:
            raise GGUFHeaderError("not a GGUF file (bad magic)")
        version = self._scalar(4)
        if version not in (2, 3):
            raise GGUFHeaderError(f"GGUF version {version} is not read here (2 and 3 are)")
        num_tensors, num_fields = self._scalar(10), self._scalar(10)
        for _ in range(self._count(num_fields, 12, "key-value pairs")):
            key = self._string()
            self.fields[key] = self._value(self._scalar(4))
        infos = []
        for _ in range(self._count(num_tensors, 24, "tensors")):
            name = self._string()
            n_dims = self._scalar(4)
            if n_dims > _MAX_DIMS:
                raise GGUFHeaderError(f"tensor {name[:80]!r} claims {n_dims} dimensions")
            shape = tuple(self._scalar(10) for _ in range(n_dims))
            infos.append((name, shape, self._scalar(4), self._scalar(10)))
        alignment = self.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0:
            raise GGUFHeaderError(f"general.alignment is {alignment!r}")
        data_start = -(-self._pos // alignment) * alignment
        tensors = []
        for name, shape, tensor_type, offset in infos:
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor_type)]
            except (ValueError, KeyError):
                raise GGUFHeaderError(f"tensor {name[:80]!r} has unknown type {tensor_type}") from None
            info = TensorInfo(name, shape, tensor_type, data_start + offset, 0)
            nbytes = info.n_elements // block * type_size
            if info.offset + nbytes > len(self._map):
                raise GGUFHeaderError(f"tensor {name[:80]!r} ends past the end of the file")
            tensors.append(TensorInfo(name, shape, tensor_type, info.offset, nbytes))
        self.tensors = tuple(tensors)
