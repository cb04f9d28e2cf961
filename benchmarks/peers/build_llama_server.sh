#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` and `llama-bench` (CPU) from the llama.cpp sources vendored in the
# llama-cpp-python sdist on PyPI, so the serving and quantization benchmarks can run the same GGUF against
# it. Idempotent: existing binaries are kept. Usage: benchmarks/peers/build_llama_server.sh [OUT_DIR]  (default: build/peers)
# Prints the path of the binary on its last line.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${1:-$ROOT/build/peers}"
PY="${PY:-$ROOT/.venv/bin/python}"
BIN="$OUT/llama.cpp/build/bin/llama-server"

if [[ -x "$BIN" && -x "$(dirname "$BIN")/llama-bench" ]]; then
  echo "$BIN"
  exit 0
fi
PY="$PY" "$ROOT/benchmarks/peers/fetch_llama_cpp.sh" "$OUT"
cd "$OUT"

# Native, without ggml's AMX kernels: they keep their tile configuration in a thread-local flag and die with
# SIGILL (tilezero, unconfigured tiles) on the first prompt on the AMX machines we run on; its AVX-512 VNNI
# kernels are its fastest working path there. Elsewhere the -mno-amx flags change nothing.
NO_AMX=""
if [[ "$(uname -m)" == "x86_64" ]]; then NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"; fi
cmake -S llama.cpp -B llama.cpp/build -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
  -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" >/dev/null
cmake --build llama.cpp/build --target llama-server llama-bench -j "${JOBS:-2}"
echo "$BIN"
