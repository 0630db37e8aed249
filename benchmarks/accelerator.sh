#!/usr/bin/env bash
# For when a GPU or TPU is lent: install the accelerator build of the pinned
# jax, then run benchmarks/accelerator.py (sampler, ragged, update: tokens/s,
# HBM GB/s, MFU) within 8 minutes.
#
#   bash benchmarks/accelerator.sh [--dry-run] [--wheels DIR] [--no-install]
#                                  [-- ARGS for accelerator.py]
#
#   --dry-run     no install; the tiny model for a few steps on whatever
#                 backend is there (CPU here): checks the script end to end
#   --wheels DIR  install offline from wheels in DIR (a machine that reaches
#                 no package index): pip --no-index --find-links DIR
#   --no-install  use the jax already installed (its version is printed)
#
# The accelerator is found from nvidia-smi (GPU: jax[cuda12]) or a TPU
# device node /dev/accel* or /dev/vfio/* (TPU: jax[tpu]); the jax version is
# requirements.txt's pin.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DRY=0; WHEELS=""; INSTALL=1; ARGS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY=1; INSTALL=0 ;;
    --wheels) WHEELS="$2"; shift ;;
    --no-install) INSTALL=0 ;;
    --) shift; ARGS=("$@"); break ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

JAX_VERSION=$(sed -n 's/^jax==\([0-9.]*\).*/\1/p' requirements.txt)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  ACCEL=gpu; EXTRA="cuda12"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
elif compgen -G "/dev/accel*" >/dev/null || compgen -G "/dev/vfio/[0-9]*" >/dev/null; then
  ACCEL=tpu; EXTRA="tpu"
else
  ACCEL=none; EXTRA=""
fi
echo "accelerator: ${ACCEL}; pinned jax ${JAX_VERSION}"
if [[ ${DRY} == 0 && ${ACCEL} == none ]]; then
  echo "no GPU (nvidia-smi) or TPU (/dev/accel*, /dev/vfio) found; use --dry-run" >&2
  exit 1
fi

if [[ ${INSTALL} == 1 ]]; then
  PIP=("${PY}" -m pip install -q)
  if [[ -n ${WHEELS} ]]; then PIP+=(--no-index --find-links "${WHEELS}"); fi
  "${PIP[@]}" "jax[${EXTRA}]==${JAX_VERSION}"
  # grpo_jax's other runtime packages (requirements.txt without jax itself).
  grep -v -E '^(#|jax|jaxlib)' requirements.txt | grep -v '^$' > /tmp/grpo_jax_runtime.txt
  "${PIP[@]}" -r /tmp/grpo_jax_runtime.txt
fi
"${PY}" -c "import jax; print('jax', jax.__version__, jax.default_backend(), jax.devices())"

if [[ ${DRY} == 1 ]]; then
  ARGS=(--dry-run "${ARGS[@]}")
fi
# 8 minutes for all three parts (compiles included).
timeout 480 "${PY}" benchmarks/accelerator.py "${ARGS[@]}"
