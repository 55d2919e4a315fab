"""train.gpu_memory_gib on a real GPU: the learner's process cannot allocate past its cap (in a child process, since
the cap stays with the process that set it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import torch
from visionrl.orchestrate.actors import cap_gpu_memory
cap_gpu_memory(2.0)
kept = torch.empty(int(1.5 * 2**30), dtype=torch.uint8, device="cuda")  # under the cap: allocated
try:
    torch.empty(1 * 2**30, dtype=torch.uint8, device="cuda")  # 2.5 GiB together: refused
except torch.OutOfMemoryError:
    print("refused")
"""


def test_the_learners_cap_refuses_an_allocation_past_it() -> None:
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["refused"]
