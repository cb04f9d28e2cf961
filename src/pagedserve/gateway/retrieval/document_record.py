"""What the store keeps per indexed document: its chunks and their vectors, as one JSON record. Any gateway
instance rebuilds its in-memory index from these records without parsing or embedding anything again."""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import numpy as np

from pagedserve.gateway.retrieval.chunking import Chunk


@dataclass(slots=True)
class DocumentRecord:
    name: str
    title: str
    kind: str
    content_hash: str
    chunks: list[Chunk]
    vectors: np.ndarray  # [len(chunks), dim] float32, unit length

    def to_json(self) -> str:
        chunks = [{"heading": c.heading, "start": c.start, "end": c.end, "text": c.text, "hash": c.content_hash}
                  for c in self.chunks]
        vectors = base64.b64encode(np.ascontiguousarray(self.vectors, dtype=np.float32).tobytes()).decode()
        return json.dumps({"title": self.title, "kind": self.kind, "content_hash": self.content_hash,
                           "dim": int(self.vectors.shape[1]) if self.vectors.ndim == 2 else 0,
                           "chunks": chunks, "vectors": vectors})

    @classmethod
    def from_json(cls, name: str, record: str) -> DocumentRecord:
        data = json.loads(record)
        chunks = [Chunk(doc=name, heading=c["heading"], start=c["start"], end=c["end"], text=c["text"],
                        content_hash=c["hash"]) for c in data["chunks"]]
        vectors = np.frombuffer(base64.b64decode(data["vectors"]), dtype=np.float32)
        return cls(name, data["title"], data["kind"], data["content_hash"], chunks,
                   vectors.reshape(len(chunks), data["dim"]) if chunks else np.zeros((0, data["dim"]), np.float32))
