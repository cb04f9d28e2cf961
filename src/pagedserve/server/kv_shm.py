"""KV blocks handed over through shared memory when the prefill and decode workers share a host: the prefill
worker writes a lease's blocks into a named segment (/dev/shm) and answers with its name; the decode worker
maps it, unlinks the name and imports the blocks straight from the mapping. One memory copy on each side
instead of a loopback socket's several. A segment the decode worker never took is unlinked with its lease
(released or expired)."""
from __future__ import annotations

import contextlib
import ipaddress
import mmap
import os
import socket
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory
from urllib.parse import urlsplit


def write_with(size: int, fill: Callable[[memoryview], None]) -> str:
    """A new segment of size bytes that fill writes in place (so the blocks are gathered straight into it);
    its name. fill must not keep the view."""
    segment = shared_memory.SharedMemory(create=True, size=max(size, 1))
    # The reader unlinks it: keep this process's resource tracker from unlinking (and warning) at exit.
    resource_tracker.unregister(segment._name, "shared_memory")
    view = segment.buf[:size]
    try:
        fill(view)
    except BaseException:
        view.release()
        segment.close()
        discard(segment.name)
        raise
    view.release()
    segment.close()
    return segment.name


def take(name: str, size: int) -> memoryview:
    """The segment's first size bytes, read-only and mapped (not copied): its name is gone at once, its memory
    when the last view of it is dropped. FileNotFoundError: not on this host; ValueError: shorter than size."""
    path = os.path.join("/dev/shm", name.lstrip("/"))  # where Linux keeps POSIX shared memory
    fd = os.open(path, os.O_RDONLY)
    try:
        os.unlink(path)
        if os.fstat(fd).st_size < size:
            raise ValueError(f"shared-memory segment {name} holds fewer than the {size} bytes announced")
        if size == 0:
            return memoryview(b"")
        return memoryview(mmap.mmap(fd, size, prot=mmap.PROT_READ))
    finally:
        os.close(fd)


def discard(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        segment = shared_memory.SharedMemory(name=name)
        segment.close()
        segment.unlink()


def same_host(url: str) -> bool:
    """Whether the worker at url runs on this machine (a loopback address or one of this host's names)."""
    host = urlsplit(url).hostname or ""
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).is_loopback:
            return True
    if host == "localhost":
        return True
    with contextlib.suppress(OSError):
        return socket.gethostbyname(host) == socket.gethostbyname(socket.gethostname())
    return False
