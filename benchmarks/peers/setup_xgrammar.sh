#!/usr/bin/env bash
# The structured-output benchmark's peer: xgrammar, into the project's virtualenv. --no-deps: its declared
# dependencies (triton, a torch range) would pull a CUDA build; what it needs on the CPU is here already
# (torch, transformers, pydantic, numpy) except apache-tvm-ffi.
set -euo pipefail
cd "$(dirname "$0")/../.."
.venv/bin/pip install -q --no-deps "xgrammar==0.2.9" "apache-tvm-ffi>=0.1.11"
.venv/bin/python -c "import xgrammar; print('xgrammar ready')"
