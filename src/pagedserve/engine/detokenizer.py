"""Incremental detokenization with stop strings.

Byte-level BPE can split one UTF-8 character over several tokens, so text is only released once
the decoded tail no longer ends in a replacement character. With stop strings, the last
(longest stop - 1) characters are held back until the request finishes, since they may yet turn
out to start a stop string; a stop string is cut from the text and never emitted.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.model.tokenizer import Tokenizer


@dataclass(slots=True)
class IncrementalDetokenizer:
    tokenizer: Tokenizer
    stop: list[str]
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    text: str = ""  # everything decoded so far (stop string cut off once found)
    token_ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0

    @property
    def hold_back(self) -> int:
        return max((len(s) for s in self.stop), default=1) - 1

    def add_token(self, token_id: int) -> str | None:
        """Append one token; returns the stop string if the text now contains one."""
        self.token_ids.append(token_id)
        prefix = self.tokenizer.decode(self.token_ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        full = self.tokenizer.decode(self.token_ids[self.prefix_offset:], self.skip_special_tokens)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return None  # an incomplete UTF-8 sequence, or nothing visible yet
        new_text = full[len(prefix):]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        start = max(0, len(self.text) - self.hold_back)
        self.text += new_text
        return self._find_stop(start)

    def _find_stop(self, start: int) -> str | None:
        for s in self.stop:
            pos = self.text.find(s, start)
            if pos != -1:
                self.text = self.text[:pos + len(s)] if self.include_stop_str_in_output else self.text[:pos]
                return s
        return None

    def output_text(self, finished: bool) -> str:
        """Text safe to show now: while running, the possible start of a stop string is held back."""
        if finished or not self.stop:
            return self.text
        return self.text[:max(0, len(self.text) - self.hold_back)]
