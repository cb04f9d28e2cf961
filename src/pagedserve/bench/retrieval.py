"""Retrieval benchmark: quality of BM25 alone, dense alone and hybrid (reciprocal rank fusion) on 214 labelled
questions over the Python documentation topics that ship with Python (pydoc_data.topics; no download), search
latency at 1k, 10k and 100k chunks, and indexing throughput.

Quality: recall@3 (a relevant chunk among the first 3) and MRR@10. A chunk is relevant when it contains the
question's evidence span, or comes from its topic and overlaps the span (bench/data/README.md).

Latency: one query at a time on one thread, the index search only (the query embedding is computed once per
request and shared with the semantic cache, so it is not retrieval's cost). Larger indexes are built from the
corpus' real chunks and vectors, repeated with fresh words and jittered vectors (search cost depends on the
number of chunks, their lengths and vocabulary, not on their meaning); embedding 100k chunks for real would
take longer than the rest of the run. Indexing throughput is measured on the real corpus: parse, chunk,
embed, store.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from importlib import resources
from pathlib import Path

import numpy as np

from pagedserve.bench.report import REPO, command_line, machine_line, publish

QUICK = ["--scales", "1000,5000", "--latency-queries", "40"]
MODES = ("lexical", "dense", "hybrid")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scales", default="1000,10000,100000", help="index sizes (chunks) for the latency rows")
    p.add_argument("--latency-queries", type=int, default=200, help="queries timed per index size and mode")
    p.add_argument("--k", type=int, default=3, help="chunks retrieved per question (recall@k)")
    p.add_argument("--docs", type=Path, default=REPO / "docs", help="where benchmarks.md is")
    p.add_argument("--no-write", action="store_true", help="print the tables only")


def questions() -> list[dict]:
    text = resources.files("pagedserve.bench").joinpath("data/retrieval_questions.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def corpus() -> dict[str, bytes]:
    import pydoc_data.topics

    return {f"topics/{name}.txt": text.encode() for name, text in sorted(pydoc_data.topics.topics.items())}


def relevant(chunk, question: dict, texts: dict[str, str]) -> bool:
    if question["evidence"] in chunk.text:
        return True
    if chunk.doc != f"topics/{question['topic']}.txt":
        return False
    start = texts[chunk.doc].find(question["evidence"])
    return start >= 0 and chunk.start < start + len(question["evidence"]) and start < chunk.end


async def build(embedder, files: dict[str, bytes]):
    """The real corpus indexed through the gateway's own path; (index, seconds, chunks)."""
    from pagedserve.gateway.retrieval.library import Library
    from pagedserve.gateway.store import SQLiteStore

    store = SQLiteStore(Path(tempfile.mkdtemp(prefix="pagedserve-retrieval-")) / "gateway.db")
    library = Library(store, embedder)
    start = time.perf_counter()
    report = await library.add("pydoc", files)
    seconds = time.perf_counter() - start
    index = await library.retriever.index("pydoc", report.version)
    await store.close()
    return index, seconds, len(index)


def quality(index, qs: list[dict], vectors: np.ndarray, texts: dict[str, str], k: int) -> dict[str, dict]:
    """Per retriever; 'floor' is hybrid with a route's default min_score (what a route gets out of the box)."""
    from pagedserve.gateway.gateway_config import RetrievalConfig

    floor = RetrievalConfig(source="").min_score
    out = {}
    for mode in (*MODES, "floor"):
        hits_at, reciprocal, by_style = [], [], {}
        for q, v in zip(qs, vectors):
            ranked = (index.search(q["question"], v, k=10, mode=mode) if mode != "floor"
                      else index.search(q["question"], v, k=10, min_score=floor))
            first = next((r for r, h in enumerate(ranked, 1) if relevant(h.chunk, q, texts)), None)
            hits_at.append(first is not None and first <= k)
            reciprocal.append(1 / first if first else 0.0)
            by_style.setdefault(q["style"], []).append(hits_at[-1])
        out[mode] = {"recall": float(np.mean(hits_at)), "mrr": float(np.mean(reciprocal)),
                     "styles": {s: float(np.mean(v)) for s, v in sorted(by_style.items())}}
    return out


def scaled(index, n: int, rng: np.random.Generator):
    """An index of n chunks grown from the real ones: each copy's words get a suffix (a vocabulary that grows
    as a real corpus' does) and its vector a small jitter."""
    from dataclasses import replace

    from pagedserve.gateway.retrieval.document_record import DocumentRecord
    from pagedserve.gateway.retrieval.hybrid_index import HybridIndex

    base, vectors = index.chunks, index.vectors
    chunks, rows = [], []
    for i in range(n):
        c = base[i % len(base)]
        copy = i // len(base)
        text = c.text if copy == 0 else " ".join(w + (f"x{copy}" if j % 3 == 0 else "")
                                                 for j, w in enumerate(c.text.split()))
        chunks.append(replace(c, doc=f"{c.doc}#{copy}", text=text, content_hash=f"{i}"))
        rows.append(vectors[i % len(base)])
    jittered = np.stack(rows) + rng.normal(0, 0.02, (n, vectors.shape[1])).astype(np.float32)
    jittered /= np.linalg.norm(jittered, axis=1, keepdims=True)
    record = DocumentRecord("scaled", "scaled", "text", "", chunks, jittered.astype(np.float32))
    start = time.perf_counter()
    big = HybridIndex([record], vectors.shape[1])
    return big, time.perf_counter() - start


def latency(index, qs: list[dict], vectors: np.ndarray, n: int, k: int) -> dict[str, list[float]]:
    out = {}
    for mode in MODES:
        times = []
        for i in range(n):
            q = qs[i % len(qs)]
            start = time.perf_counter()
            index.search(q["question"], vectors[i % len(qs)], k=k, mode=mode)
            times.append((time.perf_counter() - start) * 1000)
        out[mode] = times
    return out


def run_args(args: argparse.Namespace) -> int:
    import faiss
    import torch

    from pagedserve.embedding import Embedder

    torch.set_num_threads(2)  # indexing: both cores, as `gateway index add` would
    faiss.omp_set_num_threads(1)  # a query at a time, as the gateway serves them
    embedder = Embedder.load().fast()
    files, qs = corpus(), questions()
    texts = {n: b.decode() for n, b in files.items()}
    print(f"indexing {len(files)} documents ...", flush=True)
    index, index_s, n_chunks = asyncio.run(build(embedder, files))
    torch.set_num_threads(1)
    vectors = embedder.embed([q["question"] for q in qs])
    qual = quality(index, qs, vectors, texts, args.k)
    rng, rows = np.random.default_rng(0), []
    for n in [int(s) for s in args.scales.split(",")]:
        print(f"latency at {n} chunks ...", flush=True)
        big, build_s = scaled(index, n, rng)
        rows.append((n, build_s, type(big.dense).__name__, latency(big, qs, vectors, args.latency_queries, args.k)))
    body = render(args, qs, qual, index_s, n_chunks, rows)
    problems = [] if qual["hybrid"]["recall"] > 0 else ["hybrid retrieval found nothing: the index is broken"]
    return publish("Retrieval", body, problems, args.docs, not args.no_write)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def render(args, qs, qual, index_s, n_chunks, rows) -> str:
    styles = sorted(qual["hybrid"]["styles"])
    counts = {s: sum(q["style"] == s for q in qs) for s in styles}
    lines = [f"Command: `{command_line()}`", "", machine_line(), "",
             (f"Quality: {len(qs)} labelled questions over the {n_chunks} chunks of Python's documentation topics "
              f"(pydoc_data.topics, {len({q['topic'] for q in qs})} topics answer them), k={args.k}."), "",
             f"| retriever | recall@{args.k} | MRR@10 | " + " | ".join(f"recall@{args.k} {s} ({counts[s]})"
                                                              for s in styles) + " |",
             "|---|---|---|" + "---|" * len(styles)]
    from pagedserve.gateway.gateway_config import RetrievalConfig

    names = {"lexical": "BM25 alone (bm25s, stemmed)", "dense": "dense alone (MiniLM, faiss)",
             "hybrid": "hybrid: reciprocal rank fusion (ours)",
             "floor": f"hybrid with a route's default min_score {RetrievalConfig(source='').min_score}"}
    for mode in (*MODES, "floor"):
        r = qual[mode]
        lines.append(f"| {names[mode]} | {r['recall']:.3f} | {r['mrr']:.3f} | "
                     + " | ".join(f"{r['styles'][s]:.3f}" for s in styles) + " |")
    lines += ["", (f"Indexing: {n_chunks} chunks in {index_s:.1f} s = {n_chunks / index_s:.0f} chunks/s (parse, chunk, "
                   "embed in bf16 autocast where the CPU has it, store; 2 threads)."), "",
              "Search latency, one query at a time on one thread, the index search only (ms):", "",
              "| chunks | dense index | build s | hybrid p50 | hybrid p99 | BM25 p50 | dense p50 |",
              "|---|---|---|---|---|---|---|"]
    for n, build_s, kind, t in rows:
        lines.append(f"| {n:,} | {kind} | {build_s:.1f} | {pct(t['hybrid'], 50):.2f} | {pct(t['hybrid'], 99):.2f} | "
                     f"{pct(t['lexical'], 50):.2f} | {pct(t['dense'], 50):.2f} |")
    best_alone = max(qual["lexical"]["recall"], qual["dense"]["recall"])
    lines += ["", (f"- Hybrid vs the better side alone: recall@{args.k} {qual['hybrid']['recall']:.3f} vs "
                   f"{best_alone:.3f} ({qual['hybrid']['recall'] - best_alone:+.3f})."),
              ("- Indexes above 20,000 chunks search HNSW (M 32, efSearch 128) instead of an exact scan; the larger "
               "indexes are grown from the real chunks (module docstring)."),
              f"- Latency figures: {statistics.median([len(t['hybrid']) for *_, t in rows]):.0f} queries per row."]
    return "\n".join(lines)
