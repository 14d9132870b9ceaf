#!/usr/bin/env bash
# Builds llama.cpp's own llama-server and llama-batched-bench (bench peers for issue 14)
# from the llama.cpp sources inside the llama-cpp-python source distribution at the
# version our venv runs, so both sides of a race run the same llama.cpp.
# Idempotent: a stamp names the version; rerunning with it present is a no-op.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
VERSION="$("$PY" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))')"
DIR="${LLAMA_PEER_DIR:-$ROOT/var/peers/llama.cpp}"
STAMP="$DIR/.built-$VERSION"

if [ -f "$STAMP" ]; then
    echo "llama.cpp peer: $DIR/bin ready (llama-cpp-python $VERSION)"
    exit 0
fi
start=$(date +%s)
rm -rf "$DIR"
mkdir -p "$DIR/src"
"$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$DIR/src"
tar xzf "$DIR"/src/llama_cpp_python-*.tar.gz -C "$DIR/src"
LLAMA="$(ls -d "$DIR"/src/llama_cpp_python-*/vendor/llama.cpp)"
cmake -S "$LLAMA" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF \
      -DGGML_NATIVE=OFF >/dev/null
cmake --build "$DIR/build" -j"$(nproc)" --target llama-server llama-batched-bench
mkdir -p "$DIR/bin"
cp "$DIR/build/bin/llama-server" "$DIR/build/bin/llama-batched-bench" "$DIR/bin/"
rm -rf "$DIR/build/CMakeFiles" "$DIR/src"
touch "$STAMP"
echo "llama.cpp peer: built $DIR/bin in $(( $(date +%s) - start )) s"
