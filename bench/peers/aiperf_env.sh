#!/usr/bin/env bash
# Builds NVIDIA's aiperf (the third-party benchmark harness of bench_aiperf.py)
# in a virtual environment of its own, so its pins never touch modeld's venv.
# Idempotent: a stamp names the version; rerunning with it present is a no-op.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${AIPERF_VENV:-$ROOT/.venv-aiperf}"
VERSION="${AIPERF_VERSION:-0.13.0}"
STAMP="$VENV/.modeld-aiperf-$VERSION"
PY="${PYTHON:-python3}"

if [ -f "$STAMP" ]; then
    echo "aiperf env: $VENV ready (aiperf $VERSION)"
    exit 0
fi
start=$(date +%s)
# a half-built environment is rebuilt from scratch, so the stamp always means this recipe
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "aiperf==$VERSION"
"$VENV/bin/aiperf" --help >/dev/null
touch "$STAMP"
echo "aiperf env: built $VENV in $(( $(date +%s) - start )) s"
