"""A fast reader of the GGUF container: metadata key/values and memory-mapped tensor blocks.

`gguf.GGUFReader` builds a numpy view per metadata element, which takes 5-10 s for SmolLM2's 49k-token
vocabulary on this machine; every model load paid it. This reader parses the same layout (GGUF v2/v3,
little-endian) in well under a second with `struct` and `np.frombuffer`; tensor formats, block sizes and
dequantization still come from the `gguf` package.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_SCALARS = {  # GGUF value type -> (struct format, numpy dtype)
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # logical torch order (outermost first), the reverse of GGUF's dims
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    """Metadata (`.metadata`: key -> Python value; arrays become lists) and tensors of a GGUF file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self._map)
        self._pos = 0
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, KeyError, ValueError) as e:
            raise ValueError(f"{self.path}: not a valid GGUF file ({type(e).__name__}: {e})") from e

    def _parse(self) -> None:
        if bytes(self._buf[:4]) != _MAGIC:
            raise ValueError(f"magic {bytes(self._buf[:4])!r} is not {_MAGIC!r}")
        self._pos = 4
        version = self._scalar(4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3, little-endian)")
        n_tensors, n_kv = self._scalar(10), self._scalar(10)
        self.metadata: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._scalar(4))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._scalar(10) for _ in range(self._scalar(4))]
            qtype = GGMLQuantizationType(self._scalar(4))
            infos.append((name, dims, qtype, self._scalar(10)))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, qtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            nbytes = int(np.prod(dims, dtype=np.int64)) // block * type_size
            if data_start + offset + nbytes > len(self._map):
                raise ValueError(f"tensor {name} extends past the end of the file (truncated?)")
            shape = tuple(int(d) for d in reversed(dims))
            self.tensors[name] = TensorInfo(name, qtype, shape, data_start + offset, nbytes)

    def _scalar(self, vtype: int):
        fmt, _ = _SCALARS[vtype]
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._scalar(10)
        text = bytes(self._buf[self._pos : self._pos + n]).decode("utf-8")
        self._pos += n
        return text

    def _value(self, vtype: int):
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            return self._scalar(vtype)
        item_type, count = self._scalar(4), self._scalar(10)
        if item_type in _SCALARS:
            dtype = np.dtype(_SCALARS[item_type][1]).newbyteorder("<")
            values = np.frombuffer(self._buf, dtype=dtype, count=count, offset=self._pos)
            self._pos += values.nbytes
            return values.tolist()
        return [self._value(item_type) for _ in range(count)]

    def blocks(self, name: str) -> np.ndarray:
        """Tensor `name` as stored: read-only uint8 [*shape[:-1], bytes per row] over the memory map."""
        info = self.tensors[name]
        data = self._map[info.offset : info.offset + info.nbytes]
        return np.asarray(data).reshape(*info.shape[:-1], -1)
