"""The gateway's fast query embedder (fp16-weight fbgemm kernels) against the fp32 encoder it is built from."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.embedding import Embedder
from pagedserve.embedding.fast import FastBertModel, fast_kernels_available
from pagedserve.gateway.classify import load_examples

# Not the classifier's training texts alone: greetings, numbers, code, non-ASCII, paraphrases, a text
# longer than the encoder's 256-token window, and the semantic-cache tests' near-miss questions.
TEST_SET = [
    "hi", "ok", "thanks", "?", "What's our parental leave policy in Germany?",
    "what is our parental leave policy in germany", "What's our sick leave policy in Germany?",
    "What's our parental leave policy in France?", "Is there a policy on leaving Germany for parents?",
    "Question 1: what is 1 minus 8?", "Question 12: what is 12 plus 19?", "How many vacation days do I get in 2024?",
    "How do I reset my password?", "What are the steps to change my password?",
    "Explain the difference between TCP and UDP, with examples of when to use each.",
    "def f(x): return x * 2  # what does this do?", "SELECT name FROM users WHERE id = 3;",
    "Ünïcödé and emoji 🚀 survive tokenization.", "Wie viele Urlaubstage habe ich in Deutschland?",
    "A quick brown fox jumps over the lazy dog near the river bank on a sunny afternoon. " * 20,
]


@pytest.fixture(scope="module")
def embedders() -> tuple[Embedder, Embedder]:
    torch.set_num_threads(1)
    exact = Embedder.load()
    return exact, exact.fast()


def test_fast_embedder_is_used_where_the_kernels_exist(embedders):
    exact, fast = embedders
    assert fast_kernels_available()  # x86 PyTorch builds ship fbgemm; the gateway's numbers assume it
    assert isinstance(fast.model, FastBertModel) and fast.fast() is fast
    assert (fast.model_name, fast.dim, fast.max_seq_length) == (exact.model_name, exact.dim, exact.max_seq_length)


def test_fast_embeddings_match_fp32_one_at_a_time_and_batched(embedders):
    exact, fast = embedders
    texts = TEST_SET + [t for t, _ in load_examples()][::3]
    reference = exact.embed(texts)
    alone = np.stack([fast.embed([t])[0] for t in texts])  # the gateway embeds one query at a time
    batched = fast.embed(texts)  # padded batches: the masked attention path
    for vectors in (alone, batched):
        assert vectors.dtype == np.float32 and vectors.shape == reference.shape
        np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
        cosines = (vectors * reference).sum(1)
        assert cosines.min() >= 0.9999, (cosines.min(), texts[int(cosines.argmin())])


def test_fast_embedder_keeps_the_similarity_order(embedders):
    _, fast = embedders
    a, para, other = fast.embed(["How do I reset my password?", "What are the steps to change my password?",
                                 "The weather in Lisbon is warm in July."])
    assert float(a @ para) > float(a @ other) + 0.2
