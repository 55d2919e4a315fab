#!/usr/bin/env bash
# The GPU measurements of the production job, one part per call (each fits in 10 minutes on one H200 or H100),
# with the checkpoint and data kept in WORK between calls and every log and results file copied to OUT.
#
#   benchmarks/gpu_measure.sh PART [key=value ...]      from the repository root, vLLM and Ray installed
#
# PART:
#   learner         the learner alone: packing levers, compiled layers, equal and spread lengths (gpu_learner.py)
#   equal | spread  the whole step at 64 x 8 x 512 through visionrl's loop, 3 steps (gpu_grpo_step.py)
#   trl             TRL's GRPOTrainer and visionrl on the same spread lengths at 16 x 8 x 256; TRL with activation
#                   recompute on and off (TRL_RECOMPUTE=on or off for one: off needs more than 80 GB)
#   rollout         the job's vLLM engine alone, one setting at a time (gpu_rollout.py; VARIANTS=... to choose;
#                   tuned_lora tunes vLLM's LoRA kernels for the job first, lora_kernel_tune.py, kept in WORK)
#   tests           the GPU tests (tests/gpu)
# Extra key=value arguments override the job file (the 80 GB setting of its header, for example).
# Folders: WORK (default /tmp/visionrl-gpu-work) keeps the checkpoint, the data and RESULTS (default WORK/results:
# the results files, whose rows merge across calls; on an H200 seeded with the committed files, whose card they
# describe; on another card they start empty), OUT (default gpu-measure-out) gets the logs, each run's history and
# the results files. An H100 gets --lean in `learner` (the shipped setting needs more than 80 GB).
set -uo pipefail
part=${1:?"which part: learner, equal, spread, trl, rollout or tests"}
shift
OUT=${OUT:-gpu-measure-out}
WORK=${WORK:-/tmp/visionrl-gpu-work}
RESULTS=${RESULTS:-$WORK/results}
mkdir -p "$OUT" "$WORK" "$RESULTS"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
gpu=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1)
echo "$gpu" | tee "$OUT/gpu.txt"
case $gpu in *H200*) cp -n benchmarks/results/gpu_grpo_step.json benchmarks/results/gpu_learner.json "$RESULTS/" ;; esac
limit=${LIMIT_S:-570}

keep_runs() {  # each run's history and logs, and the results files
    for run in "$WORK"/run-*; do
        [ -d "$run" ] || continue
        mkdir -p "$OUT/$(basename "$run")"
        cp "$run"/*.jsonl "$run"/*.log "$OUT/$(basename "$run")/" 2>/dev/null
    done
    cp "$RESULTS"/*.json "$OUT/" 2>/dev/null
    if [ -d "$WORK/lora-kernels" ]; then  # the tuned LoRA kernel folder (tuned_lora) and its report
        mkdir -p "$OUT/lora-kernels" && cp "$WORK"/lora-kernels/*.json "$OUT/lora-kernels/" 2>/dev/null
    fi
}

case $part in
    learner)
        lean=""
        case $gpu in *H100*) lean="--lean" ;; esac
        timeout "$limit" python benchmarks/gpu_learner.py --packing-levers --compile-layers --lengths both $lean \
            --out "$RESULTS" > "$OUT/learner.log" 2>&1
        ;;
    equal | spread)
        for old in "$WORK"/run-64x8x512*; do  # a run folder is never reused: the earlier one moves aside
            [ -d "$old" ] && mv "$old" "$old-$(date +%s)"
        done
        timeout "$limit" python benchmarks/gpu_grpo_step.py --sizes 64x8x512 --lengths "$part" --steps 3 \
            --work "$WORK" --merge --out "$RESULTS" "$@" > "$OUT/step-$part.log" 2>&1
        ;;
    trl)
        timeout "$limit" python benchmarks/gpu_grpo_step.py --sizes 16x8x256 --trl 16x8x256 --lengths spread \
            --trl-recompute "${TRL_RECOMPUTE:-on,off}" --work "$WORK" --merge --out "$RESULTS" "$@" \
            > "$OUT/trl.log" 2>&1
        ;;
    rollout)
        timeout "$limit" python benchmarks/gpu_rollout.py --work "$WORK" --out "$RESULTS" \
            --variants "${VARIANTS:-job,adapter,tuned_lora,lora_specialize}" "$@" > "$OUT/rollout.log" 2>&1
        ;;
    tests)
        timeout "$limit" python -m pytest -q -p no:cacheprovider tests/gpu > "$OUT/tests.log" 2>&1
        ;;
    *)
        echo "unknown part $part: learner, equal, spread, trl, rollout or tests" >&2
        exit 2
        ;;
esac
rc=$?
keep_runs
echo "$part: exit $rc"
grep -hE '^target|^\{"size|^\{"variant|passed|failed|Traceback|Error' "$OUT"/*.log 2>/dev/null | cut -c1-600 | tail -30
exit $rc
