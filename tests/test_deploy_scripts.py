"""The deployment scripts run the commands they should: deploy/push_image.sh (Amazon ECR), the Slurm launcher
(plain Slurm or SageMaker HyperPod, on the hosts or in an image) and the KubeRay job with its image filled in.

Nothing here needs Slurm, AWS, docker or a network: `srun`, `sbatch`, `scontrol`, `hostname`, `ray`, `aws`,
`docker`, `git` and `visionrl` are small stand-ins put first on PATH, each appending the command line it was
given to one log, and the tests compare those lines with the ones the scripts must run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
PUSH = REPO / "deploy" / "push_image.sh"
SBATCH = REPO / "deploy" / "slurm" / "visionrl.sbatch"
LAUNCHER = REPO / "deploy" / "slurm" / "ray_cluster.sh"
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]

# Every stand-in starts by logging its name and arguments as one line (an argument holding a newline, a Python
# program, shows as <script>), written at once so that stand-ins running side by side keep whole lines.
LOG_LINE = """#!/usr/bin/env bash
line=$(basename "$0")
for arg in "$@"; do [[ $arg == *$'\\n'* ]] && arg='<script>'; line+=" $arg"; done
"""
STANDINS = {
    # srun: drop srun's own options (-w takes a value) and run the step's command here.
    "srun": LOG_LINE
    + """echo "$line" >> "$STANDIN_LOG"
while [[ $# -gt 0 && $1 == -* ]]; do if [[ $1 == -w ]]; then shift 2; else shift; fi; done
exec "$@"
""",
    # sbatch: run the batch script here, in the allocation the test's SLURM_* variables describe.
    "sbatch": LOG_LINE + 'echo "$line" >> "$STANDIN_LOG"\nexec bash "$@"\n',
    "scontrol": LOG_LINE
    + """echo "$line" >> "$STANDIN_LOG"
[[ $1 == show && $2 == hostnames ]] && tr ',' '\\n' <<< "$3"
""",
    "hostname": LOG_LINE + 'echo "$line" >> "$STANDIN_LOG"\necho "10.0.0.7 fe80::7"\n',
    "ray": LOG_LINE + 'echo "$line" >> "$STANDIN_LOG"\n',
    # python3: the launcher's join check is logged and, like the real one, returns once the Ray steps are up (here:
    # once each has logged its `ray start`; else the command could end, and the cleanup kill the workers' step,
    # before that step has run); anything else (the sbatch script reads the job file) is real.
    "python3": LOG_LINE
    + """if [[ ${1:-} == -c && ${2:-} == *ray.init* ]]; then
  echo "$line" >> "$STANDIN_LOG"
  want=$(( ${4:-1} > 1 ? 2 : 1 ))
  for _ in $(seq 600); do
    (( $(grep -c '^ray start' "$STANDIN_LOG") >= want )) && exit 0
    sleep 0.1
  done
  exit 1
fi
exec "$REAL_PYTHON" "$@"
""",
    "visionrl": LOG_LINE
    + 'echo "$line RAY_ADDRESS=$RAY_ADDRESS" >> "$STANDIN_LOG"\nexit "${FAKE_EXIT:-0}"\n',
    # aws: an account id; the ECR repository exists once created (a marker file); a token for docker login.
    "aws": LOG_LINE
    + """echo "$line" >> "$STANDIN_LOG"
case "$1 $2" in
  "sts get-caller-identity")
    if [[ -n ${FAKE_AWS_LOGGED_OUT:-} ]]; then echo "Unable to locate credentials." >&2; exit 255; fi
    echo 123456789012 ;;
  "ecr describe-repositories")
    if [[ ! -e $FAKE_ECR_REPO ]]; then echo "RepositoryNotFoundException" >&2; exit 254; fi ;;
  "ecr create-repository") touch "$FAKE_ECR_REPO"; echo '{"repository": {}}' ;;
  "ecr get-login-password") echo tok-from-ecr ;;
esac
""",
    # docker: `login` logs the password it read on stdin.
    "docker": LOG_LINE
    + """[[ ${1:-} == login ]] && line+=" <stdin:$(cat)>"
echo "$line" >> "$STANDIN_LOG"
""",
    "git": LOG_LINE
    + """echo "$line" >> "$STANDIN_LOG"
case "$*" in
  "rev-parse --short HEAD") echo abc1234 ;;
  "status --porcelain") printf '%s' "${FAKE_GIT_STATUS:-}" ;;
esac
""",
}


def _standins(tmp_path: Path, leave_out: tuple[str, ...] = ()) -> tuple[dict[str, str], Path]:
    """An environment whose PATH starts with the stand-ins (but those left out), and the log they write."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in STANDINS.items():
        if name not in leave_out:
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
    log = tmp_path / "commands.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "AWS_", "VISIONRL_", "RAY_"))}
    env |= {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "STANDIN_LOG": str(log),
        "REAL_PYTHON": sys.executable,
        "FAKE_ECR_REPO": str(tmp_path / "ecr-repository-exists"),
    }
    return env, log


def _lines(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def _after_the_cluster(lines: list[str]) -> list[str]:
    """The lines of the join check and the command, in order (the Ray steps run in the background: their lines
    may come anywhere)."""
    return [
        line
        for line in lines
        if line.startswith(("python3 ", "visionrl "))
        or " -w vrl-a python3 " in line
        or " -w vrl-a visionrl " in line
    ]


@pytest.mark.parametrize("script", [PUSH, SBATCH, LAUNCHER], ids=lambda p: p.name)
def test_deploy_scripts_are_valid_bash(script: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert os.access(script, os.X_OK), f"{script} is not executable"


# --- deploy/push_image.sh ------------------------------------------------------------------------------------


def _push(env: dict[str, str], *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(PUSH), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=30)


def test_push_image_creates_the_missing_repository_logs_in_and_pushes_both_tags(tmp_path: Path) -> None:
    env, log = _standins(tmp_path)
    env["AWS_REGION"] = "eu-west-1"
    uri = "123456789012.dkr.ecr.eu-west-1.amazonaws.com/visionrl"
    proc = _push(env, cwd=tmp_path)  # from any directory: the script builds from the repository root
    assert proc.returncode == 0, proc.stderr
    assert _lines(log) == [
        "git rev-parse --short HEAD",
        "git status --porcelain",
        "docker info",
        "aws sts get-caller-identity --query Account --output text",
        "aws ecr describe-repositories --repository-names visionrl --region eu-west-1",
        "aws ecr create-repository --repository-name visionrl --image-scanning-configuration scanOnPush=true"
        " --region eu-west-1",
        "aws ecr get-login-password --region eu-west-1",
        "docker login --username AWS --password-stdin 123456789012.dkr.ecr.eu-west-1.amazonaws.com"
        " <stdin:tok-from-ecr>",
        f"docker build -f deploy/Dockerfile -t {uri}:{VERSION} -t {uri}:abc1234 .",
        f"docker push {uri}:{VERSION}",
        f"docker push {uri}:abc1234",
    ]
    assert proc.stdout.splitlines()[-2:] == [f"{uri}:abc1234", f"export VISIONRL_IMAGE={uri}:abc1234"]

    # The repository exists now: the next push only describes it.
    log.unlink()
    proc = _push(env, "--region", "eu-west-1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    ecr = [line for line in _lines(log) if line.startswith("aws ecr ")]
    assert ecr == [
        "aws ecr describe-repositories --repository-names visionrl --region eu-west-1",
        "aws ecr get-login-password --region eu-west-1",
    ]


def test_push_image_flags_win_over_the_environment_and_a_dirty_tree_says_so(tmp_path: Path) -> None:
    env, log = _standins(tmp_path)
    env |= {"AWS_REGION": "eu-west-1", "FAKE_GIT_STATUS": " M src/visionrl/cli.py\n"}
    proc = _push(env, "--region=us-east-2", "--repository", "team/vrl", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    uri = "123456789012.dkr.ecr.us-east-2.amazonaws.com/team/vrl"
    assert f"docker build -f deploy/Dockerfile -t {uri}:{VERSION} -t {uri}:abc1234-dirty ." in _lines(log)
    assert f"docker push {uri}:abc1234-dirty" in _lines(log)
    assert "uncommitted changes" in proc.stderr
    assert proc.stdout.splitlines()[-1] == f"export VISIONRL_IMAGE={uri}:abc1234-dirty"


def test_push_image_dry_run_prints_the_commands_and_runs_none(tmp_path: Path) -> None:
    env, log = _standins(tmp_path)
    proc = _push(env, "--dry-run", "--region", "eu-west-1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _lines(log) == [
        "git rev-parse --short HEAD",
        "git status --porcelain",
    ]  # reads the tag, nothing else
    uri = "ACCOUNT.dkr.ecr.eu-west-1.amazonaws.com/visionrl"
    out = proc.stdout.splitlines()
    assert (
        "+ aws ecr create-repository --repository-name visionrl --image-scanning-configuration scanOnPush=true"
        " --region eu-west-1"
    ) in out
    assert f"+ docker build -f deploy/Dockerfile -t {uri}:{VERSION} -t {uri}:abc1234 ." in out
    assert out[-3:] == [
        f"+ docker push {uri}:abc1234",
        f"{uri}:abc1234",
        f"export VISIONRL_IMAGE={uri}:abc1234",
    ]


@pytest.mark.parametrize(
    ("leave_out", "extra_env", "message"),
    [
        (("aws",), {}, "the AWS CLI (aws) is not on PATH: install AWS CLI v2"),
        (("docker",), {}, "docker is not on PATH: install Docker"),
        ((), {"FAKE_AWS_LOGGED_OUT": "1"}, "not logged in to AWS"),
        ((), {"AWS_REGION": ""}, "no AWS region: pass --region REGION"),
    ],
    ids=["no-aws", "no-docker", "logged-out", "no-region"],
)
def test_push_image_says_what_is_missing_and_builds_nothing(
    tmp_path: Path, leave_out: tuple[str, ...], extra_env: dict[str, str], message: str
) -> None:
    for name in leave_out:
        if shutil.which(name, path="/usr/bin:/bin"):
            pytest.skip(f"a real {name} is on /usr/bin:/bin")
    env, log = _standins(tmp_path, leave_out=leave_out)
    env |= {"AWS_REGION": "eu-west-1", **extra_env}
    proc = _push(env, cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not [line for line in _lines(log) if line.startswith(("docker build", "docker push", "aws ecr"))]


def test_push_image_refuses_an_unknown_argument(tmp_path: Path) -> None:
    env, log = _standins(tmp_path)
    proc = _push(env, "--regoin", "eu-west-1", cwd=tmp_path)
    assert proc.returncode == 2 and "unknown argument '--regoin'" in proc.stderr
    assert _lines(log) == []


# --- the Slurm launcher ---------------------------------------------------------------------------------------


def _sbatch(tmp_path: Path, job: Path, **extra: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """`sbatch deploy/slurm/visionrl.sbatch JOB` in an allocation of 3 nodes x 8 GPUs (job 77), and the command
    lines it ran."""
    env, log = _standins(tmp_path)
    env |= {
        "SLURM_JOB_NODELIST": "vrl-a,vrl-b,vrl-c",
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_CPUS_ON_NODE": "4",
        "SLURM_JOB_ID": "77",
        "SLURM_SUBMIT_DIR": str(REPO),
        "VISIONRL_VENV": str(tmp_path / "no-venv"),
        **extra,
    }
    proc = subprocess.run(
        ["sbatch", str(SBATCH), str(job)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    return proc, _lines(log)


@pytest.fixture
def job(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text("train:\n  steps: 3\n")
    return path


HEAD = (
    "--nodes=1 --ntasks=1 -w vrl-a ray start --head --block --node-ip-address=10.0.0.7 --port=6379"
    " --ray-client-server-port=6380 --include-dashboard=false --disable-usage-stats --temp-dir=/tmp/ray-77"
    " --num-cpus=4 --num-gpus=8"
)
WORKERS = (
    "--nodes=2 --ntasks=2 --ntasks-per-node=1 --exclude=vrl-a ray start --block --address=10.0.0.7:6379"
    " --disable-usage-stats --temp-dir=/tmp/ray-77 --num-cpus=4 --num-gpus=8"
)


def test_slurm_launcher_on_plain_hosts_runs_ray_in_steps_and_the_command_here(
    tmp_path: Path, job: Path
) -> None:
    proc, lines = _sbatch(tmp_path, job, VISIONRL_HYPERPOD="0")
    assert proc.returncode == 0, proc.stderr
    assert sorted(line for line in lines if line.startswith("srun ")) == [
        "srun --nodes=1 --ntasks=1 -w vrl-a hostname --ip-address",  # the head's address
        f"srun {HEAD}",
        f"srun {WORKERS}",
    ]
    # The join check and visionrl run on the batch host itself, after the cluster is up.
    assert _after_the_cluster(lines) == [
        "python3 -c <script> 10.0.0.7:6379 3 300",
        f"visionrl train {job} ray.num_learners=24 --resume auto RAY_ADDRESS=10.0.0.7:6379",
    ]
    assert "auto-resume" not in proc.stdout and "image" not in proc.stdout


def test_slurm_launcher_on_hyperpod_in_an_image_runs_every_step_there_with_auto_resume(
    tmp_path: Path, job: Path
) -> None:
    image = "123456789012.dkr.ecr.eu-west-1.amazonaws.com/visionrl:abc1234"
    proc, lines = _sbatch(
        tmp_path, job, VISIONRL_HYPERPOD="1", VISIONRL_IMAGE=image, VISIONRL_CONTAINER_MOUNTS="/fsx:/fsx"
    )
    assert proc.returncode == 0, proc.stderr
    step = f"srun --auto-resume=1 --container-image={image} --container-mounts=/fsx:/fsx"
    on_head = f"{step} --overlap --nodes=1 --ntasks=1 -w vrl-a"
    assert sorted(line for line in lines if line.startswith("srun ")) == sorted(
        [
            "srun --nodes=1 --ntasks=1 -w vrl-a hostname --ip-address",  # a host query: no image, no re-run
            f"{step} {HEAD}",
            f"{step} {WORKERS}",
            f"{on_head} python3 -c <script> 10.0.0.7:6379 3 300",
            f"{on_head} visionrl train {job} ray.num_learners=24 --resume auto",  # resumes when re-run
        ]
    )
    # The command is the last step, started once every node has joined, and finds Ray through RAY_ADDRESS.
    assert _after_the_cluster(lines) == [
        f"{on_head} python3 -c <script> 10.0.0.7:6379 3 300",
        "python3 -c <script> 10.0.0.7:6379 3 300",
        f"{on_head} visionrl train {job} ray.num_learners=24 --resume auto",
        f"visionrl train {job} ray.num_learners=24 --resume auto RAY_ADDRESS=10.0.0.7:6379",
    ]
    assert "SageMaker HyperPod: srun steps with --auto-resume=1" in proc.stdout
    assert f"Ray and the command run in the image {image}" in proc.stdout


@pytest.mark.parametrize(
    ("hyperpod", "image"),
    [("1", ""), ("0", "/fsx/images/visionrl.sqsh"), ("", "")],
    ids=["hyperpod-on-hosts", "image-on-plain-slurm", "detected"],
)
def test_slurm_launcher_adds_auto_resume_only_on_hyperpod_and_container_flags_only_with_an_image(
    tmp_path: Path, job: Path, hyperpod: str, image: str
) -> None:
    if not hyperpod and Path("/opt/sagemaker_cluster").exists():
        pytest.skip("this machine looks like a HyperPod node")
    proc, lines = _sbatch(tmp_path, job, VISIONRL_HYPERPOD=hyperpod, VISIONRL_IMAGE=image)
    assert proc.returncode == 0, proc.stderr
    steps = [line for line in lines if line.startswith("srun ") and " hostname " not in line]
    assert len(steps) == (4 if image else 2)  # with an image, the join check and visionrl are steps too
    for line in steps:
        assert ("--auto-resume=1" in line) == (hyperpod == "1"), line
        assert (f"--container-image={image}" in line) == bool(image), line
        assert "--container-mounts" not in line  # VISIONRL_CONTAINER_MOUNTS unset
    assert _after_the_cluster(lines)[-1] == (
        f"visionrl train {job} ray.num_learners=24 --resume auto RAY_ADDRESS=10.0.0.7:6379"
    )


def test_slurm_launcher_exits_with_the_commands_status(tmp_path: Path, job: Path) -> None:
    proc, _ = _sbatch(tmp_path, job, VISIONRL_HYPERPOD="1", VISIONRL_IMAGE="img", FAKE_EXIT="3")
    assert proc.returncode == 3, proc.stderr


def test_slurm_launcher_refuses_an_unclear_hyperpod_setting(tmp_path: Path, job: Path) -> None:
    proc, lines = _sbatch(tmp_path, job, VISIONRL_HYPERPOD="yes")
    assert proc.returncode == 2
    assert "VISIONRL_HYPERPOD=yes: use 1 (HyperPod), 0 (other Slurm) or unset it" in proc.stderr
    assert not [line for line in lines if line.startswith("srun ")]


# --- the KubeRay job ------------------------------------------------------------------------------------------


def _substitute(text: str, image: str) -> str:
    """`envsubst '$VISIONRL_IMAGE'` where it is installed, else the same substitution in Python."""
    if shutil.which("envsubst"):
        env = {"PATH": os.environ["PATH"], "VISIONRL_IMAGE": image}
        proc = subprocess.run(
            ["envsubst", "$VISIONRL_IMAGE"], input=text, env=env, capture_output=True, text=True, check=True
        )
        return proc.stdout
    return text.replace("${VISIONRL_IMAGE}", image).replace("$VISIONRL_IMAGE", image)


def test_kuberay_job_takes_its_image_from_visionrl_image() -> None:
    text = (REPO / "deploy" / "kuberay" / "rayjob.yaml").read_text()
    assert "envsubst '$VISIONRL_IMAGE' < deploy/kuberay/rayjob.yaml | kubectl apply -f -" in text
    # Outside comments the placeholder is the only `$`, so even an envsubst of every variable changes nothing else.
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert body.count("$") == body.count("${VISIONRL_IMAGE}") == 2
    image = "123456789012.dkr.ecr.eu-west-1.amazonaws.com/visionrl:abc1234"
    job = yaml.safe_load(_substitute(text, image))
    cluster = job["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]["containers"][0]
    workers = cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert head["image"] == workers["image"] == image
