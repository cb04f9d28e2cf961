"""Documents read from disk for `gateway index add`: only regular files inside the folders given.

A folder is walked through directory descriptors: each entry is opened relative to its parent's descriptor with
O_NOFOLLOW, so a symbolic link (to /etc/passwd, into /proc) is never followed, and a folder swapped for a link
between the listing and the open cannot lead outside. What was opened is judged on its descriptor (fstat): a
regular file, not on /proc or /sys, read up to the size limit (never trusting st_size: /proc's files say 0).
Links, devices, FIFOs and sockets inside a folder are skipped and listed; named directly, they are errors.

Document names: a file given directly is named by its file name; a file found in a folder by the folder's
name and its path inside it ("hr/leave/germany.md"). Hidden files and folders (".git") are left out.
"""
from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from pagedserve.gateway.retrieval.chunking import SUFFIXES
from pagedserve.gateway.retrieval.indexer import MAX_DOCUMENT_BYTES, IndexInputError

MAX_DEPTH = 64  # folders inside folders: each level holds a descriptor open while it is walked
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC  # NONBLOCK: a FIFO can't hang us
PSEUDO_FILESYSTEMS = ("/proc", "/sys")  # their files are views of the machine's state, never documents


@dataclass(slots=True)
class Reading:
    files: dict[str, bytes] = field(default_factory=dict)  # document name -> bytes
    prefixes: list[str] = field(default_factory=list)  # the folders' names: a re-add prunes what is gone there
    skipped: list[str] = field(default_factory=list)  # "path: why" for what a folder held but was not read
    errors: list[str] = field(default_factory=list)


def read_paths(paths: list[Path]) -> Reading:
    """The documents under the paths; IndexInputError lists every problem (then nothing is indexed). Files
    of other types inside a folder are passed over; one named directly is an error (by parse_document)."""
    reading = Reading()
    pseudo = {os.stat(p).st_dev for p in PSEUDO_FILESYSTEMS if os.path.isdir(p)}
    for path in paths:
        try:
            kind = stat.S_IFMT(os.lstat(path).st_mode)  # a device must not even be opened
            fd = os.open(path, OPEN_FLAGS) if kind in (stat.S_IFDIR, stat.S_IFREG) else None
        except OSError as e:
            reading.errors.append(f"{path}: {_why(e)}")
            continue
        if fd is None:
            reading.errors.append(f"{path}: {_not_regular(kind)}")
            continue
        try:
            st = os.fstat(fd)
            if st.st_dev in pseudo:
                reading.errors.append(f"{path}: on {' or '.join(PSEUDO_FILESYSTEMS)}, not a document")
            elif stat.S_ISDIR(st.st_mode):
                prefix = f"{path.resolve().name}/"
                reading.prefixes.append(prefix)
                _walk(fd, prefix, str(path), reading, pseudo)
            else:
                _add(reading, path.name, str(path), _read(fd, pseudo))
        finally:
            os.close(fd)
    if reading.errors:
        raise IndexInputError("; ".join(reading.errors))
    return reading


def _walk(top: int, prefix: str, shown: str, reading: Reading, pseudo: set[int]) -> None:
    """Depth first, one descriptor per level open; the entries of a folder in name order."""
    stack = [(os.dup(top), "", _entries(top))]
    try:
        while stack:
            fd, rel, entries = stack[-1]
            entry = next(entries, None)
            if entry is None:
                os.close(stack.pop()[0])
                continue
            where = f"{shown.rstrip('/')}/{rel}{entry.name}"
            if entry.name.startswith("."):
                continue
            if entry.is_symlink():
                reading.skipped.append(f"{where}: a symbolic link (never followed)")
            elif entry.is_dir(follow_symlinks=False):
                if len(stack) >= MAX_DEPTH:
                    reading.skipped.append(f"{where}: nested deeper than {MAX_DEPTH} folders")
                    continue
                sub = _open(entry.name, fd, os.O_DIRECTORY, where, reading)
                if sub is not None:
                    stack.append((sub, f"{rel}{entry.name}/", _entries(sub)))
            elif not entry.is_file(follow_symlinks=False):
                reading.skipped.append(f"{where}: {_not_regular(stat.S_IFMT(entry.stat(follow_symlinks=False).st_mode))}")
            elif PurePosixPath(entry.name).suffix.lower() in SUFFIXES:
                file_fd = _open(entry.name, fd, 0, where, reading)
                if file_fd is not None:
                    try:
                        _add(reading, f"{prefix}{rel}{entry.name}", where, _read(file_fd, pseudo))
                    finally:
                        os.close(file_fd)
    finally:
        for fd, _, _ in stack:
            os.close(fd)


def _entries(fd: int) -> Iterator[os.DirEntry]:
    with os.scandir(fd) as listing:
        return iter(sorted(listing, key=lambda e: e.name))


def _open(name: str, dir_fd: int, flags: int, where: str, reading: Reading) -> int | None:
    """The entry opened relative to its folder, never through a link (one swapped in since the listing: ELOOP)."""
    try:
        return os.open(name, OPEN_FLAGS | flags, dir_fd=dir_fd)
    except OSError as e:
        reading.skipped.append(f"{where}: {_why(e)}")
        return None


def _read(fd: int, pseudo: set[int]) -> bytes | str:
    """The file's bytes, or why it is not a document: judged on the descriptor, bounded by what is read."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        return _not_regular(stat.S_IFMT(st.st_mode))
    if st.st_dev in pseudo:
        return f"on {' or '.join(PSEUDO_FILESYSTEMS)}, not a document"
    chunks, size = [], 0
    while block := os.read(fd, min(1 << 20, MAX_DOCUMENT_BYTES + 1 - size)):
        chunks.append(block)
        size += len(block)
        if size > MAX_DOCUMENT_BYTES:
            return f"larger than {MAX_DOCUMENT_BYTES >> 20} MiB"
    return b"".join(chunks)


def _add(reading: Reading, name: str, where: str, data: bytes | str) -> None:
    if isinstance(data, str):
        reading.errors.append(f"{where}: {data}")
    elif name in reading.files:
        reading.errors.append(f"{where}: a second document named {name!r}")
    else:
        reading.files[name] = data


def _not_regular(kind: int) -> str:
    names = {stat.S_IFLNK: "a symbolic link (never followed)", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
             stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}
    return f"{names.get(kind, 'not a regular file')}, not a document"


def _why(e: OSError) -> str:
    if e.errno == errno.ENOENT:
        return "no such file or folder"
    if e.errno == errno.ELOOP:  # one swapped in since it was looked at
        return "a symbolic link (never followed)"
    if e.errno == errno.ENOTDIR:  # what O_DIRECTORY | O_NOFOLLOW says of a link in a folder's place
        return "no longer a folder (a link or file in its place is never followed)"
    return e.strerror or type(e).__name__
