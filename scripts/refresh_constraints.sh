#!/usr/bin/env bash
# Rewrite constraints.txt, the versions .ci/run installs: in a fresh virtual environment, the newest releases that
# pyproject's bounds allow, then the whole test suite; only if it passes is the environment frozen into
# constraints.txt (less torch, which CI pins on its command line, the project itself, and any CUDA-only package).
# Run it from anywhere when a dependency should move (a fix you need, a bound raised in pyproject.toml) and
# commit constraints.txt with what it changed; extra arguments go to pytest (e.g. -x).
set -euo pipefail
cd "$(dirname "$0")/.."
work="$(mktemp -d "${TMPDIR:-/tmp}/tunekit-constraints.XXXXXX")"
trap 'rm -rf "$work"' EXIT
unset PYTHONPATH
python3 -m venv "$work/venv"
# shellcheck disable=SC1091
source "$work/venv/bin/activate"
python -m pip install --quiet --no-compile --disable-pip-version-check torch==2.13.0 -e ".[dev,interop,trackers,eval]"
python -m pytest -q "$@"
{
    echo "# The versions .ci/run installs (pip install -c constraints.txt), frozen from a fresh virtual environment"
    echo "# in which the test suite passed. Regenerate with scripts/refresh_constraints.sh; do not edit by hand."
    python -m pip freeze --exclude-editable --exclude tunekit --exclude torch \
        | grep -viE '^(nvidia-|triton|torch==|tunekit)'
} > "$work/constraints.txt"
mv "$work/constraints.txt" constraints.txt
echo "wrote constraints.txt ($(grep -vc '^#' constraints.txt) packages)"
