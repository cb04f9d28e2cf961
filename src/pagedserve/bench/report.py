"""Shared by every benchmark: a section of docs/benchmarks.md per benchmark, and a line about the machine."""
from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import sys
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DOC = REPO / "docs" / "benchmarks.md"


def machine_line() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else "?"
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"Machine: {cpu}, {os.cpu_count()} cores, CPU only, load average {load} at the end. "
            f"Date: {datetime.now():%Y-%m-%d %H:%M}. Commit: {commit()}.")


def commit() -> str:
    """The checkout's commit, marked +dirty when tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=False).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def command_line() -> str:
    """How this process was started, as `pagedserve ...` when it came through the CLI."""
    prog = "pagedserve" if sys.argv[0].endswith(("pagedserve", "cli.py")) else Path(sys.argv[0]).name
    return shlex.join([prog, *sys.argv[1:]])


def write_section(title: str, body: str, doc: Path = DOC) -> None:
    """Replaces the '## title' section of the document (other sections are left alone)."""
    replace_section(f"## {title}\n\n{body.strip()}\n", doc)


def replace_section(section: str, doc: Path = DOC) -> None:
    """section starts with its '## ' heading line; the section under that heading is replaced."""
    doc.parent.mkdir(parents=True, exist_ok=True)
    text = doc.read_text() if doc.is_file() else "# Benchmarks\n"
    heading = section.split("\n", 1)[0]
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    doc.write_text(text)


def publish(title: str, body: str, problems: list[str], docs: Path, write: bool = True) -> int:
    """Prints the section; writes it to docs/benchmarks.md only when the run checked out. The exit code."""
    print(body)
    if problems:
        print("the run did not check out; docs/benchmarks.md left alone:\n  " + "\n  ".join(problems), flush=True)
        return 1
    if write:
        write_section(title, body, docs / "benchmarks.md")
    return 0
