"""A host-side n-gram trie over every token sequence the engine has seen. Pure Python.

The trie holds every n-gram of up to `max_depth` = max_match + num_draft tokens of the
inserted sequences, with a count and the time of its last occurrence per node. A lookup
takes the longest trailing n-gram (max_match .. min_match tokens) whose node has a
continuation, and follows the most frequent (then most recent) child num_draft times.

Sequences are fed incrementally through a `Cursor`: the nodes of the sequence's suffixes
of length 0 .. max_depth-1, so one new token costs max_depth child steps, and the nodes of
the trailing n-grams that a lookup needs are already at hand.
"""
from __future__ import annotations

import itertools
from typing import Sequence


class _Node:
    __slots__ = ("children", "count", "last")

    def __init__(self):
        self.children: dict[int, _Node] = {}
        self.count = 0
        self.last = 0


class Cursor:
    """Where one sequence stands in the trie."""

    __slots__ = ("suffixes", "length", "generation")

    def __init__(self, generation: int):
        # suffixes[n] = node of the sequence's last n tokens (suffixes[0] is the root).
        self.suffixes: list[_Node] = []
        self.length = 0  # tokens fed so far
        self.generation = generation


class NgramIndex:
    def __init__(self, max_depth: int, capacity: int = 4_000_000):
        if max_depth < 2:
            raise ValueError("max_depth must be >= 2 (one matched token plus one draft)")
        self.max_depth = max_depth
        # Bound on nodes; past it the trie starts over (cursors notice by generation and
        # re-feed only their recent tokens), which keeps memory bounded on long runs.
        self.capacity = capacity
        self._clock = itertools.count(1)
        self._reset()

    def _reset(self) -> None:
        self.root = _Node()
        self.num_nodes = 1
        self.generation = getattr(self, "generation", 0) + 1

    def cursor(self) -> Cursor:
        c = Cursor(self.generation)
        c.suffixes = [self.root]
        return c

    def is_stale(self, cursor: Cursor) -> bool:
        return cursor.generation != self.generation

    def maybe_reset(self) -> bool:
        """Start over when the trie is past its capacity; every cursor is stale then."""
        if self.num_nodes <= self.capacity:
            return False
        self._reset()
        return True

    def feed(self, cursor: Cursor, tokens: Sequence[int]) -> None:
        """Append tokens to the cursor's sequence, counting every n-gram they end."""
        assert not self.is_stale(cursor), "re-create the cursor after a reset"
        for tok in tokens:
            now = next(self._clock)
            new = [self.root]
            for node in cursor.suffixes[: self.max_depth]:
                child = node.children.get(tok)
                if child is None:
                    child = node.children[tok] = _Node()
                    self.num_nodes += 1
                child.count += 1
                child.last = now
                new.append(child)
            cursor.suffixes = new
            cursor.length += 1

    def lookup(self, cursor: Cursor, min_match: int, max_match: int, num_draft: int) -> list[int]:
        """Drafts continuing the cursor's sequence: up to num_draft tokens (maybe none)."""
        for n in range(min(max_match, len(cursor.suffixes) - 1), min_match - 1, -1):
            node = cursor.suffixes[n]
            out = []
            while node.children and len(out) < num_draft:
                tok, node = max(node.children.items(), key=lambda kv: (kv[1].count, kv[1].last))
                out.append(tok)
            if out:
                return out
        return []
