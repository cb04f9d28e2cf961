"""One user request as the engine tracks it: its n sequences with their detokenizers, and a request waiting
for what is prepared off the step thread (its grammar, its adapter)."""
from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.request import Request


@dataclass(slots=True, eq=False)
class RequestGroup:
    """One user request: its n sequences and their detokenizers."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Request] = field(default_factory=list)
    detoks: list[IncrementalDetokenizer] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.seqs[0].params.n and all(s.is_finished for s in self.seqs)


@dataclass(slots=True)
class Pending:
    """A request waiting for what is prepared off the step thread: (future, how to attach its result)."""
    group: RequestGroup
    req: Request
    waits: list[tuple[concurrent.futures.Future, Callable[[Request, Any], None]]]
