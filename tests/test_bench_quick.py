"""Every benchmark runs end to end at a small scale with its own flags, so no benchmark CLI can refuse
its own options or break unnoticed. What they measure is judged in docs/benchmarks.md, not here."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.bench.cli import BENCHMARKS


@pytest.mark.slow
def test_bench_all_quick(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "pagedserve.cli", "bench", "all", "--quick", "--docs", str(tmp_path)],
                         capture_output=True, text=True, timeout=1500, check=False)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert f"bench all: {len(BENCHMARKS)} passed, 0 failed" in out.stdout
    doc = (tmp_path / "benchmarks.md").read_text()
    for heading in ("## Offline throughput (engine)", "## Online serving", "## Overload control", "## Routing policies",
                    "## Gateway", "## Perplexity", "## Quantized weights (speed)", "## Structured outputs",
                    "## Multi-LoRA"):
        assert heading in doc


def test_every_benchmark_parses_its_quick_flags() -> None:
    import argparse
    import importlib

    from pagedserve.bench.cli import configure

    for name in BENCHMARKS:
        module = importlib.import_module(f"pagedserve.bench.{name}")
        args = configure(argparse.ArgumentParser(), name).parse_args([*module.QUICK, "--docs", "/tmp/x"])
        assert args.func is module.run_args


def test_corpus_is_the_same_whatever_was_imported() -> None:
    code = ("from pagedserve.bench.workloads import corpus_text; a = corpus_text(); "
            "import email.utils, json.decoder, http.server, logging.handlers, unittest.mock, concurrent.futures; "
            "print(a == corpus_text())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_serve_compares_kv_dtypes_in_its_own_section() -> None:
    import argparse

    from pagedserve.bench import serve
    from pagedserve.bench.cli import configure

    args = configure(argparse.ArgumentParser(), "serve").parse_args(
        ["--servers", "pagedserve,llama-server", "--kv-cache-dtypes", "bfloat16,int8", "--", "--kv-cache-memory", "32MiB"])
    assert serve.server_runs(args) == [("pagedserve", "bfloat16"), ("pagedserve", "int8"), ("llama-server", None)]
    assert args.pagedserve_args == ["--kv-cache-memory", "32MiB"]
    ok = serve.RequestResult(True, ttft=0.2, e2e=1.2, output_tokens=11, itls=[0.1] * 10)
    rows = [serve.summarize(name, 1.0, [ok] * 4, 4.0, 1.0, 0.1) for name in
            ("pagedserve (bfloat16 KV)", "pagedserve (int8 KV)", "llama-server")]
    rows[0].preemptions, rows[1].preemptions = 7, 0
    text = serve.report_markdown(rows, args, None)
    assert text.startswith(serve.KV_SECTION)
    assert "| 7 |" in text and "| 0 |" in text and text.count("| - |") == 1
    assert "pagedserve (int8 KV) / the other server(s)" in text
