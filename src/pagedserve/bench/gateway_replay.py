"""The gateway benchmark's replayed stream: user phrasings of the same questions with a share of near misses
(negated, another country, another year: other answers) and source-version bumps, through the semantic cache
with the near-miss guard on and off, against an exact-match cache."""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

VARIANTS = [lambda q: q, lambda q: q.lower().rstrip("?"), lambda q: "Quick question: " + q,
            lambda q: "Hi! " + q, lambda q: q.rstrip("?") + ", please?", lambda q: q + " Thanks!"]
COUNTRIES = ["Germany", "France", "Spain", "Japan", "Brazil", "Canada"]
AUXILIARIES = ("is", "are", "can", "do", "does", "should", "will", "was", "were", "may", "must", "could")



def near_misses(question: str) -> list[tuple[str, str]]:
    """(kind, question) variants that read almost the same but have another answer."""
    body = question.rstrip("?. ")
    out = [("country", f"{body} in {country}?") for country in COUNTRIES[:2] if country not in question]
    out += [("year", f"{body} in {year}?") for year in (2024, 2025)]
    words = question.split()
    aux = next((i for i, w in enumerate(words) if w.lower() in AUXILIARIES), None)
    if aux is not None:
        out.append(("negation", " ".join(words[:aux + 1] + ["not"] + words[aux + 1:])))
    return out


def replay(args: argparse.Namespace, tmp: Path, embedder, questions: list[str]) -> list[dict]:
    """A Zipf-skewed stream of user phrasings of the same questions, a share of them near misses (another
    answer); the source changes every --bump-every. Each threshold runs with the near-miss guard on and off."""
    from pagedserve.gateway.semantic_cache import SemanticCache, normalise

    rng = np.random.default_rng(1)
    weights = 1 / np.arange(1, len(questions) + 1) ** 1.1
    stream = []  # (answer id, normalised text)
    for q in rng.choice(len(questions), args.stream, p=weights / weights.sum()):
        answer, text = str(q), questions[q]
        variants = near_misses(text)
        if rng.random() < args.near_miss and variants:
            kind, text = variants[rng.integers(len(variants))]
            answer = f"{q}:{kind}:{text}"
        stream.append((answer, normalise(VARIANTS[rng.integers(len(VARIANTS))](text))))
    texts = sorted({text for _, text in stream})
    vector_of = dict(zip(texts, embedder.embed(texts)))
    near = sum(":" in answer for answer, _ in stream) / len(stream)
    rows = []
    for threshold in args.thresholds:
        for guard in (True, False):
            cache = SemanticCache(tmp / f"replay-{threshold}-{guard}.db", embedder.dim)
            counts = replay_once(cache, stream, vector_of, threshold, guard, args.bump_every)
            rows.append({"threshold": threshold, "guard": guard, "near_miss": near,
                         **{k: c / len(stream) for k, c in counts.items()}})
    return rows


def replay_once(cache, stream: list[tuple[str, str]], vector_of: dict, threshold: float, guard: bool,
                bump_every: int) -> dict[str, int]:
    counts = dict.fromkeys(["hit", "false_hit", "stale", "served_stale", "exact_hit", "exact_false_hit",
                            "exact_stale"], 0)
    exact: dict[str, tuple[str, str]] = {}  # text -> (answer, version)
    for i, (answer, text) in enumerate(stream):
        current = {"hr-policy": str(1 + i // bump_every)}
        result = cache.lookup("scope", vector_of[text], threshold, current, None, text if guard else None)
        if result.result == "hit":
            counts["hit"] += 1
            counts["false_hit"] += result.entry.response["answer"] != answer
            counts["served_stale"] += result.entry.sources != current
        else:
            counts["stale"] += result.result == "stale"
            cache.put("scope", text, vector_of[text], {"answer": answer}, current, 86400, None, "stop", 1)
        seen = exact.get(text)
        if seen is not None and seen[1] == current["hr-policy"]:
            counts["exact_hit"] += 1
            counts["exact_false_hit"] += seen[0] != answer
        else:
            counts["exact_stale"] += seen is not None
            exact[text] = (answer, current["hr-policy"])
    return counts
