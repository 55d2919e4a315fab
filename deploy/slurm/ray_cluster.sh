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
# Environment (all optional):
#   VISIONRL_RAY_PORT      GCS port of the head (default 6379)
#   VISIONRL_RAY_HEAD_IP   address of the head node (default: `hostname --ip-address` on that node)
#   VISIONRL_RAY_TMP       Ray's temp dir on every node (default /tmp/ray-$SLURM_JOB_ID; keep it short)
#   VISIONRL_RAY_WAIT_S    seconds to wait for every node to join (default 300)
#   RAY                    the ray executable (default: ray on PATH)
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
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
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

steps=()
cleanup() {
  # Ending the srun steps ends every Ray process they started (Slurm kills a step's processes).
  for pid in "${steps[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${steps[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT
# SIGTERM/SIGINT (scancel, preemption, `--signal=B:TERM@...` before the time limit) go to the command first:
# `visionrl train` checkpoints its last completed step and exits 128 + signal; only then is Ray torn down.
cmd_pid=""
forward() {
  if [[ -n $cmd_pid ]]; then kill -"$1" "$cmd_pid" 2>/dev/null || true; else exit $((128 + $2)); fi
}
trap 'forward TERM 15' TERM
trap 'forward INT 2' INT

echo "[ray_cluster] head $head ($address), ${#nodes[@]} node(s): ${nodes[*]}"
srun --nodes=1 --ntasks=1 -w "$head" "$RAY" start --head --block --node-ip-address="$head_ip" --port="$port" \
  --ray-client-server-port=$((port + 1)) --include-dashboard=false --disable-usage-stats --temp-dir="$tmp" \
  "${resources[@]}" &
steps+=($!)
for node in "${nodes[@]:1}"; do
  srun --nodes=1 --ntasks=1 -w "$node" "$RAY" start --block --address="$address" --disable-usage-stats \
    --temp-dir="$tmp" "${resources[@]}" &
  steps+=($!)
done

# Wait until every node has joined (a node that fails to start is reported by its srun step's output).
python3 - "$address" "${#nodes[@]}" "$wait_s" <<'PY'
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

RAY_ADDRESS="$address" "$@" &
cmd_pid=$!
# A trapped signal ends `wait` early: wait again until the command itself has ended, and exit with its status.
while true; do
  status=0
  wait "$cmd_pid" || status=$?
  kill -0 "$cmd_pid" 2>/dev/null || break
done
exit "$status"
