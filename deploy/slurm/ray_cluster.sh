#!/usr/bin/env bash
# Start a Ray cluster over the nodes of a Slurm allocation, run one command on the head node against it, and
# tear the cluster down when the command ends (also on error or scancel). Works the same on SageMaker
# HyperPod, whose clusters are Slurm clusters.
#
# Usage, inside an allocation (sbatch deploy/slurm/visionrl.sbatch ..., or salloc):
#   deploy/slurm/ray_cluster.sh -- visionrl train configs/qwen3vl_8b_grpo_lora.yaml --resume auto [key=value ...]
# The command finds the cluster through RAY_ADDRESS (visionrl honours it: no config change needed). A SIGTERM
# or SIGINT to this script is passed on to the command, and the cluster stays up until the command has ended
# (visionrl checkpoints first); the script exits with the command's status.
#
# Containers (pyxis): with VISIONRL_IMAGE set (the URI deploy/push_image.sh prints, or a squashfs file made
# once with `enroot import`, which spares each step the download), the Ray steps and the command run in that
# image. Its working directory is the image's /workspace (with configs/): mount shared storage through
# VISIONRL_CONTAINER_MOUNTS (e.g. /fsx:/fsx) and give the job file's data and output_dir as absolute paths.
#
# SageMaker HyperPod: those steps run with `srun --auto-resume=1`. When one fails on a faulty node, HyperPod
# replaces the node and runs the step again; where the GPUs are Slurm GRES (visionrl.sbatch's --gpus-per-node)
# it requeues the whole job instead, which runs this script again from the top. Either way training continues
# from the newest complete checkpoint: visionrl.sbatch's command is `visionrl train ... --resume auto`.
#
# Environment (all optional):
#   VISIONRL_IMAGE            image of the Ray steps and the command (pyxis `srun --container-image`)
#   VISIONRL_CONTAINER_MOUNTS `srun --container-mounts` of those steps (SRC:DST[,SRC:DST...])
#   VISIONRL_HYPERPOD         1 or 0: SageMaker HyperPod or not (default: 1 if /opt/sagemaker_cluster exists)
#   VISIONRL_RAY_PORT         GCS port of the head (default 6379)
#   VISIONRL_RAY_HEAD_IP      address of the head node (default: `hostname --ip-address` on that node)
#   VISIONRL_RAY_TMP          Ray's temp dir on every node (default /tmp/ray-$SLURM_JOB_ID; keep it short)
#   VISIONRL_RAY_WAIT_S       seconds to wait for every node to join (default 300)
#   RAY                       the ray executable (default: ray on PATH, the image's in an image)
set -euo pipefail

if [[ ${1:-} == "--" ]]; then shift; fi
if [[ $# -eq 0 ]]; then
  echo "usage: $0 -- COMMAND [ARGS...]   (e.g. visionrl train configs/qwen3vl_8b_grpo_lora.yaml)" >&2
  exit 2
fi
if [[ -z ${SLURM_JOB_NODELIST:-} ]]; then
  echo "error: SLURM_JOB_NODELIST is not set: run this inside a Slurm allocation (sbatch or salloc)" >&2
  exit 2
fi

RAY=${RAY:-ray}
port=${VISIONRL_RAY_PORT:-6379}
tmp=${VISIONRL_RAY_TMP:-/tmp/ray-${SLURM_JOB_ID:-$$}}
wait_s=${VISIONRL_RAY_WAIT_S:-300}
image=${VISIONRL_IMAGE:-}
case ${VISIONRL_HYPERPOD:-} in
  1) hyperpod=1 ;;
  0) hyperpod=0 ;;
  # AWS's HyperPod Slurm examples detect the cluster by this directory, which HyperPod puts on its nodes.
  "") if [[ -d /opt/sagemaker_cluster ]]; then hyperpod=1; else hyperpod=0; fi ;;
  *)
    echo "error: VISIONRL_HYPERPOD=$VISIONRL_HYPERPOD: use 1 (HyperPod), 0 (other Slurm) or unset it" >&2
    exit 2
    ;;
esac
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
# The head is the first node, where sbatch runs this script: were that node to fail, the script would end with
# it and the job be requeued, so the head's address holds for as long as this script runs.
head=${nodes[0]}
head_ip=${VISIONRL_RAY_HEAD_IP:-$(srun --nodes=1 --ntasks=1 -w "$head" hostname --ip-address | awk '{print $1}')}
address="$head_ip:$port"
# Each node offers Ray what Slurm gave the job there (the GPUs are those Ray would find through
# CUDA_VISIBLE_DEVICES), so one learner rank per GPU fits across the nodes.
resources=()
[[ -n ${SLURM_CPUS_ON_NODE:-} ]] && resources=(--num-cpus="$SLURM_CPUS_ON_NODE")
[[ -n ${SLURM_GPUS_ON_NODE:-} ]] && resources+=(--num-gpus="$SLURM_GPUS_ON_NODE")
# Token authentication with one token for the whole job: srun passes the environment to every node, and only
# processes of this job (and user) can read it.
export RAY_AUTH_MODE=token
RAY_AUTH_TOKEN=${RAY_AUTH_TOKEN:-$(python3 -c 'import secrets; print(secrets.token_hex(32))')}
export RAY_AUTH_TOKEN

# How a step runs: with --auto-resume=1 on HyperPod, in the image when there is one.
step=(srun)
if ((hyperpod)); then step+=(--auto-resume=1); fi
if [[ -n $image ]]; then
  step+=(--container-image="$image")
  if [[ -n ${VISIONRL_CONTAINER_MOUNTS:-} ]]; then step+=(--container-mounts="$VISIONRL_CONTAINER_MOUNTS"); fi
fi
# Where the join check and the command run: on this host, the head (as on plain hosts), or, with an image, in
# one more step on the head, which shares the node with its Ray step (--overlap).
on_head=()
if [[ -n $image ]]; then on_head=("${step[@]}" --overlap --nodes=1 --ntasks=1 -w "$head"); fi

steps=()
cleanup() {
  # Ending the srun steps ends every Ray process they started (Slurm kills a step's processes).
  for pid in "${steps[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${steps[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
# SIGTERM/SIGINT (scancel, preemption, `--signal=B:TERM@...` before the time limit) go to the command first:
# `visionrl train` checkpoints its last completed step and exits 128 + signal; only then is Ray torn down.
# In an image the command's srun passes the signal on to the command's step alone, not to the Ray steps.
cmd_pid=""
forward() {
  if [[ -n $cmd_pid ]]; then kill -"$1" "$cmd_pid" 2>/dev/null || true; else exit $((128 + $2)); fi
}
trap 'forward TERM 15' TERM
trap 'forward INT 2' INT

echo "[ray_cluster] head $head ($address), ${#nodes[@]} node(s): ${nodes[*]}"
if ((hyperpod)); then echo "[ray_cluster] SageMaker HyperPod: srun steps with --auto-resume=1"; fi
if [[ -n $image ]]; then echo "[ray_cluster] Ray and the command run in the image $image"; fi
"${step[@]}" --nodes=1 --ntasks=1 -w "$head" "$RAY" start --head --block --node-ip-address="$head_ip" \
  --port="$port" --ray-client-server-port=$((port + 1)) --include-dashboard=false --disable-usage-stats \
  --temp-dir="$tmp" "${resources[@]}" &
steps+=($!)
# One step for all the workers, placed by Slurm rather than by node name: when HyperPod runs it again after
# replacing a node, it runs on the replacement too, and each worker joins the head again at the same address.
if ((${#nodes[@]} > 1)); then
  workers=$((${#nodes[@]} - 1))
  "${step[@]}" --nodes="$workers" --ntasks="$workers" --ntasks-per-node=1 --exclude="$head" "$RAY" start \
    --block --address="$address" --disable-usage-stats --temp-dir="$tmp" "${resources[@]}" &
  steps+=($!)
fi

# Wait until every node has joined (a node that fails to start is reported by its srun step's output). The
# check is an argument, not stdin, so that it runs the same here and in an srun step.
join_check=$(
  cat <<'PY'
import sys, time
import ray

address, want, budget = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline, alive = time.monotonic() + budget, 0
while time.monotonic() < deadline:
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
        alive = sum(1 for n in ray.nodes() if n["Alive"])
        ray.shutdown()
    except (ConnectionError, RuntimeError, TimeoutError):
        alive = 0
    if alive >= want:
        print(f"[ray_cluster] {alive}/{want} node(s) joined", flush=True)
        sys.exit(0)
    time.sleep(3)
print(f"[ray_cluster] error: only {alive}/{want} node(s) joined in {budget:.0f} s; see the srun output above",
      file=sys.stderr)
sys.exit(1)
PY
)
"${on_head[@]}" python3 -c "$join_check" "$address" "${#nodes[@]}" "$wait_s"

RAY_ADDRESS="$address" "${on_head[@]}" "$@" &
cmd_pid=$!
# A trapped signal ends `wait` early: wait again until the command itself has ended, and exit with its status.
while true; do
  status=0
  wait "$cmd_pid" || status=$?
  kill -0 "$cmd_pid" 2>/dev/null || break
done
exit "$status"
