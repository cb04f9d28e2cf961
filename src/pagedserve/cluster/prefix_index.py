"""A radix tree of the prompt prefixes each replica has served: the router's estimate of every
replica's prefix cache.

Keys are sequences: the prompt text (characters) or, for prompts given as token ids, a tuple of ids.
Every node remembers, per replica, when that replica last used it; a replica present at a node is
present at all its ancestors, so the deepest node holding a replica on a key's path gives that
replica's match length. Each replica has a size budget (mirroring its KV pool); over budget, its
least recently used leaves are dropped, as the replica's own LRU block eviction would.
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence


class _Node:
    __slots__ = ("children", "edge", "last_used", "parent")

    def __init__(self, edge: Sequence, parent: _Node | None) -> None:
        self.edge = edge
        self.children: dict[object, _Node] = {}
        self.parent = parent
        self.last_used: dict[str, int] = {}


def _common_length(a: Sequence, b: Sequence) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class PrefixIndex:
    def __init__(self, max_size_per_replica: int = 1_000_000) -> None:
        self.root = _Node((), None)
        self.max_size = max_size_per_replica
        self.budgets: dict[str, int] = {}  # replica -> its own budget, when known
        self.sizes: dict[str, int] = {}  # replica -> total edge length it holds
        self._clock = itertools.count()

    def match(self, key: Sequence) -> dict[str, int]:
        """Length of the longest indexed prefix of `key`, per replica that holds one."""
        matched: dict[str, int] = {}
        node, depth = self.root, 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                break
            n = _common_length(child.edge, key[depth:depth + len(child.edge)])
            depth += n
            for replica in child.last_used:
                matched[replica] = depth
            if n < len(child.edge):
                break
            node = child
        return matched

    def insert(self, key: Sequence, replica: str) -> None:
        """Records that `replica` now caches `key`, then trims the replica to its budget."""
        now = next(self._clock)
        node, depth = self.root, 0
        while depth < len(key):
            child = node.children.get(key[depth])
            if child is None:
                child = _Node(key[depth:], node)
                node.children[key[depth]] = child
            else:
                n = _common_length(child.edge, key[depth:depth + len(child.edge)])
                if n < len(child.edge):
                    child = self._split(child, n)
            if replica not in child.last_used:
                self.sizes[replica] = self.sizes.get(replica, 0) + len(child.edge)
            child.last_used[replica] = now
            depth += len(child.edge)
            node = child
        budget = self.budgets.get(replica, self.max_size)
        if self.sizes.get(replica, 0) > budget:
            self._evict(replica, int(budget * 0.9))

    def remove_replica(self, replica: str) -> None:
        """Forgets everything a replica held (it restarted or left)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if node.last_used.pop(replica, None) is not None:
                stack.extend(node.children.values())
                self._prune(node)
        self.sizes.pop(replica, None)

    def size(self, replica: str) -> int:
        return self.sizes.get(replica, 0)

    def _split(self, node: _Node, at: int) -> _Node:
        """Cuts node's edge at `at`; returns the new upper part, which keeps node's replicas."""
        upper = _Node(node.edge[:at], node.parent)
        upper.last_used = dict(node.last_used)
        node.parent.children[node.edge[0]] = upper
        node.edge = node.edge[at:]
        node.parent = upper
        upper.children[node.edge[0]] = node
        return upper

    def _is_leaf_of(self, node: _Node, replica: str) -> bool:
        return replica in node.last_used and not any(replica in c.last_used for c in node.children.values())

    def _evict(self, replica: str, target: int) -> None:
        heap = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            if replica in node.last_used:
                stack.extend(node.children.values())
                if self._is_leaf_of(node, replica):
                    heap.append((node.last_used[replica], id(node), node))
        heapq.heapify(heap)
        while heap and self.sizes[replica] > target:
            _, _, node = heapq.heappop(heap)
            del node.last_used[replica]
            self.sizes[replica] -= len(node.edge)
            parent = node.parent
            self._prune(node)
            if parent is not self.root and self._is_leaf_of(parent, replica):
                heapq.heappush(heap, (parent.last_used[replica], id(parent), parent))

    def _prune(self, node: _Node) -> None:
        while node is not self.root and not node.last_used and not node.children:
            del node.parent.children[node.edge[0]]
            node = node.parent
