#!/usr/bin/env bash
# Unpacks llama.cpp's sources, as vendored in the llama-cpp-python sdist on PyPI, into OUT_DIR/llama.cpp: the
# tests convert tiny Hugging Face models with its convert_hf_to_gguf.py (the GGUF layout llama.cpp defines), and
# build_llama_server.sh builds its binaries from them. Idempotent. Usage: fetch_llama_cpp.sh [OUT_DIR]
# (default: build/peers). LLAMA_CPP_PYTHON_VERSION picks the sdist (default: the one the tests were written on).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${1:-$ROOT/build/peers}"
PY="${PY:-$ROOT/.venv/bin/python}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"

if [[ -f "$OUT/llama.cpp/convert_hf_to_gguf.py" ]]; then
  exit 0
fi
mkdir -p "$OUT"
SDIST="$OUT/llama_cpp_python-$VERSION.tar.gz"
if [[ ! -f "$SDIST" ]]; then
  "$PY" -m pip download -q --no-deps --no-binary :all: --dest "$OUT" "llama-cpp-python==$VERSION"
fi
rm -rf "$OUT/llama.cpp" "$OUT/sdist" && mkdir "$OUT/sdist"
tar -xzf "$SDIST" -C "$OUT/sdist"
mv "$OUT"/sdist/*/vendor/llama.cpp "$OUT/llama.cpp"
rm -rf "$OUT/sdist"
echo "llama.cpp $VERSION sources in $OUT/llama.cpp"
