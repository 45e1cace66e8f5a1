#!/usr/bin/env bash
# Every GPU check in one run, for the few minutes a device is lent (the `device` tool of /work/.library):
# the CUDA tests (each has a CPU twin), then one real-shape Kimi K2 MoE layer through GPTQ (hidden 7168,
# 384 experts of 2048, MLA, FP8 blocks; 512 x 2048 calibration tokens), its seconds per phase and the whole
# model extrapolated to 1 and 8 GPUs. Results land in $OUT (or .cache/gpu-check).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.cache/gpu-check}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv | tee "$out/gpu.txt"
python -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py 2>&1 | tail -15 | tee "$out/gpu-tests.txt"
python scripts/bench.py moe-layer --device cuda --work /tmp/bench --json "$out/moe-layer-cuda.json" \
  2>&1 | tail -40 | tee "$out/moe-layer-cuda.txt"
