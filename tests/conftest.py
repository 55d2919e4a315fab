"""Shared fixtures: a tiny Qwen3-VL and a tiny Qwen2.5-VL (built once per session) and a small synthetic data set."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from visionrl.rollout.vllm_platform import set_cpu_env

# vLLM's CPU build: small KV cache, in-process engine, loopback only, no hub (docs/ENGINE_NOTES.md).
set_cpu_env(kv_cache_gib=1.0)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _share_the_cores() -> None:
    """Each test process's own torch work (pre-training the tiny bases, learners in the test's process) on its
    share of the cores, as `make demo` runs on one thread: two processes at torch's default of 2 threads each on
    2 cores pre-trained a tiny base 13x slower than at 1 thread each (132 s against 10 s; alone, 2 threads: 9.0 s,
    1 thread: 9.7 s)."""
    import torch

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


_share_the_cores()

# Fixtures that load a model, start a server (also a fake one) or start Ray. A test that uses one, directly or through
# another fixture, is `slow`, so `make test-fast` runs only pure tests.
SLOW_FIXTURES = frozenset(
    {"tiny_model", "tiny_qwen25_model", "pretrained_tiny_model", "models", "tiny"}
    | {"fake_server", "adapter_api", "endpoint", "shared_ray"}
)


# The files that take minutes (the learning proofs) run first: with two processes (`make test`: --dist loadfile
# --no-loadscope-reorder, which keeps this order; by default pytest-xdist puts the files with the most tests
# first, so these one-test files ran last, one after the other) each starts on its own process while the other
# works through the rest.
LONGEST_FIRST = ("test_two_images.py", "test_demo_recipe.py", "test_zoom_recipe.py", "test_judge_recipe.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)

    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a file, and of the other files, is kept


class SharedRay:
    """One local Ray for the tests of a module that ask for it (`shared_ray`), so that their runs skip Ray's start
    and stop (`train` uses a Ray already running, as `ray_session` says: mode "existing"). Started by the first
    such test, stopped at the module's end or before a test of the module that does not ask for it (that one
    gets a Ray of its own from `train`, or none). After each test it must hold no live actor: the runs close
    theirs, and those of a failed run die with their handles; any still alive after `LEFTOVER_WAIT_S` (a rank
    stuck in a collective, a handle kept by a traceback) are stopped with the whole Ray, and the next test gets
    a fresh one."""

    LEFTOVER_WAIT_S = 15.0

    def __init__(self) -> None:
        self.temp_dir: str | None = None
        self._before: set[int] = set()
        self.restarts = 0  # fresh Rays because of live actors left after a test

    @property
    def modules(self) -> Path:
        """A folder on the import path of this process and of every Ray worker, for a test's own modules (a
        user reward): Ray's workers take PYTHONPATH from the environment Ray started in, not from a test's."""
        assert self.temp_dir is not None, "the shared Ray is not running"
        return Path(self.temp_dir) / "modules"

    def start(self) -> None:
        if self.temp_dir is not None:
            return
        import logging
        import tempfile

        import ray

        from visionrl.orchestrate.ray_session import _descendants

        assert not ray.is_initialized(), "a Ray this fixture did not start is running"
        # a short path of its own: Ray's Unix sockets live under it, and paths over ~107 bytes fail
        self.temp_dir = tempfile.mkdtemp(
            prefix="vrl-ray-test-", dir="/tmp" if os.path.isdir("/tmp") else None
        )
        self._before = _descendants()
        self.modules.mkdir()
        sys.path.insert(0, str(self.modules))
        path = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([str(self.modules), *([path] if path else [])])
        try:  # Ray's processes, and the workers they start, keep this environment
            ray.init(
                num_cpus=2,
                include_dashboard=False,
                _temp_dir=self.temp_dir,
                log_to_driver=True,
                configure_logging=True,
                logging_level=logging.WARNING,
            )
        finally:
            if path is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = path

    def stop(self) -> None:
        """As `ray_session` ends an embedded Ray: shut down, its processes waited for, its temp dir removed."""
        if self.temp_dir is None:
            return
        import shutil

        import ray

        from visionrl.orchestrate.ray_session import RAY_EXIT_WAIT_S, _descendants, _wait_gone

        started = _descendants() - self._before
        ray.shutdown()
        _wait_gone(started, RAY_EXIT_WAIT_S)
        sys.path.remove(str(self.modules))
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        self.temp_dir = None

    def live_actors(self) -> list[str]:
        from ray._private import state

        return [actor_id for actor_id, a in state.actors().items() if a["State"] != "DEAD"]

    def after_test(self) -> None:
        """No actor of this test may reach the next: wait for the last ones to go, else start over."""
        import gc
        import time

        if self.temp_dir is None:
            return
        gc.collect()  # handles in reference cycles (a failed run's traceback) go now, and their actors with them
        deadline = time.monotonic() + self.LEFTOVER_WAIT_S
        while self.live_actors() and time.monotonic() < deadline:
            time.sleep(0.2)
        if self.live_actors():
            self.restarts += 1
            self.stop()


_SHARED_RAY = SharedRay()


@pytest.fixture(scope="module")
def shared_ray() -> Iterator[SharedRay]:
    """A Ray shared by the tests of this module that ask for it (`SharedRay`); torn down at the module's end."""
    _SHARED_RAY.start()
    yield _SHARED_RAY
    _SHARED_RAY.stop()


@pytest.fixture(autouse=True)
def _ray_of_each_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that asks for `shared_ray` runs on it (started again if a test before it stopped it); any other
    test runs with no Ray of the fixture's left running, so `train` starts and stops its own as in a real run."""
    if "shared_ray" in request.fixturenames:
        _SHARED_RAY.start()
        yield
        _SHARED_RAY.after_test()
    else:
        _SHARED_RAY.stop()
        yield


def _built_once(factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Path]) -> Path:
    """What `build(folder)` makes, made once per test run: the parallel workers of `make test` (pytest-xdist) share
    it, the first one building it under a lock in their common temp root while the others wait."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return build(factory.mktemp(name))
    from filelock import FileLock

    root = factory.getbasetemp().parent / f"shared-{name}"
    with FileLock(f"{root}.lock"):
        done = root / ".built"
        if not done.is_file():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            done.write_text(str(build(root).relative_to(root)))
        return root / done.read_text()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight tiny Qwen3-VL checkpoint (no pre-training: fast)."""
    from visionrl.models.tiny import build_tiny_model

    return _built_once(tmp_path_factory, "tiny", lambda d: build_tiny_model(d / "model", seed=0))


@pytest.fixture(scope="session")
def tiny_reward_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_model` with a score head (lm_head of 'yes' minus 'no'): a reward model for the classifier judge."""
    from visionrl.models.score_head import add_score_head

    def build(out: Path) -> Path:
        shutil.copytree(tiny_model, out / "model")
        add_score_head(out / "model")
        return out / "model"

    return _built_once(tmp_path_factory, "tiny-reward", build)


@pytest.fixture(scope="session")
def tiny_qwen25_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight tiny Qwen2.5-VL checkpoint (`init-tiny-model --arch qwen2_5_vl`)."""
    from visionrl.models.tiny import build_tiny_model

    return _built_once(
        tmp_path_factory, "tiny-q25", lambda d: build_tiny_model(d / "model", seed=0, arch="qwen2_5_vl")
    )


@pytest.fixture(scope="session")
def pretrained_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny base the demo uses: random init + the short supervised pre-training (~30 s)."""
    from visionrl.models.tiny import build_tiny_model

    return _built_once(
        tmp_path_factory, "tiny-pre", lambda d: build_tiny_model(d / "model", seed=0, pretrain=True)
    )


@pytest.fixture(scope="session")
def color_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The synthetic colour task: 256 train / 64 eval records."""
    from visionrl.data.synthetic import make_dataset

    def build(out: Path) -> Path:
        make_dataset(out, "color", num_train=256, num_eval=64, seed=0)
        return out

    return _built_once(tmp_path_factory, "color", build)


@pytest.fixture
def small_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A factory `small_disk(size_bytes, read_only=False, real=False) -> folder` on which writes past `size_bytes`
    fail with ENOSPC (every write with EROFS when `read_only`).

    A real tmpfs of that size where this process may mount one (root in a container); elsewhere a disk
    stood in at visionrl's one write call (`visionrl.files._write_fd`, i.e. os.write), which raises
    OSError(ENOSPC) once the folder's budget is spent. `real=True` skips the test where no tmpfs can be mounted
    (writes of other libraries, e.g. TensorBoard's, do not pass the stand-in). Unmounted at the end of the test.
    """
    import errno
    import subprocess

    from visionrl import files

    mounted: list[Path] = []

    def make(size_bytes: int, read_only: bool = False, real: bool = False) -> Path:
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        options = f"size={size_bytes}" + (",ro" if read_only else "")
        try:
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                capture_output=True,
                check=False,
            ).returncode
        except FileNotFoundError:  # no mount command
            done = 1
        if done == 0:
            mounted.append(folder)
            return folder
        if real:
            pytest.skip("this process may not mount a tmpfs (a real small disk); run as root in a container")
        left = [0 if read_only else size_bytes]
        code = errno.EROFS if read_only else errno.ENOSPC
        real_write = files._write_fd

        def write(fd: int, data: memoryview) -> int:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith(str(folder)):
                return real_write(fd, data)
            if len(data) > left[0]:
                raise OSError(code, os.strerror(code))
            left[0] -= len(data)
            return real_write(fd, data)

        monkeypatch.setattr(files, "_write_fd", write)
        return folder

    yield make
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


RANK_SCRIPT = Path(__file__).parent / "learner_rank.py"  # one rank's run (its docstring says what it does)


def _run_learner_ranks(
    raw: dict, world: int, out: Path, fsdp: bool = False, steps: int = 1, device: str = "cpu"
) -> tuple[dict[str, Any], dict[str, float]]:
    from safetensors.torch import load_file

    from visionrl.train.ranks import free_address

    address, mode = free_address("127.0.0.1"), "fsdp" if fsdp else "plain"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(RANK_SCRIPT),
                json.dumps(raw),
                str(r),
                str(world),
                address,
                str(out),
                mode,
                str(steps),
                device,
            ]
        )
        for r in range(world)
    ]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0] * world
    return load_file(str(out) + ".safetensors"), json.loads(Path(str(out) + ".json").read_text())


def learner_rank_job(model: Path, data: Path, *, lr: float, **model_over: Any) -> dict[str, Any]:
    """The job of tests/learner_rank.py's runs: the tiny model with LoRA on the LM, merger and lm_head, 2 updates
    per batch (old log-probs) with a KL term (reference log-probs), 64-token micro-batches."""
    return {
        "output_dir": "unused",
        "model": {"path": str(model), "dtype": "float32", **model_over},
        "data": {"train": str(data / "train.jsonl")},
        "rewards": [{"name": "exact_match"}],
        "lora": {"rank": 8, "train_merger": True, "train_lm_head": True},
        "algorithm": {"group_size": 2, "updates_per_batch": 2, "kl_coef": 0.05},
        "rollout": {"prompts_per_step": 4, "max_new_tokens": 4, "temperature": 0.7},
        "train": {"lr": lr, "lr_schedule": "constant", "micro_batch_tokens": 64},
    }


@pytest.fixture
def rank_job():
    """`learner_rank_job` (the job the learner-rank runs train), as a fixture."""
    return learner_rank_job


@pytest.fixture
def run_learner_ranks():
    """Run `world` learner ranks of tests/learner_rank.py as processes; returns (rank 0's trained LoRA weights,
    its last step's metrics)."""
    return _run_learner_ranks
