"""A cheap guard against the semantic cache's near misses: questions whose embeddings are almost equal but
whose answers differ because one word does ("What is NOT the parental leave policy in Germany?" scores
0.984 against the question without NOT).

Two questions may share an answer only if they have the same polarity (count of negations), the same
numbers (digits and number words: years, amounts, ages), the same named entities from a small gazetteer
(countries, demonyms, states, cities, months, days, currencies: data/entities.txt) and the same
contrast words (before/after, more/less, maximum/minimum ...). Measured on data/near_miss_pairs.jsonl
(tests/test_gateway_guard.py) and on the replayed stream of `bench gateway`.
"""
from __future__ import annotations

import re
import unicodedata
from functools import cache
from pathlib import Path

DATA = Path(__file__).parent / "data"
NEGATIONS = {"not", "no", "never", "none", "nothing", "nobody", "nowhere", "neither", "nor", "without", "except",
             "excluding", "cannot", "non", "unless", "nein", "nicht", "kein", "keine", "pas", "jamais"}
CONTRAST = {"before", "after", "above", "below", "over", "under", "more", "less", "fewer", "most", "least",
            "maximum", "minimum", "max", "min", "higher", "lower", "highest", "lowest", "increase", "decrease",
            "earliest", "latest", "first", "last", "next", "previous", "buy", "sell", "import", "export",
            "inside", "outside", "forbidden"}
SMALL_NUMBERS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
                 "sixteen seventeen eighteen nineteen twenty")
NUMBER_WORDS = {w: str(i) for i, w in enumerate(SMALL_NUMBERS.split())} | {
    "thirty": "30", "forty": "40", "fifty": "50", "sixty": "60", "hundred": "100", "thousand": "1000",
    "million": "1e6", "billion": "1e9", "half": "0.5", "quarter": "0.25", "double": "x2", "twice": "x2",
    "triple": "x3"}
WORD = re.compile(r"\d+(?:[.,]\d+)*|[^\W\d_]+(?:'[^\W\d_]+)?|[$€£¥₹%]")


def words(text: str) -> list[str]:
    text = unicodedata.normalize("NFKC", text).lower().replace("’", "'")
    out = []
    for w in WORD.findall(text):
        if w.endswith("n't"):  # isn't, don't, can't: a negation glued to its verb
            out += [w[:-3], "not"]
        else:
            out.append(w.removesuffix("'s"))
    return out


@cache
def entities() -> tuple[frozenset[str], int]:
    """The gazetteer and its longest entry in words."""
    names = [line.strip() for line in (DATA / "entities.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    return frozenset(names), max(len(n.split()) for n in names)


def signature(text: str) -> tuple:
    """What must be equal for two questions to share an answer."""
    tokens = words(text)
    names, longest = entities()
    found, i = [], 0
    while i < len(tokens):  # longest match first: "south korea" is not "korea"
        for n in range(min(longest, len(tokens) - i), 0, -1):
            phrase = " ".join(tokens[i:i + n])
            if phrase in names:
                found.append(phrase)
                i += n
                break
        else:
            i += 1
    # Numbers in order ("1 minus 8" is not "8 minus 1"); entities as a set (clauses move in a paraphrase).
    numbers = tuple(NUMBER_WORDS.get(t, t.replace(",", "")) for t in tokens
                    if t[0].isdigit() or t in NUMBER_WORDS or t == "%")
    negations = sum(t in NEGATIONS for t in tokens)
    return negations, numbers, frozenset(found), frozenset(t for t in tokens if t in CONTRAST)


def compatible(a: str, b: str) -> bool:
    """Whether two near-identical questions may share an answer: same polarity, numbers and entities."""
    return signature(a) == signature(b)
