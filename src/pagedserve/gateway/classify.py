"""Difficulty classifier: logistic regression over the query embedding plus length and question-type
features, and a second one over those features alone, which guesses the tier before the embedding exists
(the gateway's speculative call goes to that guess). Both are trained on the labelled set in
data/difficulty.jsonl at build time (`pagedserve gateway train-classifier`) or the first time it is needed,
and cached under $PAGEDSERVE_CACHE (~/.cache/pagedserve) keyed by the training set's hash, so every gateway
on the machine shares one training run.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

TRAINING_SET = Path(__file__).parent / "data" / "difficulty.jsonl"
FEATURES_VERSION = "2"  # bump when features() changes, so cached weights are retrained

SIMPLE_OPENERS = ("what", "who", "when", "where", "which", "is", "are", "does", "do", "can", "how many",
                  "how much", "how long", "how do i", "define", "translate", "name", "list", "give me", "tell me",
                  "show", "spell", "convert", "say", "remind", "please", "share", "send")
HARD_OPENERS = ("explain", "why", "compare", "analy", "design", "write", "implement", "prove", "derive",
                "evaluate", "develop", "propose", "plan", "debug", "refactor", "critique", "assess", "devise",
                "construct", "compose", "model", "estimate", "calculate", "reason", "walk", "outline", "create",
                "reconcile", "solve", "summari", "draft", "rewrite", "given")
CODE = re.compile(r"[{}()\[\];=<>]|\bdef\b|\bselect\b|\bclass\b", re.IGNORECASE)


def features(text: str) -> np.ndarray:
    """Length and question-type features, scaled to about [0, 1]."""
    lower = text.strip().lower()
    words = lower.split()
    return np.array([
        np.log1p(len(words)) / 4,
        min(len(re.findall(r"[.?!;:]", lower)), 6) / 3,
        min(lower.count(","), 6) / 3,
        float(lower.startswith(SIMPLE_OPENERS)),
        float(lower.startswith(HARD_OPENERS)),
        float(bool(CODE.search(lower))),
        min(len(re.findall(r"\band\b|\bthen\b|\bwhile\b", lower)), 4) / 2,
    ], dtype=np.float32)


def load_examples(path: Path = TRAINING_SET) -> list[tuple[str, int]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(r["text"], int(r["label"] == "hard")) for r in rows]


@dataclass(slots=True)
class DifficultyClassifier:
    weights: np.ndarray  # over [embedding, features]
    bias: float
    lexical_weights: np.ndarray  # over features alone
    lexical_bias: float

    def score(self, text: str, vector: np.ndarray) -> float:
        """Probability that the request is hard."""
        x = np.concatenate([vector.ravel(), features(text)])
        return _sigmoid(float(x @ self.weights + self.bias))

    def guess(self, text: str) -> float:
        """The same probability from the text's features alone: microseconds, no embedding."""
        return _sigmoid(float(features(text) @ self.lexical_weights + self.lexical_bias))

    @classmethod
    def fit(cls, vectors: np.ndarray, texts: list[str], labels: list[int]) -> DifficultyClassifier:
        lexical = np.stack([features(t) for t in texts])
        w, b = _logistic_regression(np.hstack([vectors, lexical]), labels)
        lw, lb = _logistic_regression(lexical, labels)
        return cls(w, b, lw, lb)

    def save(self, path: Path) -> None:
        """Atomic: gateways starting side by side never read a half-written file."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
            np.savez(f, weights=self.weights, bias=np.array([self.bias]), lexical_weights=self.lexical_weights,
                     lexical_bias=np.array([self.lexical_bias]))
        os.replace(f.name, path)

    @classmethod
    def load(cls, path: Path) -> DifficultyClassifier:
        data = np.load(path)
        return cls(data["weights"], float(data["bias"][0]), data["lexical_weights"], float(data["lexical_bias"][0]))


def _sigmoid(z: float) -> float:
    return float(1 / (1 + np.exp(-z)))


def _logistic_regression(x: np.ndarray, labels: list[int], l2: float = 1e-3, steps: int = 2000,
                         lr: float = 0.5) -> tuple[np.ndarray, float]:
    """Full-batch gradient descent on the L2-regularised log loss (a few hundred rows: milliseconds)."""
    x = x.astype(np.float64)
    y = np.asarray(labels, dtype=np.float64)
    w, b = np.zeros(x.shape[1]), 0.0
    for _ in range(steps):
        p = 1 / (1 + np.exp(-(x @ w + b)))
        w -= lr * (x.T @ (p - y) / len(y) + l2 * w)
        b -= lr * float(np.mean(p - y))
    return w.astype(np.float32), b


def default_cache_dir() -> Path:
    return Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve"))


def weights_path(cache_dir: Path, embedder_name: str) -> Path:
    digest = hashlib.sha256(TRAINING_SET.read_bytes() + (FEATURES_VERSION + embedder_name).encode()).hexdigest()
    return cache_dir / f"difficulty-{digest[:12]}.npz"


def train(embedder, examples: list[tuple[str, int]]) -> DifficultyClassifier:
    texts = [t for t, _ in examples]
    return DifficultyClassifier.fit(embedder.embed(texts), texts, [y for _, y in examples])


def load_or_train(embedder, cache_dir: Path | None = None) -> DifficultyClassifier:
    path = weights_path(cache_dir or default_cache_dir(), embedder.model_name)
    if path.exists():
        return DifficultyClassifier.load(path)
    examples = load_examples()
    classifier = train(embedder, examples)
    classifier.save(path)
    log.info("trained the difficulty classifier on %d labelled requests -> %s", len(examples), path)
    return classifier


def cross_validate(embedder, examples: list[tuple[str, int]], folds: int = 5, seed: int = 0) -> tuple[float, float]:
    """Accuracy on held-out folds of the classifier and of its lexical guess: each request is scored by
    models that never saw it."""
    texts = [t for t, _ in examples]
    labels = np.array([y for _, y in examples])
    vectors = embedder.embed(texts)
    order = np.random.default_rng(seed).permutation(len(examples))
    correct = guessed = 0
    for held in np.array_split(order, folds):
        train_rows = np.setdiff1d(order, held)
        model = DifficultyClassifier.fit(vectors[train_rows], [texts[i] for i in train_rows], list(labels[train_rows]))
        correct += sum((model.score(texts[i], vectors[i]) >= 0.5) == bool(labels[i]) for i in held)
        guessed += sum((model.guess(texts[i]) >= 0.5) == bool(labels[i]) for i in held)
    return correct / len(examples), guessed / len(examples)
