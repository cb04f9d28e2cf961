"""Writing a knowledge source's documents into the store: parse and chunk them, embed only the chunks whose
text is new, and apply every change with one version bump (none when nothing changed). Files and folders on
disk are read by reading.py.

Re-adding a folder also removes the documents indexed from it earlier that are no longer there. Any unusable
document fails the whole add, with every error listed, and the index is left as it was. Adds and removes of
one source hold its lease in the store (leases.py) from reading its manifest to applying the change, so two
at once, from any processes sharing the store, run one after the other: the second sees the first's work
and neither re-embeds nor bumps the version for content already there.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass, field

import numpy as np

from pagedserve.gateway.leases import held
from pagedserve.gateway.retrieval.chunking import DocumentError, chunk_document, parse_document
from pagedserve.gateway.retrieval.document_record import DocumentRecord
from pagedserve.gateway.retrieval.hybrid_index import lexical_text

log = logging.getLogger(__name__)
MAX_DOCUMENT_BYTES = 16 << 20


class IndexInputError(ValueError):
    """Bad input to the index: the message lists every problem; nothing was changed."""


@dataclass(slots=True)
class IndexReport:
    source: str
    version: str
    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    chunks_embedded: int = 0
    chunks_reused: int = 0

    def public(self) -> dict:
        return {"source": self.source, "version": self.version, "added": self.added, "updated": self.updated,
                "unchanged": len(self.unchanged), "removed": self.removed, "chunks_embedded": self.chunks_embedded,
                "chunks_reused": self.chunks_reused}


class Indexer:
    def __init__(self, store, embedder, max_tokens: int = 200, overlap_tokens: int = 40):
        self.store = store
        self.embedder = embedder
        self.max_tokens = max_tokens
        self.overlap_tokens = overlap_tokens
        self._tokenizer = embedder.tokenizer.__class__.from_str(embedder.tokenizer.to_str())
        self._tokenizer.no_truncation()  # chunk sizes are measured whole, in the encoder's own tokens

    def count_tokens(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    async def add(self, source: str, files: dict[str, bytes], prune_prefixes: list[str] = ()) -> IndexReport:
        """Indexes the documents; those under a prune prefix that are not among them are removed."""
        async with held(self.store, f"index:{source}"):
            return await self._add(source, files, prune_prefixes)

    async def _add(self, source: str, files: dict[str, bytes], prune_prefixes: list[str]) -> IndexReport:
        manifest = await self.store.index_manifest(source)
        changed = {n: b for n, b in files.items() if manifest.get(n) != _hash(b)}
        old = await self.store.index_records(source, [n for n in changed if n in manifest])
        records, report = await asyncio.to_thread(self._prepare, changed, old)
        removed = sorted(n for n in manifest if n not in files and any(n.startswith(p) for p in prune_prefixes))
        report.source = source
        report.added = sorted(n for n in changed if n not in manifest)
        report.updated = sorted(n for n in changed if n in manifest)
        report.unchanged = sorted(n for n in files if n not in changed)
        report.removed = removed
        put = {r.name: (r.content_hash, r.to_json()) for r in records}
        report.version = await self.store.index_apply(source, put, removed)
        log.info("index %s v%s: %d added, %d updated, %d unchanged, %d removed; %d chunks embedded, %d reused",
                 source, report.version, len(report.added), len(report.updated), len(report.unchanged),
                 len(removed), report.chunks_embedded, report.chunks_reused)
        return report

    async def remove(self, source: str, names: list[str] | None = None) -> IndexReport:
        """Removes the named documents, or every document of the source when names is None."""
        async with held(self.store, f"index:{source}"):
            manifest = await self.store.index_manifest(source)
            if not manifest:
                raise LookupError(f"no indexed source {source!r}")
            unknown = [n for n in names or [] if n not in manifest]
            if unknown:
                raise LookupError(f"source {source!r} has no document {', '.join(map(repr, unknown))}")
            removed = sorted(manifest if names is None else set(names))
            version = await self.store.index_apply(source, {}, removed)
            return IndexReport(source, version, removed=removed)

    def _prepare(self, files: dict[str, bytes], old: dict[str, str]) -> tuple[list[DocumentRecord], IndexReport]:
        """Parses and chunks every document (all errors collected first), then embeds the new chunks only."""
        parsed, errors = [], []
        for name, data in sorted(files.items()):
            try:
                doc = parse_document(name, data)
                parsed.append((doc, chunk_document(doc, self.count_tokens, self.max_tokens, self.overlap_tokens)))
            except DocumentError as e:
                errors.append(str(e))
        if errors:
            raise IndexInputError("; ".join(errors))
        known: dict[str, np.ndarray] = {}
        for name, record in old.items():
            prior = DocumentRecord.from_json(name, record)
            known.update({c.content_hash: v for c, v in zip(prior.chunks, prior.vectors)})
        fresh = list({c.content_hash: c for _, chunks in parsed for c in chunks if c.content_hash not in known}.values())
        if fresh:
            vectors = self.embedder.embed_documents([lexical_text(c) for c in fresh])
            known.update({c.content_hash: v for c, v in zip(fresh, vectors)})
        report = IndexReport("", "", chunks_embedded=len(fresh),
                             chunks_reused=sum(len(chunks) for _, chunks in parsed) - len(fresh))
        records = [DocumentRecord(doc.name, doc.title, doc.kind, doc.content_hash, chunks,
                                  np.stack([known[c.content_hash] for c in chunks]) if chunks
                                  else np.zeros((0, self.embedder.dim), np.float32))
                   for doc, chunks in parsed]
        return records, report


def _hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()  # as Document.content_hash
