"""Are the floating-point tensors of a safetensors file finite? One NaN or infinity in a LoRA matrix makes
every answer of the served model garbage, so checkpoints, the run's final adapter and `visionrl export` refuse
such weights. Shared by the checkpoint and adapter modules, below both.

Read straight from the safetensors bytes (header + raw little-endian tensors) with numpy: no torch, and a
memory map for files, so checking a few hundred MB costs one pass over them.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from visionrl.errors import ExportError

_FLOATS = {"F64": np.float64, "F32": np.float32, "F16": np.float16}
_BF16_EXPONENT = 0x7F80  # bfloat16: all exponent bits set means infinity or NaN


def nonfinite_tensors(data: bytes | memoryview | np.ndarray, source: str = "adapter weights") -> list[str]:
    """Names of the floating-point tensors of a safetensors file (its bytes) holding a NaN or an infinity."""
    buf = np.frombuffer(data, dtype=np.uint8)
    if buf.size < 8:
        raise ExportError(f"{source} is not a safetensors file (only {buf.size} bytes); re-save the adapter")
    (size,) = struct.unpack("<Q", buf[:8].tobytes())
    if not 0 < size <= buf.size - 8:
        raise ExportError(
            f"{source} is not a valid safetensors file (bad header length); re-save the adapter"
        )
    try:
        header = json.loads(buf[8 : 8 + size].tobytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ExportError(f"{source} has a damaged safetensors header ({err}); re-save the adapter") from None
    body = buf[8 + size :]
    bad = []
    for name, info in header.items():
        if name == "__metadata__" or not isinstance(info, dict):
            continue
        start, end = info.get("data_offsets", (0, 0))
        raw = body[start:end]
        dtype = info.get("dtype")
        if dtype in _FLOATS:
            values = raw.view(np.dtype(_FLOATS[dtype]).newbyteorder("<"))
            finite = bool(np.isfinite(values).all())
        elif dtype == "BF16":
            finite = not bool(((raw.view("<u2") & _BF16_EXPONENT) == _BF16_EXPONENT).any())
        else:
            continue  # integer tensors are always finite
        if not finite:
            bad.append(name)
    return bad


def nonfinite_in_file(path: str | os.PathLike[str]) -> list[str]:
    """`nonfinite_tensors` of the safetensors file at `path` (memory-mapped)."""
    path = Path(path)
    if path.stat().st_size == 0:
        raise ExportError(f"{path} is empty: not a safetensors file; re-save the adapter")
    return nonfinite_tensors(np.memmap(path, dtype=np.uint8, mode="r"), str(path))


def describe(bad: list[str]) -> str:
    """`3 tensor(s) with NaN or infinity, e.g. a, b`."""
    return f"{len(bad)} tensor(s) with NaN or infinite values, e.g. {', '.join(bad[:3])}"
