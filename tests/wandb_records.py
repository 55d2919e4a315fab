"""Reads what W&B wrote offline (`<dir>/wandb/offline-run-*/run-<id>.wandb`) back, for the tests: the file is a
header (":W&B", a 2-byte magic, a version byte) and then records in 32 KiB blocks, each record a 7-byte frame
(CRC, length, kind: 1 whole, 2 first, 3 middle, 4 last part) and a `Record` protobuf of wandb's own schema."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32768
FRAME = 7
WHOLE, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, found, part = FRAME, [], b""
    while pos + FRAME <= len(data):
        left = BLOCK - pos % BLOCK
        if left < FRAME:  # a block's tail too short for a frame is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + FRAME])
        if length == 0 and kind == 0:  # zero padding to the block's end
            pos += left
            continue
        chunk = data[pos + FRAME : pos + FRAME + length]
        pos += FRAME + length
        part = chunk if kind in (WHOLE, FIRST) else part + chunk
        if kind in (WHOLE, LAST):
            record = pb.Record()
            record.ParseFromString(part)
            found.append(record)
    return found


def history(run_dir: Path) -> list[dict[str, Any]]:
    """Every `run.log` row of the offline W&B runs under `run_dir` (a resumed run's rows after the first's), each
    value as the JSON W&B stored (a picture or a table is a dict naming its file)."""
    rows = []
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)
    for path in files:
        for record in records(path):
            if record.WhichOneof("record_type") != "history":
                continue
            row: dict[str, Any] = {}
            for item in record.history.item:
                value = json.loads(item.value_json)
                key = [item.key] if item.key else list(item.nested_key)
                if len(key) == 1:
                    row[key[0]] = value
                else:  # a picture's or a table's fields: [tag, field]
                    row.setdefault(item.nested_key[0], {})["/".join(item.nested_key[1:])] = value
            rows.append(row)
    return rows


def written_history(run_dir: Path, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """`history(run_dir)` once every offline run file there holds its exit record: `run.finish()` hands the end to
    W&B's own service process, which writes the run's last records to the file a moment later."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        files = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
        ended = [any(r.WhichOneof("record_type") == "exit" for r in records(f)) for f in files]
        if files and all(ended):
            return history(run_dir)
        if time.monotonic() > deadline:
            raise AssertionError(
                f"W&B's offline run files under {run_dir} hold no exit record after {timeout_s} s"
            )
        time.sleep(0.2)


def run_ids(run_dir: Path) -> set[str]:
    return {p.stem.removeprefix("run-") for p in run_dir.glob("wandb/offline-run-*/run-*.wandb")}
