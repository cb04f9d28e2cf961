"""KV blocks handed over through the Ray object store, for workers that joined a Ray cluster (`serve
--ray-address`, which `cluster up --backend ray` sets on disaggregated replicas).

The prefill worker puts a lease's blocks into the object store (one copy into its node's store) and answers with
the object's reference; the decode worker gets it (Ray's object manager moves it between nodes; on the same node
it is mapped, not copied) and imports the blocks straight from the store's memory. The prefill worker owns the
objects and frees them when the lease ends (released or expired), so the store holds nothing after a handoff.
"""
from __future__ import annotations

import base64
import logging
from typing import Any

import numpy as np

log = logging.getLogger(__name__)
NAMESPACE = "pagedserve"


def join(address: str) -> str:
    """Connects this process to the Ray cluster at address as a driver; returns the cluster's GCS address, which
    tells two workers whether they share one object store."""
    import ray

    ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, configure_logging=False)
    cluster = ray.get_runtime_context().gcs_address
    log.info("joined the Ray cluster at %s: KV blocks can move through its object store", cluster)
    return cluster


def put(data: memoryview) -> tuple[str, Any]:
    """(the object's reference, serialized for a JSON body; the reference itself, to free it later)."""
    import ray

    ref = ray.put(np.frombuffer(data, dtype=np.uint8))
    return base64.b64encode(ray.cloudpickle.dumps(ref)).decode(), ref


def take(serialized: str, timeout_s: float) -> memoryview:
    """The object's bytes, read-only in the store's memory (the view keeps them mapped). Raises Ray's
    GetTimeoutError after timeout_s, or its ObjectLostError family when the owner or the object is gone."""
    import ray

    ref = ray.cloudpickle.loads(base64.b64decode(serialized))
    return memoryview(ray.get(ref, timeout=timeout_s))


def free(refs: list[Any]) -> None:
    """Lets the store drop the objects: a reference serialized by hand (as put does for the JSON body) is pinned
    by Ray for its owner's lifetime, so the pin is taken back here; the object goes once no decode worker still
    borrows it (Ray learns of a borrower's end asynchronously)."""
    import ray

    core_worker = ray._private.worker.global_worker.core_worker
    for ref in refs:
        try:
            core_worker.remove_object_ref_reference(ref)
        except Exception as e:  # noqa: BLE001 - the cluster may be going down; the objects go with it
            log.warning("unpinning a KV object in the Ray object store failed: %s", e)


def errors() -> tuple[type[BaseException], ...]:
    """What a failed take raises (Ray's errors, imported only where Ray is used)."""
    import ray

    return (ray.exceptions.RayError, ray.exceptions.GetTimeoutError)
