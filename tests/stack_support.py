"""Shared by the decode-stack tests: a stack wrapper that counts the steps it ran."""
from __future__ import annotations


class Counted:
    """The stack, counting the steps it ran."""

    def __init__(self, stack) -> None:
        self.stack, self.steps = stack, 0

    def forward(self, *args):
        self.steps += 1
        return self.stack.forward(*args)
