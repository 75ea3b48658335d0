"""Memory-mapped safetensors reading and writing, with errors that name the file.

The format is an 8-byte little-endian header length, a JSON header mapping
tensor names to {dtype, shape, data_offsets}, then the raw bytes. Reading it
ourselves (instead of through a framework) gives zero-copy numpy views for
every dtype including bfloat16 (via ml_dtypes), and lets every inconsistency
be reported with the file and the tensor's name. No pickle is ever involved.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Mapping

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    pass


def read_header(path: str | os.PathLike) -> tuple[dict, int]:
    """(header dict without __metadata__, byte offset where data starts)."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsError(f"{path}: file is {size} bytes, too short to be safetensors "
                                   "(corrupted or truncated; re-download or re-save it).")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, _MAX_HEADER):
            raise SafetensorsError(f"{path}: header length {n} exceeds the file size {size} "
                                   "(corrupted or truncated safetensors file).")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SafetensorsError(f"{path}: header is not valid JSON ({e}); the file is corrupted."
                                   ) from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object; the file is corrupted.")
    header.pop("__metadata__", None)
    start, data_len = 8 + n, size - 8 - n
    for name, info in header.items():
        try:
            dtype = DTYPES[info["dtype"]]
            b, e = info["data_offsets"]
            shape = tuple(int(s) for s in info["shape"])
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: tensor {name!r} has a malformed header entry {info!r}."
                                   ) from None
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if not (0 <= b <= e <= data_len) or e - b != expected:
            raise SafetensorsError(
                f"{path}: tensor {name!r} (dtype {info['dtype']}, shape {list(shape)}) has byte "
                f"range [{b}, {e}) but needs {expected} bytes inside a {data_len}-byte data "
                "section; the file is corrupted or truncated.")
    return header, start


class SafetensorsFile:
    """Lazily memory-mapped tensors of one file: `f[name]` is a read-only view."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.header, self._start = read_header(self.path)
        self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")

    def keys(self):
        return self.header.keys()

    def __contains__(self, name):
        return name in self.header

    def __getitem__(self, name: str) -> np.ndarray:
        info = self.header[name]
        b, e = info["data_offsets"]
        buf = self._mm[self._start + b:self._start + e]
        return buf.view(DTYPES[info["dtype"]]).reshape(info["shape"])


def save_file(tensors: Mapping[str, np.ndarray], path: str | os.PathLike,
              metadata: Mapping[str, str] | None = None) -> None:
    """Write tensors (in name order) to one safetensors file."""
    header, offset = {}, 0
    arrays = {}
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        if a.dtype not in _NAMES:
            raise SafetensorsError(f"tensor {name!r}: dtype {a.dtype} cannot be stored in safetensors.")
        header[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        arrays[name] = a
        offset += a.nbytes
    header = {"__metadata__": dict(metadata or {"format": "pt"}), **header}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays.values():
            f.write(a.tobytes())
    os.replace(tmp, path)
