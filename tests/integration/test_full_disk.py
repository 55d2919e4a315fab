"""A disk that fills in a real run (Ray actors, the HF engine, the tiny Qwen3-VL, real tmpfs mounts): under
TensorBoard mid-run, and under the final adapter. Each ends with the storage error (the path, the bytes, what to
do, the checkpoint to continue from), exit 1, the previous checkpoint intact; `--resume auto` then finishes the
run. Rows of docs/RELIABILITY.md."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
from small_job import small_job, write_job

from visionrl.adapter.manifest import verify_adapter
from visionrl.checkpoint import latest_checkpoint, load_checkpoint
from visionrl.cli import main
from visionrl.metrics import REWARD_MEAN, read_scalars

pytestmark = pytest.mark.slow


def _job_file(model: Path, data_dir: Path, out: Path, path: Path, **over: dict | list) -> str:
    return write_job(small_job(model, data_dir, out, **over), path)


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "history.jsonl").read_text().splitlines()]


def test_a_full_disk_at_the_final_adapter_keeps_the_checkpoint_and_resume_exports_it(
    tiny_model: Path,
    color_data: Path,
    tmp_path: Path,
    shared_ray,
    small_disk,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`<run>/adapter` on a 4 KiB disk: the adapter config fits, its weights do not. The run trains and
    checkpoints both steps, then stops at the export with the storage error and exit 1, no manifest (nobody takes
    the half export); with room again `--resume auto` exports the adapter of the last checkpoint."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "adapter").symlink_to(small_disk(4096, real=True))
    job = _job_file(tiny_model, color_data, run, tmp_path / "job.yaml")
    assert main(["train", job]) == 1
    err = capsys.readouterr().err
    ckpt = latest_checkpoint(run)
    assert ckpt is not None and load_checkpoint(ckpt).step == 2  # intact and loadable
    # The export writes the learner's full-precision adapter, the same bytes as the checkpoint's adapter/.
    files = json.loads((ckpt / "checkpoint.json").read_text())["files"]
    needed = sum(f["bytes"] for rel, f in files.items() if rel.startswith("adapter/"))
    assert f"error: the disk is full: writing {run / 'adapter'} needs {needed:,} bytes, " in err, err
    assert "No manifest was written, so no reader takes this export. To fix: free space there" in err
    assert f"the newest checkpoint is {ckpt}; continue with `visionrl train CONFIG --resume auto`" in err
    assert "Exception in thread" not in err and "[Errno" not in err  # no raw OSError, no thread dump
    assert not (run / "adapter" / "visionrl_manifest.json").exists()

    (run / "adapter").unlink()  # room again
    assert main(["train", job, "--resume", "auto"]) == 0
    manifest = verify_adapter(run / "adapter")
    weights = (run / "adapter" / "adapter_model.safetensors").read_bytes()
    assert weights == (ckpt / "adapter" / "adapter_model.safetensors").read_bytes()
    assert set(manifest["files"]) == {"adapter_config.json", "adapter_model.safetensors"}
    assert _steps(run) == [1, 2]  # nothing trained again


FILLER = textwrap.dedent(
    """
    import errno
    import os
    from pathlib import Path


    def score(completion, answer, record, run="", disk=""):
        # Another writer fills the disk once step 1 is checkpointed (so during step 2's rewards); once a test.
        filler, once = Path(disk) / "filler", Path(run).with_name("disk_filled")
        if (Path(run) / "checkpoints" / "step_1").is_dir() and not once.exists():
            once.touch()
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
            try:
                while True:
                    os.write(fd, b"x" * 4096)
            except OSError as err:
                assert err.errno == errno.ENOSPC
            finally:
                os.close(fd)
        return 1.0 if completion.strip().split()[:1] == [str(answer)] else 0.0
    """
)


def test_a_disk_filling_under_tensorboard_mid_run_stops_with_the_checkpoint_to_continue_from(
    tiny_model: Path,
    color_data: Path,
    tmp_path: Path,
    shared_ray,
    small_disk,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`<run>/tensorboard` on a 1 MiB disk that a reward fills during step 2: step 2's TensorBoard write ends the
    run with the storage error naming the folder, exit 1, step 1's checkpoint intact; with room again
    `--resume auto` runs step 2 again and TensorBoard shows each step once."""
    (shared_ray.modules / "disk_filler_vr.py").write_text(FILLER)  # importable here and in the Ray workers
    run, disk = tmp_path / "run", small_disk(1 << 20, real=True)
    run.mkdir()
    (run / "tensorboard").symlink_to(disk)
    rewards = [{"name": "disk_filler_vr:score", "kwargs": {"run": str(run), "disk": str(disk)}}]
    # Step 2 writes a picture of its rollouts too (tens of KB): tmpfs takes small writes into the free end of the
    # last page it gave the event file, even when it is full.
    job = _job_file(
        tiny_model, color_data, run, tmp_path / "job.yaml", rewards=rewards, logging={"images_every": 2}
    )
    assert main(["train", job]) == 1
    err = capsys.readouterr().err
    assert (tmp_path / "disk_filled").is_file(), "the disk was never filled: the test tests nothing"
    ckpt = run / "checkpoints" / "step_1"
    assert latest_checkpoint(run) == ckpt and load_checkpoint(ckpt).step == 1
    where = re.escape(str(run / "tensorboard"))
    assert re.search(
        rf"error: the disk is full: writing {where} needs [\d,]+ bytes, [\d,]+ bytes free", err
    ), err
    assert "The events written before are intact" in err and "To fix: free space there" in err
    assert f"the newest checkpoint is {ckpt}; continue with `visionrl train CONFIG --resume auto`" in err
    assert "Exception in thread" not in err and "[Errno" not in err  # no raw OSError, no thread dump
    assert _steps(run) == [1, 2]  # step 2's line was appended before its TensorBoard write failed

    (disk / "filler").unlink()  # room again (the reward fills it once)
    assert main(["train", job, "--resume", "auto"]) == 0
    assert _steps(run) == [1, 2]  # step 2 run again, its old line dropped
    assert [s for s, _ in read_scalars(run / "tensorboard")[REWARD_MEAN]] == [1, 2]
