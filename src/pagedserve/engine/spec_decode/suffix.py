"""Suffix decoding (Snowflake's Arctic Inference, SuffixDecoding): proposals from suffix trees over this
request's prompt and output and over the outputs of recent requests, as long as the match makes them likely.

A SuffixTrie holds every substring of its sequences up to `depth` tokens, each node counting the occurrences
of the path to it (a suffix tree truncated at depth: O(depth) work per appended token, no rebuilds). The
proposal finds the longest suffix of the request (at most max_pattern tokens) present in a trie, then follows
the most frequent child while the product of the children's shares stays at or above min_probability: a
context that always continued one way gives a long proposal, a branching one a short one or none.

Each request has its own trie (prompt + output so far); finished requests' outputs go into one shared trie,
bounded to the last max_cached_requests outputs (the oldest is subtracted back out when it leaves).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedserve.speculative_config import SpeculativeConfig


@dataclass(slots=True, eq=False)
class Node:
    count: int = 0
    children: dict[int, Node] = field(default_factory=dict)


class SuffixTrie:
    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.root = Node()
        self.open: deque[tuple[Node, int]] = deque()  # (node, length) of the suffixes still growing

    def append(self, token: int) -> None:
        """One more token of the (single, growing) sequence: every suffix shorter than depth grows by it."""
        self.open.append((self.root, 0))
        grown = deque()
        for node, length in self.open:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = Node()
            child.count += 1
            if length + 1 < self.depth:
                grown.append((child, length + 1))
        self.open = grown

    def add(self, tokens: list[int], sign: int = 1) -> None:
        """Every substring of a whole sequence (sign -1 takes it back out, pruning emptied nodes)."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start:start + self.depth]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = Node()
                child.count += sign
                if child.count <= 0:
                    del node.children[token]
                    break
                node = child

    def find(self, pattern: list[int]) -> Node | None:
        node = self.root
        for token in pattern:
            node = node.children.get(token)
            if node is None:
                return None
        return node


def continuation(node: Node, k: int, min_probability: float) -> tuple[list[int], float]:
    """The most frequent path below node, while its probability stays at or above min_probability."""
    out, probability = [], 1.0
    while len(out) < k and node.children:
        token, child = max(node.children.items(), key=lambda tc: tc[1].count)
        probability *= child.count / sum(c.count for c in node.children.values())
        if probability < min_probability:
            break
        out.append(token)
        node = child
    return out, probability


@dataclass(slots=True)
class SuffixState:
    trie: SuffixTrie
    length: int = 0  # tokens of the request already in its trie


class SuffixProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.depth = config.suffix_decoding_max_tree_depth
        self.max_pattern = self.depth - config.num_speculative_tokens
        self.min_probability = config.suffix_decoding_min_token_prob
        self.max_cached_requests = config.suffix_decoding_max_cached_requests
        self.shared = SuffixTrie(self.depth)
        self.cached: deque[list[int]] = deque()

    def propose(self, tokens: list[int], state: SuffixState, k: int) -> list[int]:
        for token in tokens[state.length:]:
            state.trie.append(token)
        state.length = len(tokens)
        for m in range(min(self.max_pattern, len(tokens)), 0, -1):
            pattern = tokens[len(tokens) - m:]
            best: tuple[list[int], float] = ([], 0.0)
            own = state.trie.find(pattern)
            if own is not None and own.count > 1:  # seen before this occurrence, which ends the sequence
                best = continuation(own, k, self.min_probability)
            shared = self.shared.find(pattern)
            if shared is not None:
                best = max(best, continuation(shared, k, self.min_probability), key=lambda p: (len(p[0]), p[1]))
            if best[0]:
                return best[0]
        return []

    def new_state(self) -> SuffixState:
        return SuffixState(SuffixTrie(self.depth))

    def finished(self, output_token_ids: list[int]) -> None:
        """A finished request's output joins the shared trie; the oldest leaves past max_cached_requests."""
        if not output_token_ids or not self.max_cached_requests:
            return
        self.shared.add(output_token_ids)
        self.cached.append(list(output_token_ids))
        if len(self.cached) > self.max_cached_requests:
            self.shared.add(self.cached.popleft(), sign=-1)
