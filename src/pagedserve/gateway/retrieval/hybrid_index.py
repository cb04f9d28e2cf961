"""One knowledge source's in-memory search index: BM25 over the chunks' words (bm25s, stemmed, stop words
dropped) and inner product over their MiniLM vectors (faiss), fused by reciprocal rank.

Dense search is exact (a flat scan) up to `exact_max` chunks and HNSW beyond, where a scan of 100k 384-d
vectors alone would take ~10 ms on one core. Every candidate's cosine is computed exactly from the stored
vectors, so `min_score` means the same whichever side found it.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import bm25s
import faiss
import numpy as np
import Stemmer

from pagedserve.gateway.retrieval.chunking import Chunk
from pagedserve.gateway.retrieval.document_record import DocumentRecord

RRF_K = 60  # the constant of Cormack et al.'s reciprocal rank fusion: damps the weight of the very top ranks
WORD = re.compile(r"(?u)\b\w\w+\b")  # bm25s's default token pattern
STEMMER = Stemmer.Stemmer("english")
STOPWORDS = frozenset(bm25s.stopwords.STOPWORDS_EN)
logging.getLogger("bm25s").setLevel(logging.INFO)  # bm25s sets DEBUG on itself: a line per index build


@dataclass(slots=True)
class Hit:
    chunk: Chunk
    score: float  # the fused score that ranks hits
    bm25: float  # 0 where no query word occurs in the chunk
    cosine: float
    lexical_rank: int | None  # 1-based; None: not among the lexical candidates
    dense_rank: int | None

    def public(self) -> dict:
        c = self.chunk
        return {"document": c.doc, "heading": c.heading, "chunk": c.content_hash[:16], "start": c.start,
                "end": c.end, "score": round(self.score, 5), "cosine": round(self.cosine, 4),
                "bm25": round(self.bm25, 3)}


def lexical_text(chunk: Chunk) -> str:
    """What both halves see of a chunk: its heading path carries words the text may only imply."""
    return f"{chunk.heading}\n{chunk.text}"


def words(text: str) -> list[str]:
    return STEMMER.stemWords([w for w in WORD.findall(text.lower()) if w not in STOPWORDS])


class HybridIndex:
    def __init__(self, records: list[DocumentRecord], dim: int, exact_max: int = 20_000, ef_search: int = 128):
        self.records = {r.name: r for r in records}
        self.chunks = [c for r in records for c in r.chunks]
        self.by_hash = {c.content_hash: c for c in self.chunks}
        self.vectors = (np.vstack([r.vectors for r in records if len(r.chunks)]) if self.chunks
                        else np.zeros((0, dim), np.float32))
        self.bm25 = None
        if self.chunks:
            self.bm25 = bm25s.BM25()
            self.bm25.index(bm25s.tokenize([lexical_text(c) for c in self.chunks], stopwords="en", stemmer=STEMMER,
                                           show_progress=False), show_progress=False)
        if len(self.chunks) <= exact_max:
            self.dense = faiss.IndexFlatIP(dim)
        else:
            self.dense = faiss.IndexHNSWFlat(dim, 32, faiss.METRIC_INNER_PRODUCT)
            self.dense.hnsw.efSearch = ef_search
        if self.chunks:
            self.dense.add(np.ascontiguousarray(self.vectors, dtype=np.float32))

    def __len__(self) -> int:
        return len(self.chunks)

    def lexical(self, query: str, n: int) -> tuple[np.ndarray, np.ndarray]:
        """The n best chunks by BM25 (ids, scores), best first; chunks without a query word left out."""
        ids = self.bm25.get_tokens_ids(words(query)) if self.bm25 is not None else []
        if not ids:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        scores = self.bm25.get_scores(ids)
        n = min(n, len(scores))
        top = np.argpartition(-scores, n - 1)[:n]
        top = top[np.argsort(-scores[top], kind="stable")]
        top = top[scores[top] > 0]
        return top, scores[top]

    def semantic(self, vector: np.ndarray, n: int) -> np.ndarray:
        """The n nearest chunks by inner product, best first."""
        if not self.chunks:
            return np.zeros(0, np.int64)
        _, found = self.dense.search(np.ascontiguousarray(vector, dtype=np.float32).reshape(1, -1), n)
        return found[0][found[0] >= 0]

    def search(self, query: str, vector: np.ndarray, k: int = 3, min_score: float | None = None,
               candidates: int = 50, mode: str = "hybrid") -> list[Hit]:
        """The k best chunks for the query (text for BM25, its unit vector for the dense side); mode 'lexical'
        or 'dense' ranks by one side alone (the benchmark's baselines). min_score: least cosine similarity."""
        n = max(candidates, k)
        lex_ids, lex_scores = self.lexical(query, n) if mode != "dense" else (np.zeros(0, np.int64), [])
        dense_ids = self.semantic(vector, n) if mode != "lexical" else np.zeros(0, np.int64)
        lex_rank = {int(i): r for r, i in enumerate(lex_ids, 1)}
        bm25 = {int(i): float(s) for i, s in zip(lex_ids, lex_scores)}
        dense_rank = {int(i): r for r, i in enumerate(dense_ids, 1)}
        ids = list(dict.fromkeys([*lex_rank, *dense_rank]))
        if not ids:
            return []
        cosines = self.vectors[ids] @ np.asarray(vector, dtype=np.float32)
        hits = []
        for i, cosine in zip(ids, cosines.tolist()):
            if min_score is not None and cosine < min_score:
                continue
            score = sum(1.0 / (RRF_K + r) for r in (lex_rank.get(i), dense_rank.get(i)) if r is not None)
            hits.append(Hit(self.chunks[i], score, bm25.get(i, 0.0), cosine, lex_rank.get(i), dense_rank.get(i)))
        hits.sort(key=lambda h: (-h.score, -h.cosine))
        return hits[:k]

    def missing(self, hashes: list[str]) -> list[str]:
        """Which of these chunk hashes the index no longer holds (their text changed or went away)."""
        return [h for h in hashes if h not in self.by_hash]
