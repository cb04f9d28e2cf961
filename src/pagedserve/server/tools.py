"""Tool calling: which tools a request offers and how it must use them (ToolPlan), the prompt turns that
carry tools, past calls and results, and the split of output into content and calls, whole or streamed.
The model family's format (Hermes tags, Llama 3 JSON) is a ToolParser from tool_parsers.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from pagedserve.sampling_params import GuidedDecodingParams
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    DeltaFunctionCall,
    DeltaToolCall,
    ToolCall,
)
from pagedserve.server.tool_parsers import COMPACT_JSON, HermesParser, Llama3JsonParser, ToolParser


@dataclass(slots=True)
class ToolPlan:
    tools: list[ChatTool]
    choice: str  # none | auto | required | the name of the function that must be called
    parallel: bool = True
    names: set[str] = field(default_factory=set)
    parser: ToolParser = field(default_factory=HermesParser)

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    @property
    def named(self) -> bool:
        return self.choice not in ("none", "auto", "required")

    def constraint(self) -> GuidedDecodingParams | None:
        """`required` and a named function: the output is one call (or several, when parallel) whose
        arguments follow the function's parameter schema; `auto` and `none` leave the output free."""
        if self.choice in ("none", "auto"):
            return None
        chosen = [t for t in self.tools if not self.named or t.function.name == self.choice]
        key, defs, one_of = self.parser.args_key, {}, []
        for i, t in enumerate(chosen):
            parameters = _hoist_defs(t.function.parameters or {"type": "object"}, f"tool{i}_", defs)
            one_of.append({"type": "object", "additionalProperties": False, "required": ["name", key],
                           "properties": {"name": {"const": t.function.name}, key: parameters}})
        call_json = json.dumps({"x-guidance": COMPACT_JSON, "anyOf": one_of, **({"$defs": defs} if defs else {})})
        return GuidedDecodingParams(grammar=self.parser.grammar(call_json, self.parallel and not self.named))

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return self.parser.parse(text, self.names, self.parallel)


def _hoist_defs(schema: dict, prefix: str, defs: dict) -> dict:
    """A parameters schema nested under the call grammar's root: its `$defs` (or `definitions`) move to the
    root under prefixed names, and its `#/$defs/...` references follow, so pydantic-made schemas still resolve."""
    own = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    renamed = {f"#/{kind}/{name}": f"#/$defs/{prefix}{name}" for kind in ("$defs", "definitions") for name in own}

    def rewrite(node):
        if isinstance(node, dict):
            return {k: (renamed.get(v, v) if k == "$ref" and isinstance(v, str) else rewrite(v))
                    for k, v in node.items() if k not in ("$defs", "definitions") or node is not schema}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for name, sub in own.items():
        defs[f"{prefix}{name}"] = rewrite(sub)
    return rewrite(schema)


def tool_plan(req: ChatCompletionRequest, parser: ToolParser) -> ToolPlan | None:
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    names = {t.function.name for t in req.tools}
    if len(names) != len(req.tools):
        raise APIError(400, "tool function names must be unique", "tools")
    choice = req.tool_choice or "auto"
    if not isinstance(choice, str):
        choice = choice.function.name
        if choice not in names:
            raise APIError(400, f"tool_choice names function '{choice}', which is not in tools", "tool_choice")
    return ToolPlan(list(req.tools), choice, req.parallel_tool_calls, names, parser)


def render_turns(messages: list[ChatMessage], plan: ToolPlan | None, parser: ToolParser) -> list[dict]:
    """Chat turns for a template without tool syntax: tools in the system turn, calls and results as text."""
    turns: list[dict] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        text = m.text()
        if m.tool_calls:
            text = "\n".join([text] * bool(text) + [_call_text(c, parser) for c in m.tool_calls])
        if role == "tool":
            role, text = parser.result_turn(text)
            if turns and turns[-1]["role"] == role and role == "user" and turns[-1]["content"].endswith(">"):
                turns[-1]["content"] += "\n" + text  # results of parallel calls share one turn
                continue
        turns.append({"role": role, "content": text})
    if plan is not None and plan.choice != "none":
        listing = parser.instructions("\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in plan.tools))
        if turns and turns[0]["role"] == "system":
            turns[0]["content"] = f"{turns[0]['content']}\n\n{listing}"
        else:
            turns.insert(0, {"role": "system", "content": listing})
    return turns


def _call_text(call: ToolCall, parser: ToolParser) -> str:
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        arguments = call.function.arguments
    return parser.call_text(call.function.name, arguments)


class ToolCallStream:
    """Splits streamed text into content deltas and whole tool calls, sent as OpenAI's tool-call deltas.
    Hermes: text that may begin a call tag is held back, and a call goes out once its closing tag arrives.
    Llama 3 JSON: an output that opens like a call is held whole and parsed when it ends."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.pending = ""
        self.in_call = False
        self.calls: list[ToolCall] = []
        self.prose: bool | None = None  # Llama 3 JSON: decided on the output's first visible characters

    def feed(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        self.pending += text
        parser = self.plan.parser
        if isinstance(parser, Llama3JsonParser):
            if self.prose is None and self.pending.strip():
                self.prose = not parser.starts_call(self.pending)
            if self.prose:
                out, self.pending = self.pending, ""
                return out, []
            return "", []
        return self._feed_tags(parser)

    def _feed_tags(self, parser: HermesParser) -> tuple[str, list[DeltaToolCall]]:
        content, deltas = [], []
        while True:
            if not self.in_call:
                at = self.pending.find(parser.open)
                if at < 0:
                    keep = _partial_suffix(self.pending, parser.open)
                    content.append(self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                content.append(self.pending[:at])
                self.pending, self.in_call = self.pending[at:], True
            end = self.pending.find(parser.close)
            if end < 0:
                break
            block, self.pending = self.pending[:end + len(parser.close)], self.pending[end + len(parser.close):]
            self.in_call = False
            call = parser.block(block[len(parser.open):-len(parser.close)].strip(), self.plan.names)
            if call is None or (self.calls and not self.plan.parallel):
                content.append(block if call is None else "")
                continue
            deltas += self._deltas(call)
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        """Whatever is held back when the output ends: Llama 3 calls are parsed now; an unclosed Hermes call
        stays text."""
        rest, self.pending = self.pending, ""
        if isinstance(self.plan.parser, Llama3JsonParser) and rest:
            content, calls = self.plan.parse(rest)
            return content or "", [d for c in calls for d in self._deltas(c)]
        return rest, []

    def _deltas(self, call: ToolCall) -> list[DeltaToolCall]:
        index = len(self.calls)
        self.calls.append(call)
        return [DeltaToolCall(index=index, id=call.id, type="function",
                              function=DeltaFunctionCall(name=call.function.name, arguments="")),
                DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=call.function.arguments))]


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that is a beginning of tag."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
