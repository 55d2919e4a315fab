"""Tests of visionrl.serve without vLLM: fetching verified adapter copies, the server command line and
environment, the child-process handle (against a small fake server process), and the adapter HTTP calls.

The real vLLM server is exercised once, in tests/integration/test_serving.py.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from visionrl.adapter.export import export_adapter
from visionrl.adapter.fetch import fetch_adapter
from visionrl.adapter.files import MANIFEST_NAME
from visionrl.errors import ExportError, InputError
from visionrl.serve.adapters import ServedAdapter, list_models, load_adapter, served_adapter, unload_adapter
from visionrl.serve.process import ServerError, ServerHandle, free_port, root_url
from visionrl.serve.server import run_server, server_command, server_env

LM_TARGETS = r".*language_model.*\.(q_proj|v_proj)"
MERGER_TARGETS = r".*language_model.*\.(q_proj|v_proj)|.*visual\.merger\.(linear_fc1|linear_fc2)"
PEFT = "base_model.model.model."


def _make_adapter(folder: Path, *, rank: int = 8, merger: bool = False, fill: float = 0.5) -> Path:
    """A peft-layout LoRA adapter written by hand (no model needed): q/v projections, and the merger."""
    folder.mkdir(parents=True)
    modules = ["language_model.layers.0.self_attn.q_proj", "language_model.layers.0.self_attn.v_proj"]
    if merger:
        modules += ["visual.merger.linear_fc1", "visual.merger.linear_fc2"]
    tensors = {}
    for module in modules:
        tensors[f"{PEFT}{module}.lora_A.weight"] = torch.full((rank, 4), fill)
        tensors[f"{PEFT}{module}.lora_B.weight"] = torch.full((4, rank), fill)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": MERGER_TARGETS if merger else LM_TARGETS,
        "base_model_name_or_path": "tiny-base",
        "bias": "none",
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture()
def exported(tmp_path: Path) -> Path:
    """A complete export (files + manifest) in a local folder."""
    export_adapter(_make_adapter(tmp_path / "adapter", merger=True), tmp_path / "export")
    return tmp_path / "export"


# --------------------------------------------------------------------------- fetch_adapter


def test_fetch_copies_and_verifies_a_local_export(exported: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    copy = fetch_adapter(exported, cache)
    assert copy.parent == cache
    names = {"adapter_config.json", "adapter_model.safetensors", MANIFEST_NAME}
    assert {p.name for p in copy.iterdir()} == names
    for name in names:
        assert (copy / name).read_bytes() == (exported / name).read_bytes()
    assert fetch_adapter(exported, cache) == copy  # cached
    assert [p.name for p in cache.iterdir()] == [copy.name]  # no temporary folders left behind


def test_a_reexport_gets_a_new_cache_folder(exported: Path, tmp_path: Path) -> None:
    first = fetch_adapter(exported, tmp_path / "cache")
    export_adapter(_make_adapter(tmp_path / "other", fill=0.25), exported)
    second = fetch_adapter(exported, tmp_path / "cache")
    assert second != first
    assert (second / "adapter_model.safetensors").read_bytes() == (
        tmp_path / "other" / "adapter_model.safetensors"
    ).read_bytes()


def test_fetch_refuses_an_export_without_manifest(tmp_path: Path) -> None:
    adapter = _make_adapter(tmp_path / "adapter")
    with pytest.raises(ExportError, match="not a complete export"):
        fetch_adapter(adapter, tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_fetch_refuses_a_tampered_file_and_names_it(exported: Path, tmp_path: Path) -> None:
    weights = exported / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    weights.write_bytes(bytes(data))
    with pytest.raises(ExportError, match=r"adapter_model\.safetensors .*does not match the sha256"):
        fetch_adapter(exported, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []  # no half copy to be served later


def test_fetch_replaces_a_damaged_cached_copy(exported: Path, tmp_path: Path) -> None:
    copy = fetch_adapter(exported, tmp_path / "cache")
    (copy / "adapter_model.safetensors").write_bytes(b"damaged")
    assert fetch_adapter(exported, tmp_path / "cache") == copy
    assert (copy / "adapter_model.safetensors").read_bytes() == (
        exported / "adapter_model.safetensors"
    ).read_bytes()


def test_fetch_refuses_a_manifest_with_a_path_as_file_name(exported: Path, tmp_path: Path) -> None:
    manifest = json.loads((exported / MANIFEST_NAME).read_text())
    manifest["files"]["../outside"] = {"sha256": "0" * 64, "bytes": 1}
    (exported / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ExportError, match="bad entry for file '../outside'"):
        fetch_adapter(exported, tmp_path / "cache")
    assert not (tmp_path / "outside").exists()


def test_default_cache_follows_the_environment(
    exported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VISIONRL_ADAPTER_CACHE", str(tmp_path / "env-cache"))
    assert fetch_adapter(exported).parent == tmp_path / "env-cache"


def test_fetch_command_prints_the_verified_copy(
    exported: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from visionrl.cli import main

    assert main(["fetch", str(exported), "--cache-dir", str(tmp_path / "cache")]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path.parent == (tmp_path / "cache").resolve() and (path / MANIFEST_NAME).is_file()
    (exported / MANIFEST_NAME).unlink()
    assert main(["fetch", str(exported), "--cache-dir", str(tmp_path / "cache")]) == 2
    assert "not a complete export" in capsys.readouterr().err


# --------------------------------------------------------------------------- command line and environment


def _served(tmp_path: Path, name: str, **kwargs: Any) -> ServedAdapter:
    return served_adapter(name, _make_adapter(tmp_path / name, **kwargs))


def _flag(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_command_has_the_tower_flag_only_for_merger_lora(tmp_path: Path) -> None:
    lm = _served(tmp_path, "lm")
    merger = _served(tmp_path, "merger", merger=True)
    assert (lm.tower_connector_lora, merger.tower_connector_lora) == (False, True)
    common = {"host": "127.0.0.1", "port": 8123, "cpu": False}
    assert "--enable-tower-connector-lora" not in server_command("base", [lm], **common)
    cmd = server_command("base", [lm, merger], **common)
    assert cmd.count("--enable-tower-connector-lora") == 1
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(cmd, "--model") == "base" and "--enable-lora" in cmd
    assert cmd[cmd.index("--lora-modules") + 1 : cmd.index("--lora-modules") + 3] == [
        f"lm={lm.path}",
        f"merger={merger.path}",
    ]
    assert _flag(cmd, "--max-loras") == "2"
    assert (_flag(cmd, "--host"), _flag(cmd, "--port")) == ("127.0.0.1", "8123")
    assert "--dtype" not in cmd and "--max-model-len" not in cmd  # GPU: the model's own settings
    # Adapters loaded later may train the merger: the flag can be asked for without such an adapter.
    assert "--enable-tower-connector-lora" in server_command("base", [], tower_connector_lora=True, **common)


@pytest.mark.parametrize(("ranks", "requested", "expected"), [
    ([8], None, "8"), ([12], None, "16"), ([8, 40], None, "64"), ([], None, "16"), ([8], 20, "32"),
])  # fmt: skip
def test_max_lora_rank_is_rounded_up_to_a_vllm_value(
    tmp_path: Path, ranks: list[int], requested: int | None, expected: str
) -> None:
    adapters = [_served(tmp_path, f"a{i}", rank=r) for i, r in enumerate(ranks)]
    cmd = server_command("base", adapters, host="h", port=1, cpu=False, max_lora_rank=requested)
    assert _flag(cmd, "--max-lora-rank") == expected


def test_requested_rank_below_an_adapter_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="below the adapters' rank 16"):
        server_command(
            "base", [_served(tmp_path, "a", rank=16)], host="h", port=1, cpu=False, max_lora_rank=8
        )


def test_cpu_command_is_float32_with_a_modest_context_and_extra_args_come_last(tmp_path: Path) -> None:
    cmd = server_command("base", [], host="h", port=1, cpu=True, extra=["--max-model-len", "1024"])
    assert _flag(cmd, "--dtype") == "float32"
    assert cmd[-2:] == ["--max-model-len", "1024"]  # argparse keeps the last value: the user's wins
    assert "--lora-modules" not in cmd and _flag(cmd, "--max-loras") == "1"


def test_unservable_adapter_and_bad_names_are_refused(tmp_path: Path) -> None:
    folder = _make_adapter(tmp_path / "dora")
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ExportError, match="DoRA"):
        served_adapter("dora", folder)
    with pytest.raises(InputError, match="not usable"):
        served_adapter("two words", _make_adapter(tmp_path / "ok"))


def test_lm_head_lora_is_refused_when_the_manifest_names_a_qwen2_5_vl_base(tmp_path: Path) -> None:
    """vLLM takes no LoRA on Qwen2.5-VL's lm_head (docs/ENGINE_NOTES.md): an export whose manifest records such a
    base is refused before any server starts; the same adapter on a Qwen3-VL base, or without a manifest, is not."""
    folder = _make_adapter(tmp_path / "head")
    save_file({f"base_model.model.lm_head.lora_{ab}.weight": torch.ones(2, 2) for ab in "AB"},
              str(folder / "adapter_model.safetensors"))  # fmt: skip
    assert served_adapter("plain", folder).max_lora_rank == 8  # no manifest: no architecture rule
    for model_type, refused in (("qwen3_vl", False), ("qwen2_5_vl", True)):
        manifest = {"base_model": {"model_type": model_type}}
        (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
        if refused:
            with pytest.raises(ExportError, match="lm_head of a qwen2_5_vl base.*train_lm_head: false"):
                served_adapter("head", folder)
        else:
            assert served_adapter("head", folder).name == "head"


@pytest.mark.parametrize(("adapters", "fragment"), [
    (["color"], "is not NAME=SRC"), (["=s3://b/p"], "is not NAME=SRC"), (["a=x", "a=y"], "given twice"),
])  # fmt: skip
def test_serve_refuses_bad_adapter_arguments_before_starting(adapters: list[str], fragment: str) -> None:
    from visionrl.serve.server import serve

    with pytest.raises(InputError, match=fragment):
        serve("base", adapters, port=free_port())


def test_server_env_enables_runtime_lora_and_cpu_defaults_without_overriding(tmp_path: Path) -> None:
    env = server_env(str(tmp_path), cpu=True, environ={"VLLM_CPU_KVCACHE_SPACE": "8", "KEEP": "1"})
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "8" and env["KEEP"] == "1"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and env["HF_HUB_OFFLINE"] == "1"
    gpu = server_env("org/hub-model", cpu=False, environ={})
    assert "VLLM_CPU_KVCACHE_SPACE" not in gpu and "HF_HUB_OFFLINE" not in gpu


def test_root_url_accepts_the_openai_base_url() -> None:
    assert root_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert root_url("http://127.0.0.1:8000") == "http://127.0.0.1:8000"


# --------------------------------------------------------------------------- the child process

# A stand-in for vLLM's server: prints a line, answers GET /v1/models, exits 0 on SIGTERM.
# argv: port, mode ("serve", or "die" to exit with code 3 before listening).
FAKE_SERVER = """
import json, signal, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
port, mode = int(sys.argv[1]), sys.argv[2]
print("fake server: loading", flush=True)
if mode == "die":
    print("fatal: the model does not fit", flush=True)
    sys.exit(3)
class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"data": [{"id": "base"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
def stop(signum, frame):
    print(f"fake server: stopping on signal {signum}", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def _fake_handle(mode: str, tmp_path: Path) -> ServerHandle:
    port = free_port()
    return ServerHandle([sys.executable, "-c", FAKE_SERVER, str(port), mode], url=f"http://127.0.0.1:{port}/v1",
                        log_path=tmp_path / "server.log")  # fmt: skip


@pytest.fixture()
def fake_server(tmp_path: Path) -> Iterator[ServerHandle]:
    handle = _fake_handle("serve", tmp_path)
    try:
        yield handle
    finally:
        handle.stop()


def test_handle_waits_until_ready_and_stops_cleanly(fake_server: ServerHandle, tmp_path: Path) -> None:
    fake_server.start()
    fake_server.wait_ready(60, poll_s=0.05)
    assert list_models(fake_server.base_url) == ["base"]
    assert fake_server.stop() == 0
    assert fake_server.poll() == 0 and fake_server.stop() == 0  # idempotent
    log = (tmp_path / "server.log").read_text()
    assert "fake server: loading" in log and f"stopping on signal {int(signal.SIGTERM)}" in log


@pytest.mark.slow  # starts a (fake) server process
def test_early_exit_is_reported_with_the_log_tail(tmp_path: Path) -> None:
    handle = _fake_handle("die", tmp_path)
    try:
        handle.start()
        with pytest.raises(ServerError, match=r"exited with code 3 .*\n(.*\n)*fatal: the model does not fit"):
            handle.wait_ready(60, poll_s=0.05)
    finally:
        handle.stop()


@pytest.mark.slow  # starts a (fake) server process
def test_run_server_forwards_sigterm_and_returns_0(
    fake_server: ServerHandle, capsys: pytest.CaptureFixture[str]
) -> None:
    # Our own process gets SIGTERM once the server is up: run_server must pass it on and return cleanly.
    before = signal.getsignal(signal.SIGTERM)
    code = run_server(
        fake_server, ready_timeout_s=60, on_ready=lambda h: os.kill(os.getpid(), signal.SIGTERM)
    )
    assert code == 0 and fake_server.poll() == 0
    out = capsys.readouterr().out
    assert f"at {fake_server.url}" in out and "models: base" in out
    assert signal.getsignal(signal.SIGTERM) == before  # our handler is gone again


@pytest.mark.slow  # starts a (fake) server process
def test_run_server_fails_when_the_server_dies(
    fake_server: ServerHandle, capsys: pytest.CaptureFixture[str]
) -> None:
    code = run_server(fake_server, ready_timeout_s=60, on_ready=lambda h: os.kill(h.pid or 0, signal.SIGKILL))
    assert code == 1
    assert "exited with code -9" in capsys.readouterr().err


@pytest.mark.slow  # starts a (fake) server process
def test_run_server_fails_when_the_server_cannot_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    handle = _fake_handle("die", tmp_path)
    assert run_server(handle, ready_timeout_s=60) == 1
    assert "fatal: the model does not fit" in capsys.readouterr().err


# --------------------------------------------------------------------------- adapter HTTP calls


class _AdapterAPI(BaseHTTPRequestHandler):
    """vLLM's adapter endpoints, in memory: records request bodies, 404 for an unknown adapter."""

    loaded: dict[str, str] = {}
    bodies: list[tuple[str, dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append((self.path, body))
        name = body["lora_name"]
        if self.path == "/v1/load_lora_adapter":
            self.loaded[name] = body["lora_path"]
            self._send(200, b"Success")
        elif name in self.loaded:
            del self.loaded[name]
            self._send(200, b"Success")
        else:
            error = {"error": {"message": f"The lora adapter '{name}' cannot be found.", "code": 404}}
            self._send(404, json.dumps(error).encode())

    def do_GET(self) -> None:
        self._send(200, json.dumps({"data": [{"id": n} for n in ["base", *self.loaded]]}).encode())

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture()
def adapter_api() -> Iterator[str]:
    _AdapterAPI.loaded, _AdapterAPI.bodies = {}, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _AdapterAPI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_load_and_unload_adapter_requests(adapter_api: str, exported: Path, tmp_path: Path) -> None:
    path = load_adapter(adapter_api + "/v1", "color-v2", exported, cache_dir=tmp_path / "cache")
    assert _AdapterAPI.bodies == [
        ("/v1/load_lora_adapter", {"lora_name": "color-v2", "lora_path": str(path)})
    ]
    assert path.is_absolute() and (path / MANIFEST_NAME).is_file()
    assert list_models(adapter_api) == ["base", "color-v2"]
    unload_adapter(adapter_api, "color-v2")
    assert list_models(adapter_api) == ["base"]
    with pytest.raises(ServerError, match="HTTP 404: The lora adapter 'color-v2' cannot be found") as err:
        unload_adapter(adapter_api, "color-v2")
    assert err.value.status == 404


def test_load_adapter_sends_nothing_for_a_bad_export(adapter_api: str, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="not a complete export"):
        load_adapter(adapter_api, "raw", _make_adapter(tmp_path / "raw"), cache_dir=tmp_path / "cache")
    assert _AdapterAPI.bodies == []


def test_a_server_that_is_not_there_is_a_server_error() -> None:
    with pytest.raises(ServerError, match="no answer"):
        list_models(f"http://127.0.0.1:{free_port()}", timeout_s=2)


# --------------------------------------------------------------------------- the image budget


def _with_manifest(folder: Path, data: dict[str, Any]) -> Path:
    """`folder`'s adapter with the manifest of a run whose job config has `data`."""
    from visionrl.adapter.manifest import build_manifest, manifest_budget, write_manifest
    from visionrl.adapter.storage import filesystem
    from visionrl.config import config_from_dict

    job = config_from_dict(
        {
            "output_dir": "r",
            "model": {"path": "tiny-base"},
            "data": {"train": "t.jsonl", **data},
            "rewards": [{"name": "exact_match"}],
        }  # fmt: skip
    )
    manifest = build_manifest(
        folder, base_model="tiny-base", job_config=job.model_dump(mode="json"), eval_results=None
    )
    write_manifest(*filesystem(folder), manifest)
    assert manifest_budget(manifest) is not None
    return folder


def test_the_server_resizes_images_with_the_budget_the_adapter_was_trained_with(tmp_path: Path) -> None:
    data = {"min_pixels": 4096, "max_pixels": 200_704, "max_images_per_prompt": 2}
    folder = _with_manifest(_make_adapter(tmp_path / "a"), data)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    assert manifest["images"] == data  # recorded in the manifest, as trained
    cmd = server_command("base", [served_adapter("a", folder)], host="h", port=1, cpu=False)
    assert json.loads(_flag(cmd, "--mm-processor-kwargs")) == {
        "size": {"shortest_edge": 4096, "longest_edge": 200_704}
    }
    assert json.loads(_flag(cmd, "--limit-mm-per-prompt")) == {"image": 2, "video": 0}


def test_without_a_recorded_budget_the_server_uses_the_default_one(tmp_path: Path) -> None:
    from visionrl.data.images import DEFAULT_MAX_IMAGES, DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS

    cmd = server_command("base", [_served(tmp_path, "plain")], host="h", port=1, cpu=False)
    assert json.loads(_flag(cmd, "--mm-processor-kwargs"))["size"] == {
        "shortest_edge": DEFAULT_MIN_PIXELS,
        "longest_edge": DEFAULT_MAX_PIXELS,
    }
    assert json.loads(_flag(cmd, "--limit-mm-per-prompt"))["image"] == DEFAULT_MAX_IMAGES


def test_adapters_trained_with_different_budgets_cannot_share_a_server(tmp_path: Path) -> None:
    a = served_adapter("a", _with_manifest(_make_adapter(tmp_path / "a"), {"max_pixels": 200_704}))
    b = served_adapter("b", _with_manifest(_make_adapter(tmp_path / "b"), {"max_pixels": 1_048_576}))
    with pytest.raises(InputError, match="different image budgets .*serve them from separate servers"):
        server_command("base", [a, b], host="h", port=1, cpu=False)
    same = served_adapter("c", _with_manifest(_make_adapter(tmp_path / "c"), {"max_pixels": 200_704}))
    cmd = server_command("base", [a, same], host="h", port=1, cpu=False)
    assert json.loads(_flag(cmd, "--mm-processor-kwargs"))["size"]["longest_edge"] == 200_704


# --------------------------------------------------------------------------- API key and exposure


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.3.0.9", True), ("::1", True), ("localhost", True), ("0.0.0.0", False),
     ("10.1.2.3", False), ("::", False), ("node-7.cluster", False)],
)  # fmt: skip
def test_only_loopback_addresses_count_as_private(host: str, loopback: bool) -> None:
    from visionrl.serve.server import is_loopback

    assert is_loopback(host) is loopback


def test_a_network_address_needs_a_key_or_allow_insecure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before anything starts; with a key the key reaches vLLM through its environment only (argv is
    readable by every local user), and the handle sends it; $VLLM_API_KEY is the default key."""
    from visionrl.cli import main
    from visionrl.serve.server import prepare_server

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    base = str(tmp_path)
    assert main(["serve", "--base", base, "--host", "0.0.0.0", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "error: --host 0.0.0.0 makes the server reachable from the network" in err
    assert "--api-key KEY or the environment variable VLLM_API_KEY" in err and "--allow-insecure" in err
    port = free_port("0.0.0.0")
    open_handle = prepare_server(base, host="0.0.0.0", port=port, allow_insecure=True)
    assert open_handle.api_key is None and "VLLM_API_KEY" not in (open_handle.env or {})
    assert "--middleware" not in open_handle.command
    handle = prepare_server(base, host="0.0.0.0", port=port, api_key="s3cret")
    assert handle.api_key == "s3cret" and (handle.env or {})["VLLM_API_KEY"] == "s3cret"
    assert "s3cret" not in " ".join(handle.command)
    # with a key, the guard of every route (not only /v1) is loaded into the server
    assert handle.command[handle.command.index("--middleware") + 1] == "visionrl.serve.guard.KeyGuard"
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert prepare_server(base, host="0.0.0.0", port=port).api_key == "from-env"


def test_a_busy_port_is_refused_before_the_model_loads(tmp_path: Path) -> None:
    """vLLM found a taken port only after loading the model (30 s), with a traceback."""
    import socket

    from visionrl.serve.server import prepare_server

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(
            InputError, match=rf"port {port} on 127.0.0.1 cannot be used .*pass another --port"
        ):
            prepare_server(str(tmp_path), host="127.0.0.1", port=port)
    assert prepare_server(str(tmp_path), host="127.0.0.1", port=port).command  # free again: accepted


class _KeyedAPI(BaseHTTPRequestHandler):
    """Answers GET /v1/models only with `Authorization: Bearer k1`, like vLLM started with an API key."""

    def do_GET(self) -> None:
        ok = self.headers.get("Authorization") == "Bearer k1"
        body = json.dumps(
            {"data": [{"id": "base"}]} if ok else {"error": {"message": "Unauthorized"}}
        ).encode()
        self.send_response(200 if ok else 401)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_clients_send_the_key_and_a_missing_key_is_a_401(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _KeyedAPI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(ServerError, match="HTTP 401: Unauthorized") as err:
            list_models(url)
        assert err.value.status == 401
        assert list_models(url, api_key="k1") == ["base"]
        monkeypatch.setenv("VLLM_API_KEY", "k1")
        assert list_models(url) == ["base"]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
