"""Issue #36, finding 10: `gateway index add` reads only regular files inside the folder it is given (no links
to /etc/passwd, no /proc, no FIFOs or devices, a size limit on what is read), whatever is swapped in while it
reads; and two adds of one source at once, from any processes sharing the store, embed and bump once.

The reading is checked in process on a real file system; the end-to-end checks run `pagedserve gateway index
add` processes and a real gateway over SQLite and Redis, with the stand-in provider recording what it is sent."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from gateway_support import gateway, redis_server, start_all, stub_provider, stub_state, wait_for

from pagedserve.gateway.retrieval import reading
from pagedserve.gateway.retrieval.indexer import MAX_DOCUMENT_BYTES, IndexInputError
from pagedserve.gateway.retrieval.reading import read_paths
from pagedserve.gateway.store import RedisStore, SQLiteStore

ADMIN = "admin-secret"
HR = Path(__file__).parent / "data" / "hr_policy"
PASSWD = Path("/etc/passwd").read_text().splitlines()[0]  # "root:x:0:0:root:/root:/bin/bash" or the like


@pytest.fixture
def hostile(tmp_path) -> Path:
    """The HR folder, plus everything an attacker with write access to it might plant."""
    folder = tmp_path / "hr"
    shutil.copytree(HR, folder)
    (folder / "passwd.txt").symlink_to("/etc/passwd")
    (folder / "environ.txt").symlink_to("/proc/self/environ")
    (folder / "proc").symlink_to("/proc/self")  # a folder link: its files would be read past the size limit
    (folder / "etc").symlink_to("/etc")
    os.mkfifo(folder / "pipe.md")  # opening it to read would block until a writer comes
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(folder / "socket.md"))
    server.close()
    return folder


def test_a_folder_is_read_without_following_links_or_special_files(hostile):
    read = read_paths([hostile])
    assert sorted(read.files) == ["hr/expenses.md", "hr/holidays.txt", "hr/leave/germany.md", "hr/remote-work.html"]
    assert not any(PASSWD.encode() in data for data in read.files.values())
    skipped = "\n".join(read.skipped)
    for name, why in (("passwd.txt", "symbolic link"), ("environ.txt", "symbolic link"), ("proc", "symbolic link"),
                      ("etc", "symbolic link"), ("pipe.md", "FIFO"), ("socket.md", "socket")):
        assert f"{hostile}/{name}: a {why}" in skipped, skipped
    assert read.prefixes == ["hr/"]


def test_a_file_or_folder_swapped_for_a_link_after_the_listing_is_not_followed(hostile, monkeypatch):
    """The race between looking and opening: the listing says regular file and folder, the open meets links."""
    listed = reading._entries

    def listing_then_swap(fd: int):
        entries = listed(fd)
        page, leave = hostile / "expenses.md", hostile / "leave"
        if page.is_file() and not page.is_symlink():
            page.unlink()
            page.symlink_to("/etc/passwd")
            shutil.rmtree(leave)
            leave.symlink_to("/proc/self")
        return entries
    monkeypatch.setattr(reading, "_entries", listing_then_swap)
    read = read_paths([hostile])
    assert sorted(read.files) == ["hr/holidays.txt", "hr/remote-work.html"]
    assert not any(PASSWD.encode() in data for data in read.files.values())
    assert any("expenses.md: a symbolic link" in s for s in read.skipped)
    assert any("leave: no longer a folder" in s for s in read.skipped)


def test_what_is_named_directly_must_be_a_regular_file_or_folder_off_proc(tmp_path):
    os.mkfifo(tmp_path / "pipe.md")
    (tmp_path / "link.md").symlink_to("/etc/passwd")
    big = tmp_path / "big.md"
    with big.open("wb") as f:  # its size is known: also read past the limit, never trusted
        f.write(b"# Big\n\n" + b"x" * MAX_DOCUMENT_BYTES)
    cases = [(tmp_path / "pipe.md", "a FIFO"), (tmp_path / "link.md", "a symbolic link"),
             (Path("/dev/zero"), "a character device"), (Path("/proc/self/status"), "on /proc"),
             (Path("/proc/self"), "a symbolic link"), (Path("/proc/sys"), "on /proc"), (big, "larger than 16 MiB"),
             (tmp_path / "missing", "no such file")]
    for path, why in cases:
        with pytest.raises(IndexInputError, match=why):
            read_paths([path])
    with pytest.raises(IndexInputError) as e:
        read_paths([tmp_path / "pipe.md", tmp_path / "link.md", tmp_path / "missing"])
    assert str(e.value).count(str(tmp_path)) == 3  # every problem listed


@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_an_index_lease_excludes_other_processes_until_freed_or_expired(kind, tmp_path):
    class Clock:
        now = 1_000_000.0

        def __call__(self) -> float:
            return self.now
    clock = Clock()

    async def scenario(a, b, expires) -> None:
        assert await a.lease("index:hr", "a", 30) and await a.lease("index:hr", "a", 30)  # renewing is taking again
        assert not await b.lease("index:hr", "b", 30)
        assert await b.lease("index:other", "b", 30)  # one lease per name
        await b.release("index:hr", "b")  # not its lease: nothing happens
        assert not await b.lease("index:hr", "b", 30)
        await a.release("index:hr", "a")
        assert await b.lease("index:hr", "b", 0.2)
        await expires()
        assert await a.lease("index:hr", "a", 30)  # b died holding it: it expired

    if kind == "sqlite":
        a, b = SQLiteStore(tmp_path / "g.db", clock), SQLiteStore(tmp_path / "g.db", clock)

        async def advance() -> None:
            clock.now += 1
        asyncio.run(scenario(a, b, advance))
        return
    process, url = redis_server(tmp_path)
    with process:
        async def run() -> None:
            a, b = RedisStore(url), RedisStore(url)

            async def expired() -> None:
                while await b.redis.exists(f"{b.p}lease:index:hr"):  # Redis expires it on its own clock
                    await asyncio.sleep(0.02)
            try:
                await scenario(a, b, expired)
            finally:
                await a.close()
                await b.close()
        asyncio.run(run())


def index_add(source: str, folder: Path, config: Path, log: Path, *store: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "pagedserve.cli", "gateway", "index", "add", source, str(folder),
               "--config", str(config), *store]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log.open("wb"), text=True)


def on_store(spec: str, method: str, *args):
    """One store call from this process, as another gateway process would make it."""
    async def call():
        store = RedisStore(spec) if spec.startswith("redis://") else SQLiteStore(spec)
        try:
            return await getattr(store, method)(*args)
        finally:
            await store.close()
    return asyncio.run(call())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sqlite", "redis"])
def test_concurrent_adds_of_one_folder_embed_once_and_bump_once(kind, tmp_path):
    """Two `index add` processes at once, held at the lease until both are there: one indexes, the other finds
    everything unchanged. A third with nothing changed bumps nothing either."""
    folder = tmp_path / "hr"
    shutil.copytree(HR, folder)
    config = tmp_path / "gw.yaml"
    config.write_text(json.dumps({"data_dir": str(tmp_path / "data"), "providers": {
        "p": {"base_url": "http://127.0.0.1:9/v1", "models": {"m": "m"}}}, "routes": {"r": {"small": ["p/m"]}}}))
    with contextlib.ExitStack() as stack:
        spec, store_args = str(tmp_path / "data" / "gateway.db"), []
        if kind == "redis":
            process, spec = redis_server(tmp_path)
            stack.enter_context(process)
            store_args = ["--store", spec]
        assert on_store(spec, "lease", "index:hr-policy", "test", 600)  # both adds will find it taken
        logs = [tmp_path / "add-1.log", tmp_path / "add-2.log"]
        adds = [index_add("hr-policy", folder, config, log, *store_args) for log in logs]
        for add in adds:
            stack.callback(add.kill)
        wait_for(lambda: all("waiting for the lease on index:hr-policy" in p.read_text() for p in logs), 120,
                 "both adds to wait for the lease")
        on_store(spec, "release", "index:hr-policy", "test")
        outputs = [add.communicate(timeout=300)[0] for add in adds]
        assert [add.returncode for add in adds] == [0, 0], [log.read_text()[-2000:] for log in logs]
        first, second = sorted(map(json.loads, outputs), key=lambda r: r["chunks_embedded"], reverse=True)
        assert first["version"] == second["version"] == "1"
        assert len(first["added"]) == 4 and first["chunks_embedded"] > 4
        assert second["added"] == [] and second["unchanged"] == 4 and second["chunks_embedded"] == 0
        third = index_add("hr-policy", folder, config, tmp_path / "add-3.log", *store_args)
        assert json.loads(third.communicate(timeout=300)[0])["version"] == "1"


@pytest.mark.slow
def test_planted_links_never_reach_a_routes_prompt(hostile, tmp_path):
    """End to end: the CLI indexes the planted folder, a real gateway answers from it, and what the provider is
    sent holds the HR text but nothing of /etc/passwd or /proc; a re-add prunes a link indexed before."""
    stub, stub_url = stub_provider("index-stub", tmp_path)
    config = {"providers": {"stub": {"base_url": stub_url + "/v1", "models": {"small": {"name": "stub"}}}},
              "routes": {"hr-rag": {"small": ["stub/small"], "retrieval": {"source": "hr-policy", "k": 5,
                                                                              "min_score": None}}}}
    process, url = gateway("index-gw", config, tmp_path, ADMIN)
    with contextlib.ExitStack() as stack:
        start_all(stack, stub, process)
        path, admin = str(tmp_path / "index-gw.yaml"), {"authorization": f"Bearer {ADMIN}"}
        # What an index add before the fix took from the link: the re-add of the folder must prune it.
        old = {"documents": [{"name": "hr/passwd.txt", "content": PASSWD}]}
        assert httpx.post(url + "/admin/index/hr-policy/documents", json=old, headers=admin, timeout=60).status_code == 200
        add = subprocess.run([sys.executable, "-m", "pagedserve.cli", "gateway", "index", "add", "hr-policy",
                              str(hostile), "--config", path], check=False, capture_output=True, text=True,
                             timeout=300)
        assert add.returncode == 0, add.stderr
        assert "skipped" in add.stderr and "passwd.txt: a symbolic link" in add.stderr
        assert json.loads(add.stdout)["removed"] == ["hr/passwd.txt"]
        documents = httpx.get(url + "/admin/index/hr-policy", headers=admin, timeout=10).json()["documents"]
        assert sorted(documents) == ["hr/expenses.md", "hr/holidays.txt", "hr/leave/germany.md", "hr/remote-work.html"]
        key = httpx.post(url + "/admin/keys", json={"user": "ivy"}, headers=admin, timeout=10).json()["key"]
        for question in ("What is root's login shell in passwd?", "What environment variables are set?"):
            response = httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {key}"}, timeout=60,
                                  json={"model": "hr-rag", "messages": [{"role": "user", "content": question}]})
            assert response.status_code == 200, response.text
            sent = json.dumps(stub_state(stub_url)["last_body"])
            assert "hr/" in sent and PASSWD.split(":")[0] + ":x:" not in sent and "PATH=" not in sent
