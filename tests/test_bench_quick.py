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


def test_serve_counts_closed_loop_refusals_and_compares_per_level() -> None:
    import argparse

    from pagedserve.bench import serve
    from pagedserve.bench.cli import configure

    args = configure(argparse.ArgumentParser(), "serve").parse_args(
        ["--rates", "", "--concurrency", "1,16", "--refused", "at-once"])
    ok = serve.RequestResult(True, ttft=0.5, e2e=2.0, output_tokens=128, itls=[0.01] * 127)
    refused = serve.RequestResult(False, error="HTTP 429", status=429, retry_after=3.0)
    gone = serve.RequestResult(False, error="timed out")
    levels = [serve.summarize_closed("pagedserve", 16, [ok] * 8 + [refused] * 2 + [gone], 10.0),
              serve.summarize_closed("vllm", 16, [ok] * 4, 10.0)]
    assert (levels[0].num_ok, levels[0].refused, levels[0].failed, levels[0].retry_after) == (8, 2, 1, [3.0, 3.0])
    assert levels[0].output_tok_s == 8 * 128 / 10.0
    text = serve.report_markdown([], args, None, levels)
    assert "| pagedserve | 16 | 8 | 2 | 1 |" in text and "| 3-3 (median 3) |" in text
    assert "Output tok/s, pagedserve / vllm: 16 users 2.00x (refused 2 vs 0)." in text
    assert "Highest offered rate" not in text and text.startswith(serve.CLOSED_SECTION)  # no Poisson rates


def test_throughput_skips_a_missing_peer_with_its_reason(tmp_path: Path) -> None:
    import argparse

    from pagedserve.bench import throughput
    from pagedserve.bench.cli import configure

    args = configure(argparse.ArgumentParser(), "throughput").parse_args(
        ["--peers", "vllm,llama.cpp", "--vllm-venv", str(tmp_path / "none"), "--llama-server", str(tmp_path / "no")])
    notes: list[str] = []
    model, offline = throughput.start_peers(args, [], notes, True)
    assert model is None and offline == {}
    assert notes[0].startswith("vLLM CPU skipped: no vLLM CPU in") and "setup_vllm_cpu.sh" in notes[0]
    assert notes[1].startswith("llama.cpp skipped: no llama-server at")


def test_checkpoints_suite_finds_quantized_folders_and_compares_with_rtn(tmp_path: Path) -> None:
    import json

    from pagedserve.bench.perplexity import Scored, against_rtn, checkpoint_folders

    for name, config in (("gptq", {"quantization_config": {}}), ("rtn", {"quantization_config": {}}), ("fp32", {})):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    assert [f.name for f in checkpoint_folders(str(tmp_path))] == ["gptq", "rtn"]
    assert [f.name for f in checkpoint_folders(f"{tmp_path / 'rtn'},{tmp_path / 'fp32'}")] == ["rtn"]
    scored = {"w4-gptq": Scored([-1.0], [0], 0, "int4 g64"), "w4-rtn": Scored([-2.0], [0], 0, "int4 g64"),
              "w8": Scored([-3.0], [0], 0, "int8")}
    assert against_rtn(scored) == ["w4-gptq is better than w4-rtn at the same scheme (int4 g64): 2.7183 vs 7.3891."]
