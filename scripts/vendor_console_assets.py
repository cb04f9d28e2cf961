"""Vendors the web consoles' two JavaScript libraries from npm into the package, at pinned versions.

    python scripts/vendor_console_assets.py          # fetch (npm pack), verify, copy, write the manifest
    python scripts/vendor_console_assets.py --check  # only verify the committed files against the manifest

The consoles (gateway and router, at /ui) load nothing from a third party: htmx and uPlot ship in
src/pagedserve/cluster/ui/static/vendor/, committed, so no Node is needed at run time. This script is the only
place their versions are chosen. `npm pack` downloads the package tarball from the registry (nothing is
installed or run); its sha512 must equal the integrity pinned below, then the few files the consoles use and
each package's licence are copied, and manifest.json records versions, licences and the files' sha256.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

VENDOR = Path(__file__).resolve().parents[1] / "src" / "pagedserve" / "cluster" / "ui" / "static" / "vendor"


@dataclass(frozen=True, slots=True)
class Package:
    name: str  # on npm
    folder: str  # under static/vendor/
    version: str
    license: str
    integrity: str  # the registry's dist.integrity of that version
    files: tuple[tuple[str, str], ...]  # (path in the tarball, name in the folder)


PACKAGES = (
    Package("htmx.org", "htmx", "2.0.11", "0BSD",
            "sha512-Thx/WtpeOQqSrqBCw/A1cwGJGg4UrVa3+sW0GmrM3p4gJgO89ecH4qtbnyzDDWFvBTqjnIMCgELTNt636dtamA==",
            (("package/dist/htmx.min.js", "htmx.min.js"), ("package/LICENSE", "LICENSE"))),
    Package("uplot", "uplot", "1.6.32", "MIT",
            "sha512-KIMVnG68zvu5XXUbC4LQEPnhwOxBuLyW1AHtpm6IKTXImkbLgkMy+jabjLgSLMasNuGGzQm/ep3tOkyTxpiQIw==",
            (("package/dist/uPlot.iife.min.js", "uPlot.iife.min.js"), ("package/dist/uPlot.min.css", "uPlot.min.css"),
             ("package/LICENSE", "LICENSE"))),
)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch(package: Package, into: Path) -> dict:
    spec = f"{package.name}@{package.version}"
    out = subprocess.run(["npm", "pack", spec, "--json", "--pack-destination", str(into)], check=True,
                         capture_output=True, text=True).stdout
    tarball = into / json.loads(out)[0]["filename"]
    digest = "sha512-" + base64.b64encode(hashlib.sha512(tarball.read_bytes()).digest()).decode()
    if digest != package.integrity:
        raise SystemExit(f"{spec}: the tarball's integrity {digest} is not the pinned {package.integrity}")
    folder = VENDOR / package.folder
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    with tarfile.open(tarball) as archive:
        for member, name in package.files:  # named members only, written under names of our own
            data = archive.extractfile(archive.getmember(member)).read()
            (folder / name).write_bytes(data)
            files[name] = sha256(data)
    return {"name": package.name, "version": package.version, "license": package.license,
            "integrity": package.integrity, "files": files}


def check(manifest: dict) -> list[str]:
    """What differs between the committed files and the manifest (empty: all as vendored)."""
    problems = []
    pinned = {p.name: p for p in PACKAGES}
    for entry in manifest["packages"]:
        package = pinned.get(entry["name"])
        if package is None or package.version != entry["version"]:
            problems.append(f"{entry['name']} {entry['version']} is not what this script pins")
            continue
        for name, digest in entry["files"].items():
            path = VENDOR / package.folder / name
            if not path.is_file() or sha256(path.read_bytes()) != digest:
                problems.append(f"{path} does not match the manifest")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="verify the committed files only (no network)")
    args = parser.parse_args()
    manifest_path = VENDOR / "manifest.json"
    if not args.check:
        with tempfile.TemporaryDirectory() as tmp:
            manifest = {"packages": [fetch(p, Path(tmp)) for p in PACKAGES]}
        manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    problems = check(json.loads(manifest_path.read_text()))
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print("vendored: " + ", ".join(f"{p.name} {p.version} ({p.license})" for p in PACKAGES))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
