#!/usr/bin/env bash
# The reference quantized checkpoints of the default model (build/quantized/<scheme>/, with what transformers makes
# of each in reference/), written by llm-compressor in its own venv (build/llmc-venv: it pins its own transformers
# and compressed-tensors). Idempotent: the venv is built once and a scheme already written is skipped.
# Usage: make_quantized_checkpoints.sh [SCHEME ...]   env: SRC (HF folder of the default model), PAGEDSERVE_PY
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
venv="$root/build/llmc-venv"
src="${SRC:-$root/build/peers/smollm2-hf}"
if [ ! -f "$venv/.installed" ]; then
  test -x "$venv/bin/python" || "${PY:-python3}" -m venv "$venv"
  "$venv/bin/pip" install -q torch==2.13.0  # torch first, as the Makefile pins it, so nothing pulls another build
  "$venv/bin/pip" install -q llmcompressor==0.14.0.1
  touch "$venv/.installed"
fi
if [ ! -f "$src/config.json" ]; then
  "${PAGEDSERVE_PY:-$root/.venv/bin/python}" "$root/benchmarks/peers/export_hf_folder.py" "$src"
fi
exec "$venv/bin/python" "$root/benchmarks/peers/make_quantized_checkpoints.py" "$src" "$root/build/quantized" "$@"
