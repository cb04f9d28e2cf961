"""A real `pagedserve serve` subprocess on a free loopback port, for tests that drive it over HTTP."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.polling import wait_for


class ServerProcess:
    """Starts the server with `args`, waits until /health answers 200, and drains its log."""

    def __init__(self, args: list[str], startup_timeout: float = 180.0, log_path: Path | None = None) -> None:
        cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--port", "0", "--disable-access-log", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.log: list[str] = []
        self._drain: subprocess.Popen | None = None
        try:
            self.url = self._read_url(time.monotonic() + startup_timeout)
            self.banner = "".join(self.proc.stdout.readline() for _ in range(3))
            wait_for(self._healthy, startup_timeout, "the server to become healthy", interval=0.2)
        except BaseException:
            self.stop()
            raise
        # Drain the log (into log_path, after what was read so far) so the pipe never fills and blocks the server.
        if log_path is None:
            self._drain = subprocess.Popen(["cat"], stdin=self.proc.stdout, stdout=subprocess.DEVNULL)
            return
        log_path.write_text("".join(self.log) + self.banner)
        with log_path.open("a") as sink:
            self._drain = subprocess.Popen(["cat"], stdin=self.proc.stdout, stdout=sink)

    def _read_url(self, deadline: float) -> str:
        while True:
            line = self.proc.stdout.readline()
            self.log.append(line)
            assert line or self.proc.poll() is None, "server exited:\n" + "".join(self.log)
            assert time.monotonic() < deadline, "no URL printed:\n" + "".join(self.log)
            if m := re.search(r"serving \S+ at (http://127\.0\.0\.1:\d+)", line):
                return m.group(1)

    def _healthy(self) -> bool:
        assert self.proc.poll() is None, "server exited during start-up"
        try:  # the socket is bound before the app starts
            return httpx.get(f"{self.url}/health", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self._drain is not None:
            self._drain.wait(10)
