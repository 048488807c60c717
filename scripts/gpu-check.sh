#!/usr/bin/env bash
# The GPU check: on a machine with NVIDIA GPUs, run the paths the CPU test suites can't reach (TensorFlow's
# MirroredStrategy, JAX's mesh, PyTorch's NCCL job with shard= and compression=), each in a process of its own
# under its own time limit, all within 8 minutes. One line per path, then a summary:
#   PASS tf-mirrored: tensorflow 2.21.0 (CUDA 12.5.1, ...): 2 replicas (gpu:0, gpu:1) ... [21.4 s]
#   SKIP jax: no NVIDIA GPU (nvidia-smi not found, no /dev/nvidia* device) [0.0 s]
#   summary: 4 PASS, 0 FAIL, 1 SKIP in 143.2 s (logs: /tmp/distkeras-gpu-check-...): OK
# Exit code 0 when no path FAILed (SKIPs are fine), 1 otherwise. Details: scripts/gpu_check.py.
#
# Usage (nothing is installed: the machine needs no internet):
#   bash scripts/gpu-check.sh                          # the repo's .venv (made by `source scripts/env.sh`)
#   PYTHON=/path/to/venv/bin/python bash scripts/gpu-check.sh   # any Python with keras and the frameworks
#   bash scripts/gpu-check.sh jax torch-nccl           # some paths only
# Without a GPU every path is a SKIP saying why, in about a second. DISTKERAS_GPU_CHECK_FAKE_CPU=1 runs the
# checks on 2 CPU devices (gloo for NCCL) to check the script itself; DISTKERAS_GPU_CHECK_FAKE_DEVICES=1 with
# it plays a one-GPU machine.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
if ! command -v "$PYTHON" >/dev/null 2>&1; then
  echo "gpu-check: no Python at PYTHON=$PYTHON; run \`source scripts/env.sh\` once, or set PYTHON=/path/to/python" >&2
  exit 1
fi
exec "$PYTHON" "$ROOT/scripts/gpu_check.py" "$@"
