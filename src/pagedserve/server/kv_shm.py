"""KV blocks handed over through shared memory when the prefill and decode workers share a host: the prefill
worker writes a lease's blocks into a named segment (/dev/shm) and answers with its name; the decode worker
maps it, unlinks the name and imports the blocks straight from the mapping. One memory copy on each side
instead of a loopback socket's several. A segment the decode worker never took is unlinked with its lease
(released or expired), or when the lease is exported again.

Segment names are ours (NAME_PATTERN): a decode worker maps only a name of that pattern, and opens it without
following links and only as a regular file, so the answer it reads cannot make it open or unlink anything else."""
from __future__ import annotations

import contextlib
import ipaddress
import mmap
import os
import re
import secrets
import socket
import stat
from collections.abc import Callable
from multiprocessing import resource_tracker, shared_memory
from urllib.parse import urlsplit

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory
NAME_PREFIX = "pagedserve-kv-"
NAME_PATTERN = re.compile(r"pagedserve-kv-[0-9a-f]{32}")


def write_with(size: int, fill: Callable[[memoryview], None]) -> str:
    """A new segment of size bytes that fill writes in place (so the blocks are gathered straight into it);
    its name. fill must not keep the view."""
    segment = shared_memory.SharedMemory(NAME_PREFIX + secrets.token_hex(16), create=True, size=max(size, 1))
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


def take(name: object, size: int) -> memoryview:
    """The segment's first size bytes, read-only and mapped (not copied): its name is gone at once, its memory
    when the last view of it is dropped. FileNotFoundError: not on this host; ValueError: not one of our
    segments, or shorter than size."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError("the export named no pagedserve KV segment")
    directory = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=directory)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise ValueError(f"{name} is not a shared-memory segment")
        os.unlink(name, dir_fd=directory)
    finally:
        os.close(directory)
    try:
        if os.fstat(fd).st_size < size:
            raise ValueError(f"shared-memory segment {name} holds fewer than the {size} bytes announced")
        if size == 0:
            return memoryview(b"")
        return memoryview(mmap.mmap(fd, size, prot=mmap.PROT_READ))
    finally:
        os.close(fd)


def discard(name: str) -> None:
    if not NAME_PATTERN.fullmatch(name):
        return
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
