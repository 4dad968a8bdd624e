#!/usr/bin/env bash
# Fetch the wheels bench/gpu_check.sh installs on the GPU device machine into .whl/
# (git-ignored: /.whl/ in .gitignore). That machine has python3.12 with CUDA 13 torch,
# numpy and uvloop but no package registry; these are what kvpushd adds (about 57 MB,
# most of it nixl-cu13 with its UCX). --no-deps: each needed package is named here:
# nixl (the meta package) picks nixl_cu13 from torch's CUDA version; nixl-cu13 needs
# torch and numpy (already there); the others need nothing on Python 3.12.
# Run from anywhere, on a machine with network access:  bash bench/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 \
    -d .whl \
    nixl==1.5.1 nixl-cu13==1.5.1 msgspec==0.23.0 structlog==26.1.0 \
    crc32c==2.9.post0 prometheus-client==0.26.0
ls -l .whl
