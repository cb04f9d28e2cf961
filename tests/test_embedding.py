"""The MiniLM embedder against transformers' BertModel with sentence-transformers' mean pooling."""
import numpy as np
import pytest
import torch

from pagedserve.embedding import Embedder
from pagedserve.embedding.embedder import default_model_dir

SENTENCES = [
    "The cat sits on the mat.",
    "A quick brown fox jumps over the lazy dog near the river bank on a sunny afternoon.",
    "Paged attention stores the KV cache in fixed-size blocks.",
    "hi",
    "Ünïcödé and emoji 🚀 survive tokenization.",
]


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder.load()


def reference_embeddings(texts: list[str]) -> np.ndarray:
    from transformers import AutoModel, AutoTokenizer

    folder = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=-1).numpy()


def test_matches_transformers_mean_pooling(embedder: Embedder):
    ours = embedder.embed(SENTENCES)
    ref = reference_embeddings(SENTENCES)
    assert ours.shape == (len(SENTENCES), 384) and ours.dtype == np.float32
    cosines = (ours * ref).sum(1)
    assert cosines.min() > 0.999, cosines


def test_normalised_and_batch_independent(embedder: Embedder):
    together = embedder.embed(SENTENCES)
    alone = np.stack([embedder.embed([s])[0] for s in SENTENCES])
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(together, alone, atol=1e-4)


def test_paraphrase_closer_than_unrelated(embedder: Embedder):
    a, para, other = embedder.embed([
        "How do I reset my password?",
        "What are the steps to change my password?",
        "The weather in Lisbon is warm in July.",
    ])
    assert float(a @ para) > float(a @ other) + 0.2


def test_small_batches_and_long_text(embedder: Embedder):
    small = Embedder(embedder.model, embedder.tokenizer, embedder.model_name, embedder.max_seq_length, batch_size=2)
    np.testing.assert_allclose(small.embed(SENTENCES), embedder.embed(SENTENCES), atol=1e-4)
    long_text = "word " * 2000
    assert embedder.count_tokens([long_text]) == [256]
    assert embedder.embed([long_text]).shape == (1, 384)
    assert embedder.embed([]).shape == (0, 384)


def test_count_tokens(embedder: Embedder):
    assert embedder.count_tokens(["hello world", ""]) == [4, 2]  # [CLS] hello world [SEP]


def test_missing_model_folder(tmp_path):
    with pytest.raises(FileNotFoundError):
        Embedder.load(tmp_path)
