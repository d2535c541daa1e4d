#!/usr/bin/env bash
# Download the wheels benchmarks/gpu/run_checks.py installs on a GPU machine without network (see README.md here),
# and build our own wheel, into one folder. Run it where PyPI is reachable; do not commit the wheels.
#
#   bash benchmarks/gpu/fetch_wheels.sh [DEST]        # default DEST: benchmarks/gpu/wheels (ignored by git)
#
# PYTHON_VERSION (default 3.12) and PLATFORM (default manylinux2014_x86_64) name the GPU machine's interpreter, so
# that the version-specific wheel (multiprocess) fits it rather than this machine; PYTHON_VERSION=3.11 for a
# --dry-run here.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest="${1:-benchmarks/gpu/wheels}"
python_version="${PYTHON_VERSION:-3.12}"
platform="${PLATFORM:-manylinux2014_x86_64}"
mkdir -p "$dest"

# The list is README.md's; --no-deps: exactly these files, nothing resolved against this machine.
pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$python_version" --platform "$platform" --dest "$dest" \
    torchtune==0.6.1 torchao==0.10.0 torchdata==0.11.0 omegaconf==2.4.0 \
    datasets==5.0.0 fsspec==2026.4.0 dill==0.4.1 multiprocess==0.70.19 \
    kagglehub==1.0.3 kagglesdk==0.1.38

# Ours, from this checkout (the recipes and configs ship inside it).
pip wheel --quiet --disable-pip-version-check --no-deps --wheel-dir "$dest" .

ls -l "$dest"
