"""pagedserve: an LLM serving stack with a paged KV cache engine."""
