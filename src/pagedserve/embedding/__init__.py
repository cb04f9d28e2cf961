"""Sentence embeddings with our own small BERT encoder (default: all-MiniLM-L6-v2)."""
from pagedserve.embedding.embedder import Embedder

__all__ = ["Embedder"]
