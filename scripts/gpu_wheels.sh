#!/usr/bin/env bash
# Download the wheels scripts/gpu_check.sh installs on the lent GPU machine, which reaches no registry, into .whl/
# (git-ignored; the `device` tool's `carry` takes it along: well under its 64 MiB). For the image's Python 3.12,
# and for this machine's Python, where the CPU rehearsal (`scripts/gpu_check.sh --device cpu`) installs them too.
set -euo pipefail
cd "$(dirname "$0")/.."
here=$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
for py in 3.12 "$here"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --implementation cp --python-version "$py" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl -r scripts/gpu_wheels.txt
done
du -sh .whl
