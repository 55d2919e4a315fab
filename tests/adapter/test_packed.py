"""The adapter file the learner sends to the engines every step (`visionrl.adapter.packed`), read back by
safetensors' own reader."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load, save

from visionrl.adapter.packed import pack_safetensors


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "layers.0.q.lora_A.weight": torch.randn(4, 16, generator=gen).to(torch.bfloat16),
        "layers.0.q.lora_B.weight": torch.randn(16, 4, generator=gen),
        "half": torch.randn(3, 5, generator=gen).half(),
        "steps": torch.tensor([1, -2, 3], dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 7),
        "strided": torch.arange(12.0)
        .reshape(3, 4)
        .t(),  # not contiguous: its values, not its storage, are kept
    }


def test_safetensors_reads_every_tensor_back_exactly() -> None:
    tensors = _tensors()
    packed = pack_safetensors(tensors, {"format": "pt"})
    assert packed.dtype == np.uint8 and packed.ndim == 1
    back = load(bytes(packed))
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape, name
        assert torch.equal(back[name], t), name


def test_the_file_on_disk_opens_with_its_metadata_and_aligned_tensors(tmp_path: Path) -> None:
    """What vLLM and peft open: the file written from the buffer, its metadata, the tensors 8-byte aligned."""
    path = tmp_path / "adapter_model.safetensors"
    path.write_bytes(pack_safetensors(_tensors(), {"format": "pt"}))  # the engine writes the array as it is
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert torch.equal(f.get_tensor("steps"), torch.tensor([1, -2, 3]))
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    assert (8 + length) % 8 == 0
    header = json.loads(raw[8 : 8 + length])
    ends = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ends, ends[1:], strict=False))
    assert ends[-1][1] == len(raw) - 8 - length  # back to back, nothing after the last


def test_same_tensors_as_safetensors_own_writer() -> None:
    """The byte layout differs (order, padding); what a reader gets does not."""
    tensors = {k: v for k, v in _tensors().items() if k != "strided"}
    ours, theirs = load(bytes(pack_safetensors(tensors))), load(save(tensors))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_an_empty_set_is_a_valid_file_and_a_dtype_safetensors_lacks_is_named() -> None:
    assert load(bytes(pack_safetensors({}))) == {}
    with pytest.raises(ValueError, match="'z'.*complex64"):
        pack_safetensors({"z": torch.zeros(2, dtype=torch.complex64)})
