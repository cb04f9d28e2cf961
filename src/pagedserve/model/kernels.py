"""Our C++ CPU kernels, compiled on first use into the virtualenv (per machine, -march=native).

If no compiler is available the engine falls back to the pure-PyTorch path.
"""
from __future__ import annotations

import hashlib
import logging
import sys
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [CSRC / name for name in ("bindings.cpp", "paged_attention.cpp", "prefill_attention.cpp", "fused_ops.cpp")]
HEADERS = [CSRC / "vec_math.h"]


@cache
def cpu_kernels():
    """The compiled extension module, or None when it cannot be built here."""
    from torch.utils.cpp_extension import load

    # One folder per source version: checkouts sharing a virtualenv never rebuild over each other.
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS)).hexdigest()[:12]
    build_dir = Path(sys.prefix) / "pagedserve_kernels" / digest
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        return load(name="pagedserve_cpu_kernels", sources=[str(p) for p in SOURCES],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
                    extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
    except Exception as e:  # noqa: BLE001 -- a missing compiler or headers: the torch path still works
        logger.warning("C++ kernels unavailable (%s); using the PyTorch path", e)
        return None
