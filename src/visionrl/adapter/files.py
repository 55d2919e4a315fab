"""The files of a PEFT LoRA adapter and the one reading of each: names, `adapter_config.json`, the
safetensors header, and peft's meaning of `target_modules`.

Every module that checks an adapter (export, fetch, serving, local evaluation, the HF engine) goes through
these functions, so an adapter is judged the same way everywhere and errors read the same.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from visionrl.errors import ExportError, InputError
from visionrl.files import atomic_write
from visionrl.types import ADAPTER_CONFIG, ADAPTER_FILES, ADAPTER_WEIGHTS

__all__ = [
    "ADAPTER_CONFIG", "ADAPTER_FILES", "ADAPTER_WEIGHTS", "MANIFEST_NAME", "check_weights_open",
    "has_adapter_files", "read_adapter_config", "read_json_object", "read_safetensors_header",
    "require_plain_lora", "target_regex", "targets_vision", "write_adapter_files",
]  # fmt: skip

MANIFEST_NAME = "visionrl_manifest.json"
_MAX_SAFETENSORS_HEADER = 100 << 20  # real headers are KBs; a larger length means a damaged file


def has_adapter_files(path: str | os.PathLike[str]) -> bool:
    """Whether `path` holds both PEFT files (config and safetensors weights)."""
    return all((Path(path) / name).is_file() for name in ADAPTER_FILES)


def read_json_object(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    """The JSON object in `path`; ExportError naming `what` if it is not valid JSON or not an object."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ExportError(f"{what} {path} is not valid JSON ({err}); re-create it") from None
    if not isinstance(data, dict):
        raise ExportError(f"{what} {path} must hold a JSON object, got {type(data).__name__}; re-create it")
    return data


def read_adapter_config(adapter_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """`adapter_config.json` of an adapter directory; ExportError if it is missing or unreadable."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not path.is_file():
        raise ExportError(f"{adapter_dir} has no {ADAPTER_CONFIG}: it is not a PEFT adapter directory")
    return read_json_object(path, "adapter config")


def read_safetensors_header(path: str | os.PathLike[str]) -> dict[str, str]:
    """{tensor name: dtype} from a safetensors file's JSON header, without loading any tensor."""
    path = Path(path)
    with path.open("rb") as f:
        raw_len = f.read(8)
        size = struct.unpack("<Q", raw_len)[0] if len(raw_len) == 8 else -1
        if not 0 < size <= min(_MAX_SAFETENSORS_HEADER, path.stat().st_size - 8):
            raise ExportError(
                f"{path} is not a valid safetensors file (bad header length); re-save the adapter"
            )
        try:
            header = json.loads(f.read(size))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ExportError(
                f"{path} has a damaged safetensors header ({err}); re-save the adapter"
            ) from None
    if not isinstance(header, dict):
        raise ExportError(f"{path} has a damaged safetensors header (not a mapping); re-save the adapter")
    return {name: str(info.get("dtype")) for name, info in header.items() if name != "__metadata__"}


def check_weights_open(adapter_dir: str | os.PathLike[str]) -> None:
    """Refuse weights that safetensors cannot open (a damaged or truncated file) before an engine starts."""
    from safetensors import SafetensorError, safe_open

    weights = Path(adapter_dir) / ADAPTER_WEIGHTS
    try:
        with safe_open(str(weights), "pt") as f:
            f.keys()
    except SafetensorError as err:
        raise InputError(
            f"{weights} cannot be read ({err}): the file is damaged or incomplete; re-save or re-export the adapter"
        ) from None


def target_regex(target_modules: str | Sequence[str], *, within: str | None = None) -> str:
    """`target_modules` as one full-match regex, with peft's meaning: a string is a regex already; a list of
    names matches a module whose name is one of them or ends in '.' + one of them. `within` (a regex)
    keeps list names to modules below it, e.g. `.*language_model` (the vision blocks reuse LM names)."""
    if isinstance(target_modules, str):
        return target_modules
    names = "|".join(re.escape(str(name)) for name in sorted(set(target_modules)))
    prefix = rf"{within}.*\." if within else r"(?:.*\.)?"
    return rf"{prefix}(?:{names})"


def targets_vision(target_modules: str | Sequence[str]) -> bool:
    """Whether the targets name vision modules (`visual.*`), i.e. the merger LoRA needs the tower flag."""
    return "visual" in target_regex(target_modules)


def require_plain_lora(adapter_config: dict[str, Any], where: str | os.PathLike[str]) -> None:
    """Refuse an adapter whose LoRA layout cannot be rebuilt from r, lora_alpha and target_modules alone
    (what both local engines do); `where` names it in the message."""
    missing = [k for k in ("r", "lora_alpha", "target_modules") if adapter_config.get(k) is None]
    if missing or not isinstance(adapter_config["r"], int):
        raise InputError(
            f"{where} lacks {', '.join(missing) or 'an integer r'}; pass a PEFT LoRA adapter folder"
        )
    unsupported = [k for k in ("modules_to_save", "rank_pattern", "alpha_pattern") if adapter_config.get(k)]
    if unsupported:
        raise InputError(
            f"{where} sets {', '.join(unsupported)}, which local evaluation does not support; "
            "save the adapter with plain LoRA layers (one rank and alpha, no modules_to_save)"
        )


def write_adapter_files(folder: Path, files: dict[str, bytes]) -> Path:
    """The adapter's files (e.g. a learner's `adapter_payload(for_engine=False).files`) in `folder`, each
    written to a new file renamed over the old one: a reader may still map the old (docs/ENGINE_NOTES.md)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        atomic_write(folder / name, data)
    return folder
