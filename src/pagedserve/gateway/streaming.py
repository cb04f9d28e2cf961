"""OpenAI response bodies the gateway builds itself: replays of cached answers (whole or as SSE chunks),
and the whole answer assembled from a relayed stream so it can be cached."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


DONE = "data: [DONE]\n\n"


def answer_text(body: dict, kind: str) -> str:
    choice = (body.get("choices") or [{}])[0]
    return (choice.get("message") or {}).get("content") or "" if kind == "chat" else choice.get("text") or ""


def replay(body: dict, kind: str) -> dict:
    """A cached answer with a fresh id and timestamp."""
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return {**body, "id": f"{prefix}-cache-{uuid.uuid4().hex}", "created": int(time.time())}


def replay_chunks(body: dict, kind: str, include_usage: bool) -> list[str]:
    """The same answer as a stream: one content chunk, one finishing chunk, usage if asked, [DONE]."""
    base = {"id": body["id"], "created": body["created"], "model": body.get("model")}
    choice = (body.get("choices") or [{}])[0]
    text, finish = answer_text(body, kind), choice.get("finish_reason")
    if kind == "chat":
        base["object"] = "chat.completion.chunk"
        chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": text},
                                        "finish_reason": None}]},
                  {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}]
    else:
        base["object"] = "text_completion"
        chunks = [{**base, "choices": [{"index": 0, "text": text, "finish_reason": None}]},
                  {**base, "choices": [{"index": 0, "text": "", "finish_reason": finish}]}]
    if "sources" in body:  # a retrieval route's answer names its chunks in the first event, as when relayed
        chunks[0]["sources"] = body["sources"]
    if include_usage:
        chunks.append({**base, "choices": [], "usage": body.get("usage")})
    return [sse(c) for c in chunks] + [DONE]


def assemble(kind: str, events: list[str]) -> StreamAssembler | None:
    """A whole relayed stream's answer; None when an event is an error or not shaped like OpenAI's."""
    assembled = StreamAssembler(kind)
    for data in events:
        try:
            event = json.loads(data)
            if not isinstance(event, dict) or "error" in event:
                return None
            assembled.add(event)
        except ValueError:
            return None
    return assembled


@dataclass(slots=True)
class StreamAssembler:
    """Collects a relayed stream's text, finish reason and usage."""
    kind: str
    parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict | None = None
    model: str | None = None
    chunks: int = 0
    tool_calls: dict[int, dict] = field(default_factory=dict)

    def add(self, event: dict) -> None:
        """Raises ValueError for an event not shaped like OpenAI's (the relay ends the stream with an error)."""
        self.model = event.get("model", self.model)
        if event.get("usage"):
            self.usage = event["usage"]
        choices = event.get("choices") or []
        if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
            raise ValueError(f"malformed choices in a stream event: {str(choices)[:100]}")
        for choice in choices:
            self.chunks += 1
            delta = choice.get("delta") if self.kind == "chat" else choice
            piece = delta.get("content" if self.kind == "chat" else "text") if isinstance(delta, dict) else None
            self.parts.append(piece if isinstance(piece, str) else "")
            if isinstance(delta, dict) and isinstance(delta.get("tool_calls"), list):
                self._add_calls(delta["tool_calls"])
            finish = choice.get("finish_reason")
            self.finish_reason = finish if isinstance(finish, str) else self.finish_reason

    def _add_calls(self, deltas: list) -> None:
        """OpenAI's tool-call deltas: the first of a call has its id and name, later ones add argument text."""
        for d in deltas:
            if not isinstance(d, dict) or not isinstance(d.get("index"), int):
                raise ValueError(f"malformed tool call delta in a stream event: {str(d)[:100]}")  # noqa: TRY004 (as add)
            call = self.tool_calls.setdefault(d["index"], {"id": None, "type": "function",
                                                          "function": {"name": None, "arguments": ""}})
            call["id"] = d.get("id") or call["id"]
            fn = d.get("function") if isinstance(d.get("function"), dict) else {}
            call["function"]["name"] = fn.get("name") or call["function"]["name"]
            if isinstance(fn.get("arguments"), str):
                call["function"]["arguments"] += fn["arguments"]

    def body(self) -> dict:
        text = "".join(self.parts)
        if self.kind == "chat":
            message: dict = {"role": "assistant", "content": (text or None) if self.tool_calls else text}
            if self.tool_calls:
                message["tool_calls"] = [self.tool_calls[i] for i in sorted(self.tool_calls)]
            choice = {"index": 0, "message": message, "finish_reason": self.finish_reason}
            obj = "chat.completion"
        else:
            choice, obj = {"index": 0, "text": text, "finish_reason": self.finish_reason}, "text_completion"
        return {"id": "", "object": obj, "created": 0, "model": self.model, "choices": [choice], "usage": self.usage}
