"""Adapters of a vLLM server: which settings an adapter needs (`served_adapter`), and loading, unloading and
listing them on a running server over its HTTP API (vLLM's runtime LoRA updating).

Every adapter a server reads is a verified local copy (`visionrl.adapter.fetch`) that passed the serving
check (`visionrl.adapter.servable`): a damaged or unservable adapter never reaches vLLM.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from visionrl.adapter.fetch import fetch_adapter
from visionrl.adapter.files import (
    ADAPTER_WEIGHTS,
    MANIFEST_NAME,
    read_adapter_config,
    read_json_object,
    read_safetensors_header,
)
from visionrl.adapter.manifest import read_local_budget
from visionrl.adapter.servable import check_servable
from visionrl.data.images import ImageBudget
from visionrl.errors import ExportError, InputError
from visionrl.serve.process import api_key_from_env, http_json, root_url


@dataclass(frozen=True)
class ServedAdapter:
    """A verified local adapter and the vLLM settings it needs (from `visionrl.adapter.servable.check_servable`)."""

    name: str
    path: Path
    max_lora_rank: int
    tower_connector_lora: bool
    budget: ImageBudget | None = None  # the image budget it was trained with (its manifest), if recorded


def _check_name(name: str) -> None:
    if not name or any(c.isspace() for c in name) or "=" in name or "/" in name:
        raise InputError(
            f"adapter name {name!r} is not usable: give a non-empty name without spaces, '=' or '/', "
            "e.g. --adapter color-v1=s3://bucket/run1"
        )


def _base_model_type(folder: Path) -> str | None:
    """The base model's model_type that an export's manifest records (None for a plain PEFT folder)."""
    if not (folder / MANIFEST_NAME).is_file():
        return None
    base = read_json_object(folder / MANIFEST_NAME, "adapter manifest").get("base_model")
    model_type = base.get("model_type") if isinstance(base, dict) else None
    return model_type if isinstance(model_type, str) else None


def served_adapter(name: str, path: str | os.PathLike[str]) -> ServedAdapter:
    """Check that vLLM serves the adapter at `path` as trained; raise ExportError with the problems if not."""
    _check_name(name)
    folder = Path(path)
    config = read_adapter_config(folder)
    weights = folder / ADAPTER_WEIGHTS
    tensors = read_safetensors_header(weights) if weights.is_file() else None
    check = check_servable(config, tensors, _base_model_type(folder))
    if not check["ok"]:
        raise ExportError(
            f"vLLM cannot serve adapter {name!r} ({folder}) as trained:\n  - "
            + "\n  - ".join(check["problems"])
        )
    budget = read_local_budget(folder)
    return ServedAdapter(name, folder, check["max_lora_rank"], check["tower_connector_lora"], budget)


def list_models(url: str, timeout_s: float = 10.0, *, api_key: str | None = None) -> list[str]:
    """The model ids a server offers (the base model and every loaded adapter): GET /v1/models. `api_key`:
    the server's key (default $VLLM_API_KEY), as for every call below."""
    body = http_json(
        "GET", f"{root_url(url)}/v1/models", timeout_s=timeout_s, api_key=api_key_from_env(api_key)
    )
    return [str(m["id"]) for m in json.loads(body).get("data", [])]


def load_adapter(
    url: str, name: str, src: str | os.PathLike[str], *, cache_dir: str | os.PathLike[str] | None = None,
    timeout_s: float = 120.0, api_key: str | None = None,
) -> Path:  # fmt: skip
    """Fetch and verify the export at `src`, then have the server at `url` load it as `name`; returns the
    local copy. The server reads that path from its own disk: call this on the server's machine.

    Equivalent HTTP calls (for a README; `visionrl fetch SRC` prints the verified local copy):

        curl -X POST http://127.0.0.1:8000/v1/load_lora_adapter -H 'Content-Type: application/json' \\
             -d '{"lora_name": "color-v2", "lora_path": "'"$(visionrl fetch s3://bucket/run2)"'"}'
        curl -X POST http://127.0.0.1:8000/v1/unload_lora_adapter -H 'Content-Type: application/json' \\
             -d '{"lora_name": "color-v2"}'
        curl http://127.0.0.1:8000/v1/models

    Give every new adapter version a new name: vLLM keys cached image embeddings by adapter, so reloading
    changed weights under an old name may serve stale results. A server started without an adapter that
    trains the vision merger needs `tower_connector_lora=True` (`--vllm-arg=--enable-tower-connector-lora`)
    to apply such adapters loaded later. Raises ExportError (bad export) or ServerError (the server refused).
    """
    path = served_adapter(name, fetch_adapter(src, cache_dir)).path
    payload = {"lora_name": name, "lora_path": str(path.resolve())}
    http_json("POST", f"{root_url(url)}/v1/load_lora_adapter", payload, timeout_s=timeout_s,
              api_key=api_key_from_env(api_key))  # fmt: skip
    return path


def unload_adapter(url: str, name: str, *, timeout_s: float = 60.0, api_key: str | None = None) -> None:
    """Have the server at `url` stop offering adapter `name` (POST /v1/unload_lora_adapter)."""
    http_json("POST", f"{root_url(url)}/v1/unload_lora_adapter", {"lora_name": name}, timeout_s=timeout_s,
              api_key=api_key_from_env(api_key))  # fmt: skip
