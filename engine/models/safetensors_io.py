"""Read and write safetensors files with numpy, including bf16 (numpy has no bf16 dtype)."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Collection
from pathlib import Path

import numpy as np

_NP = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    out = bits.astype(np.uint32)
    out <<= 16  # in place: no second fp32-sized temporary
    return out.view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, as hardware bf16 conversion does."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # one uint32 temporary, worked in place (uint32 wrap-around as in ``(u + rounding) >> 16``), in blocks
    # of rows so that a large tensor's conversion adds little beside its input and output
    out = np.empty(u.shape, np.uint16)
    flat_u, flat_out = u.reshape(-1), out.reshape(-1)
    for a in range(0, flat_u.size, 1 << 22):
        b = flat_u[a : a + (1 << 22)]
        t = b >> 16
        t &= 1
        t += 0x7FFF
        t += b
        t >>= 16
        flat_out[a : a + (1 << 22)] = t
    return out


class SafetensorsFile:
    """Reads tensors of one .safetensors file lazily, one tensor (or a range of its rows) at a time."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"{self.path}: not a safetensors file (shorter than its header)")
            (n,) = struct.unpack("<Q", raw)
            if n > 100_000_000:
                raise ValueError(f"{self.path}: not a safetensors file (header length {n})")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{self.path}: corrupt safetensors header: {e}") from e
        self.metadata = header.pop("__metadata__", {}) or {}
        self.header = header
        self.data_start = 8 + n

    def keys(self) -> list[str]:
        return list(self.header)

    def __iter__(self):
        return iter(self.header)

    def dtype(self, key: str) -> str:
        return self.header[key]["dtype"]

    def shape(self, key: str) -> list[int]:
        return list(self.header[key]["shape"])

    def row_bytes(self, key: str) -> int:
        """Bytes of one row (index on the first axis) of ``key`` as stored."""
        info = self.header[key]
        start, end = info["data_offsets"]
        rows = info["shape"][0] if info["shape"] else 1
        return (end - start) // max(rows, 1)

    def _read(self, key: str, start_row: int | None, stop_row: int | None) -> tuple[np.ndarray, list[int]]:
        """The stored bytes of rows ``start_row:stop_row`` (all when None) and their shape.

        Positional reads into fresh memory rather than a kept memory map: pages of a map stay in the
        process's resident set once touched (a whole checkpoint's worth after a load), whereas the page
        cache a read goes through is the kernel's, reclaimable and not counted as the process's."""
        info = self.header[key]
        begin, end = info["data_offsets"]
        shape = list(info["shape"])
        if start_row is not None:
            row = self.row_bytes(key)
            stop_row = shape[0] if stop_row is None else min(stop_row, shape[0])
            begin, end = begin + start_row * row, begin + stop_row * row
            shape = [stop_row - start_row, *shape[1:]]
        buf = np.empty(end - begin, np.uint8)
        view, offset = memoryview(buf), self.data_start + begin
        with open(self.path, "rb", buffering=0) as f:
            while view.nbytes:
                n = os.preadv(f.fileno(), [view], offset)
                if n <= 0:
                    raise ValueError(f"{self.path}: tensor {key} runs past the end of the file")
                view, offset = view[n:], offset + n
        return buf, shape

    def get(self, key: str, start_row: int | None = None, stop_row: int | None = None) -> np.ndarray:
        """The tensor (or rows ``start_row:stop_row`` of it) as a numpy array; bf16 and fp8 come back as
        fp32."""
        buf, shape = self._read(key, start_row, stop_row)
        dt = self.header[key]["dtype"]
        if dt == "BF16":
            return bf16_bits_to_f32(buf.view(np.uint16)).reshape(shape)
        if dt == "F8_E4M3":
            import paddle

            t = paddle.to_tensor(buf).view(paddle.float8_e4m3fn)
            return t.astype("float32").numpy().reshape(shape)
        if dt not in _NP:
            raise ValueError(f"{self.path}: tensor {key} has unsupported dtype {dt}")
        return buf.view(_NP[dt]).reshape(shape)

    def get_stored(self, key: str, start_row: int | None = None, stop_row: int | None = None) -> np.ndarray:
        """The tensor (or rows of it) in its stored type without conversion: bf16 as uint16 bits (which
        ``paddle.to_tensor`` takes as bfloat16), fp8 as uint8."""
        buf, shape = self._read(key, start_row, stop_row)
        dt = self.header[key]["dtype"]
        stored = {"BF16": np.uint16, "F8_E4M3": np.uint8, **_NP}.get(dt)
        if stored is None:
            raise ValueError(f"{self.path}: tensor {key} has unsupported dtype {dt}")
        return buf.view(stored).reshape(shape)


def save_file(
    tensors: dict[str, np.ndarray],
    path: str | Path,
    dtype: str = "float32",
    metadata=None,
    keep_float32: Collection[str] = (),
) -> int:
    """Write tensors; floating ones are stored as ``dtype`` (float32 | bfloat16 | float16), those named in
    ``keep_float32`` as float32. Returns bytes."""
    header: dict = {"__metadata__": {"format": "pd", **(metadata or {})}}
    chunks = []
    offset = 0
    for name, arr in tensors.items():
        arr = np.asarray(arr)
        if arr.dtype.kind == "f":
            if name in keep_float32:
                data, code = arr.astype(np.float32), "F32"
            elif dtype == "bfloat16":
                data, code = f32_to_bf16_bits(arr.astype(np.float32)), "BF16"
            elif dtype == "float16":
                data, code = arr.astype(np.float16), "F16"
            else:
                data, code = arr.astype(np.float32), "F32"
        else:
            code = {v: k for k, v in _NP.items()}[arr.dtype.type]
            data = arr
        b = np.ascontiguousarray(data).tobytes()
        header[name] = {"dtype": code, "shape": list(arr.shape), "data_offsets": [offset, offset + len(b)]}
        chunks.append(b)
        offset += len(b)
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for b in chunks:
            f.write(b)
    return offset


# stored dtype code -> numpy type of the bytes ``write_streamed``'s producers return
STORED_NP = {"BF16": np.uint16, "F8_E4M3": np.uint8, **_NP}
_ITEMSIZE = {code: np.dtype(t).itemsize for code, t in STORED_NP.items()}


def write_streamed(
    path: str | Path,
    entries: list[tuple[str, str, list[int]]],
    produce: Callable[[str], np.ndarray],
    metadata=None,
) -> int:
    """Write a safetensors file one tensor at a time: ``entries`` are (name, stored dtype code, shape) in
    file order and ``produce(name)`` returns each tensor's values in the stored type (bf16 as uint16 bits)
    only when it is written, so no more than one tensor is held. Returns bytes of tensor data."""
    header: dict = {"__metadata__": {"format": "pd", **(metadata or {})}}
    offset = 0
    for name, code, shape in entries:
        n = _ITEMSIZE[code] * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for name, code, shape in entries:
            arr = np.ascontiguousarray(produce(name))
            if arr.dtype != STORED_NP[code] or list(arr.shape) != list(shape):
                raise ValueError(f"{path}: {name} came as {arr.dtype} {list(arr.shape)}, not {code} {shape}")
            f.write(memoryview(arr).cast("B"))
    return offset
