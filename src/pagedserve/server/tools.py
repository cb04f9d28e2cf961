"""Tool calling in the Hermes format, for models whose chat template has no tool syntax of its own.

The tools go into the system turn as JSON signatures; the model calls one by writing
<tool_call>{"name": ..., "arguments": {...}}</tool_call>, which is parsed out of its output (and, for
tool_choice `required` or a named function, enforced by a grammar so that the call always parses).
Earlier calls and tool results are rendered back into the prompt in the same format.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from pagedserve.sampling_params import GuidedDecodingParams
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
CALL_RE = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.DOTALL)
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SYSTEM_TOOLS = (
    "You can call functions. Their signatures, one JSON object per line, are inside <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with a JSON object holding its name and arguments inside "
    "<tool_call></tool_call> tags, one block per call:\n"
    '<tool_call>\n{{"name": "function_name", "arguments": {{"argument": "value"}}}}\n</tool_call>'
)


@dataclass(slots=True)
class ToolPlan:
    tools: list[ChatTool]
    choice: str  # none | auto | required | the name of the function that must be called
    parallel: bool = True
    names: set[str] = field(default_factory=set)

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
        one_of = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                   "properties": {"name": {"const": t.function.name},
                                  "arguments": t.function.parameters or {"type": "object"}}} for t in chosen]
        call_json = json.dumps({"x-guidance": COMPACT_JSON, "anyOf": one_of})
        repeat = ' ("\\n" call)*' if self.parallel and not self.named else ""
        return GuidedDecodingParams(grammar=f'start: call{repeat}\n'
                                            f'call: "{CALL_OPEN}\\n" %json {call_json} "\\n{CALL_CLOSE}"')


def tool_plan(req: ChatCompletionRequest) -> ToolPlan | None:
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
    return ToolPlan(list(req.tools), choice, req.parallel_tool_calls, names)


def render_turns(messages: list[ChatMessage], plan: ToolPlan | None) -> list[dict]:
    """Chat turns for the template: tools in the system turn, calls and results as Hermes text."""
    turns: list[dict] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        text = m.text()
        if m.tool_calls:
            text = "\n".join([text] * bool(text) + [_call_text(c) for c in m.tool_calls])
        if role == "tool":
            role, text = "user", f"<tool_response>\n{text}\n</tool_response>"
            if turns and turns[-1]["role"] == "user" and turns[-1]["content"].endswith("</tool_response>"):
                turns[-1]["content"] += "\n" + text  # results of parallel calls share one turn
                continue
        turns.append({"role": role, "content": text})
    if plan is not None and plan.choice != "none":
        listing = SYSTEM_TOOLS.format(tools="\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in plan.tools))
        if turns and turns[0]["role"] == "system":
            turns[0]["content"] = f"{turns[0]['content']}\n\n{listing}"
        else:
            turns.insert(0, {"role": "system", "content": listing})
    return turns


def _call_text(call: ToolCall) -> str:
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        arguments = call.function.arguments
    return f"{CALL_OPEN}\n{json.dumps({'name': call.function.name, 'arguments': arguments})}\n{CALL_CLOSE}"


def parse_call(body: str, plan: ToolPlan) -> ToolCall | None:
    """A call block's JSON as a ToolCall, or None when it is not a call of a known function."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in plan.names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                    function=FunctionCall(name=obj["name"], arguments=json.dumps(arguments, ensure_ascii=False)))


def parse_output(text: str, plan: ToolPlan) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a finished output; blocks that do not parse stay in the content."""
    calls: list[ToolCall] = []
    content: list[str] = []
    at = 0
    for match in CALL_RE.finditer(text):
        call = parse_call(match.group(1), plan)
        if call is None:
            continue
        content.append(text[at:match.start()])
        at = match.end()
        if plan.parallel or not calls:  # without parallel calls, only the first is kept
            calls.append(call)
    content.append(text[at:])
    rest = "".join(content).strip()
    return (rest or None) if calls else text, calls


class ToolCallStream:
    """Splits streamed text into content deltas and whole tool calls: text that may begin a call tag is
    held back, and a call is sent (as OpenAI's tool-call deltas) once its closing tag arrives."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.pending = ""
        self.in_call = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[DeltaToolCall]]:
        self.pending += text
        content, deltas = [], []
        while True:
            if not self.in_call:
                at = self.pending.find(CALL_OPEN)
                if at < 0:
                    keep = _partial_suffix(self.pending, CALL_OPEN)
                    content.append(self.pending[:len(self.pending) - keep])
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                content.append(self.pending[:at])
                self.pending, self.in_call = self.pending[at:], True
            end = self.pending.find(CALL_CLOSE)
            if end < 0:
                break
            block, self.pending = self.pending[:end + len(CALL_CLOSE)], self.pending[end + len(CALL_CLOSE):]
            self.in_call = False
            call = parse_call(block[len(CALL_OPEN):-len(CALL_CLOSE)].strip(), self.plan)
            if call is None or (self.calls and not self.plan.parallel):
                content.append(block if call is None else "")
                continue
            deltas += self._deltas(call)
        return "".join(content), deltas

    def finish(self) -> str:
        """Whatever is held back when the output ends (an unclosed call stays text)."""
        rest, self.pending = self.pending, ""
        return rest

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
