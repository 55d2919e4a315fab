"""A safetensors file built in one host buffer: the adapter the learner sends to the engines every step.

`safetensors.torch.save` takes each tensor to the host on its own, turns each into a bytes object and joins them;
the payload then crossed Ray as a bytes object, pickled into the object store and copied out again. For an 8B
model's r64 adapter (504 tensors, 333 MiB) that was 0.48 s to build and 0.45 s on the way (the sync's profile
in benchmarks/NOTES-gpu-learner.md). Here the tensors are joined on their own device and copied to the host once, into
the file's own buffer, a numpy array: Ray moves a numpy array through its object store without pickling its bytes,
and a reader on the same node gets it without a copy.

The format is safetensors' own: the header's length (8 bytes, little-endian), the JSON header {name: {dtype, shape,
data_offsets}, "__metadata__": {...}} padded with spaces to a multiple of 8 bytes, then every tensor's bytes, back
to back in the header's order.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping

import numpy as np
import torch

__all__ = ["pack_safetensors"]

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}  # fmt: skip


def pack_safetensors(
    tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> np.ndarray:
    """The safetensors file of `tensors` (all on one device) as a flat uint8 array: the tensors joined on their
    device and copied to the host in one transfer, straight into the file's buffer."""
    header: dict[str, object] = {}
    parts: list[torch.Tensor] = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name].detach()
        if t.dtype not in _DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}, which a safetensors file cannot hold")
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": _DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        parts.append(t.contiguous().reshape(-1).view(torch.uint8))
        offset += size
    if metadata:
        header["__metadata__"] = dict(metadata)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-(8 + len(head)) % 8)  # the tensors start 8-byte aligned
    start = 8 + len(head)
    out = np.empty(start + offset, dtype=np.uint8)
    out[:start] = np.frombuffer(struct.pack("<Q", len(head)) + head, dtype=np.uint8)
    if not parts or offset == 0:
        return out
    if parts[0].device.type == "cpu":  # each tensor straight into its place: one copy
        at = start
        for part in parts:
            np.copyto(out[at : at + part.numel()], part.numpy())
            at += part.numel()
    else:  # joined on the device, then one transfer to the host
        torch.from_numpy(out[start:]).copy_(torch.cat(parts))
    return out
