"""Tool calling: which tools a request offers and how it must use them (ToolPlan), the prompt turns that
carry tools, past calls and results, and the split of output into content and calls, whole or streamed.
The model family's format (Hermes tags, Llama 3 JSON) is a ToolParser from tool_parsers.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from pagedserve.engine.structured_output import GrammarLimits
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

# A parameters schema sits two levels down in the call grammar's schema ($defs, then its own name).
MAX_PARAMETERS_DEPTH = GrammarLimits().max_schema_depth - 2


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
        key, defs, one_of = self.parser.args_key, {}, []
        for i, t in enumerate(self.tools):
            if self.named and t.function.name != self.choice:
                continue
            defs.update(_hoisted(t.function.parameters or {"type": "object"}, f"tool{i}"))
            one_of.append({"type": "object", "additionalProperties": False, "required": ["name", key],
                           "properties": {"name": {"const": t.function.name}, key: {"$ref": f"#/$defs/tool{i}"}}})
        call_json = json.dumps({"x-guidance": COMPACT_JSON, "anyOf": one_of, "$defs": defs})
        return GuidedDecodingParams(grammar=self.parser.grammar(call_json, self.parallel and not self.named))

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return self.parser.parse(text, self.names, self.parallel)


def _hoisted(parameters: dict, name: str) -> dict:
    """A parameters schema as `$defs` of the call grammar's schema: itself under `name`, its own `$defs` (or
    `definitions`) beside it as `name.x`, its references rewritten to follow (`#/$defs/x/...` to `name.x`, any
    other `#...` into `name`), so pydantic-made schemas resolve. _check_parameters() has bounded its depth."""
    own = {k: v for kind in ("definitions", "$defs") for k, v in parameters.get(kind, {}).items()}

    def moved(ref: str) -> str:
        if ref != "#" and not ref.startswith("#/"):
            return ref  # not a pointer into this document
        parts = ref[2:].split("/", 2)
        if len(parts) > 1 and parts[0] in ("$defs", "definitions") and _unescape(parts[1]) in own:
            return "/".join([f"#/$defs/{name}.{parts[1]}", *parts[2:]])
        return f"#/$defs/{name}{ref[1:]}"

    def rewrite(node):
        if isinstance(node, dict):
            return {k: moved(v) if k == "$ref" and isinstance(v, str) else rewrite(v) for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    root = {k: v for k, v in parameters.items() if k not in ("$defs", "definitions")}
    return {name: rewrite(root), **{f"{name}.{k}": rewrite(v) for k, v in own.items()}}


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")  # JSON pointer escapes (RFC 6901)


def _check_parameters(tools: list[ChatTool]) -> None:
    """What the server itself walks in a parameters schema (to render and hoist it) has the shape it needs:
    bounded nesting, and `$defs`/`definitions` that are objects. The rest is the grammar engine's to judge."""
    for i, t in enumerate(tools):
        parameters, field_name = t.function.parameters, f"tools.{i}.function.parameters"
        if parameters is None:
            continue
        if _json_depth(parameters) > MAX_PARAMETERS_DEPTH:
            raise APIError(400, f"{field_name} nests deeper than {MAX_PARAMETERS_DEPTH} levels", field_name)
        for kind in ("$defs", "definitions"):
            if not isinstance(parameters.get(kind, {}), dict):
                raise APIError(400, f"{field_name}.{kind} must be an object of schemas", f"{field_name}.{kind}")


def _json_depth(value: object) -> int:
    """Nesting of objects and arrays, found without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, depth)
            stack += [(v, depth + 1) for v in (node.values() if isinstance(node, dict) else node)]
    return deepest


def tool_plan(req: ChatCompletionRequest, parser: ToolParser) -> ToolPlan | None:
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    names = {t.function.name for t in req.tools}
    if len(names) != len(req.tools):
        raise APIError(400, "tool function names must be unique", "tools")
    _check_parameters(req.tools)
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
