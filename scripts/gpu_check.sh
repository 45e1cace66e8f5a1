#!/usr/bin/env bash
# Every GPU check in one call, for the minutes a GPU machine is lent (the `device` tool of /work/.library), on that
# machine as it is: Python 3.12, torch 2.11 + CUDA 13, transformers, safetensors, pytest, but no compressed-tensors,
# pydantic or loguru and no package registry. Those come from the wheels in .whl/ (made here by
# `bash scripts/gpu_wheels.sh`, carried along), installed beside the image's packages with --no-index into a folder
# on PYTHONPATH; quantize runs from this checkout, not installed. Each check prints one PASS/FAIL/SKIP line and a
# failing one does not stop the rest (scripts/gpu_check.py); results land in $OUT (or .cache/gpu-check).
#
#   device run, carry [".whl"]:  bash scripts/gpu_check.sh
#   CPU rehearsal of the same chain, in a venv of what the image holds (torch 2.13 CPU: torch 2.11's wheel here is a
#   CUDA build of several GB; typer pulls pydantic in, which the image does not have, so it goes again):
#     python3 -m venv /tmp/image && /tmp/image/bin/pip install "torch==2.13.0" -r scripts/gpu_image.txt
#     /tmp/image/bin/pip uninstall -y pydantic pydantic-core annotated-types typing-inspection
#     PATH=/tmp/image/bin:$PATH bash scripts/gpu_check.sh --device cpu
set -uo pipefail  # no -e: every check runs and reports
cd "$(dirname "$0")/.."
site=${GPU_CHECK_SITE:-/tmp/quantize-site}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
  --find-links .whl -r scripts/gpu_wheels.txt || { echo "FAIL install: the wheels of scripts/gpu_wheels.txt are not in .whl (bash scripts/gpu_wheels.sh)"; exit 1; }
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ "${1:-}" != "--device" ] && command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv
fi
python3 scripts/gpu_check.py "$@"
