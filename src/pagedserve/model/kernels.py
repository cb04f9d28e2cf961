"""Our C++ CPU kernels, compiled on first use into the virtualenv (per machine, -march=native).

If no C++ compiler is available the engine falls back to the pure-PyTorch path. Where the kernels are
expected (x86-64 with a compiler), a build failure is a bug: it is logged as an error with its cause, and
the tests fail on it instead of skipping.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import time
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)
# A build takes minutes; a lock older than this was left by a process killed mid-build, and torch would wait on it
# forever.
STALE_LOCK_S = 30 * 60

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("bindings.cpp", "paged_attention.cpp", "prefill_attention.cpp", "fused_ops.cpp",
                                      "quant_gemm.cpp", "quant_gemm_amx.cpp", "quant_gemm_w8a8.cpp",
                                      "decode_stack.cpp", "token_bitmask.cpp", "argmax.cpp",
                                      "lora_sgmv.cpp")]
HEADERS = [CSRC / "vec_math.h", CSRC / "kv_quant.h", CSRC / "decode_int4.h", CSRC / "quant_params.h", CSRC / "ops.h",
           CSRC / "amx_tiles.h"]


@cache
def cpu_kernels():
    """The compiled extension module, or None when it cannot be built here."""
    from torch.utils.cpp_extension import load

    # One folder per source version and checkout: ninja rebuilds whenever the source paths in its commands
    # change, so two checkouts sharing a virtualenv would otherwise rebuild over each other in turn.
    digest = hashlib.sha256(str(CSRC).encode() + b"".join(p.read_bytes() for p in SOURCES + HEADERS)).hexdigest()[:12]
    build_dir = Path(sys.prefix) / "pagedserve_kernels" / digest
    build_dir.mkdir(parents=True, exist_ok=True)
    _drop_stale_lock(build_dir / "lock")
    try:
        return load(name="pagedserve_cpu_kernels", sources=[str(p) for p in SOURCES],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                    extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
    except Exception as e:  # the torch path still works; how loudly depends on why
        if kernels_expected():
            logger.exception("C++ kernels failed to build although a compiler is present; falling back to the "
                             "much slower PyTorch path")
        else:
            logger.warning("C++ kernels unavailable (no compiler or not x86-64): using the PyTorch path (%s)", e)
        return None


def _drop_stale_lock(lock: Path) -> None:
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logger.warning("removing %s, left %.0f minutes ago by a build that never finished", lock, age / 60)
        lock.unlink(missing_ok=True)


def kernels_expected() -> bool:
    """Whether the kernels must build here: an x86-64 CPU (they use AVX-512 / AVX2) and a C++ compiler."""
    compiler = os.environ.get("CXX", "c++")
    return platform.machine().lower() in ("x86_64", "amd64") and shutil.which(compiler) is not None
