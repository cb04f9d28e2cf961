"""Retrieval for the gateway: documents, chunks, the hybrid index and its versions."""
