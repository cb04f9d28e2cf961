"""Tool calling: which tools a request offers and how it must use them (ToolPlan), the prompt turns that
carry tools, past calls and results, and the split of output into content and calls, whole or streamed.
The model family's format (Hermes tags, Llama 3 JSON) is a ToolParser from tool_parsers.py.
"""
from __future__ import annotations

import json
import re
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
    FunctionCall,
    ToolCall,
)
from pagedserve.server.tool_parsers import COMPACT_JSON, HermesParser, Llama3JsonParser, ToolParser, new_call

# A parameters schema sits two levels down in the call grammar's schema ($defs, then its own name).
MAX_PARAMETERS_DEPTH = GrammarLimits().max_schema_depth - 2


@dataclass(slots=True)
class ToolPlan:
    tools: list[ChatTool]
    choice: str  # none | auto | required | the name of the function that must be called
    parallel: bool = True
    names: set[str] = field(default_factory=set)
    parser: ToolParser = field(default_factory=HermesParser)
    legacy: bool = False  # offered as `functions`: the call comes back as message.function_call

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

    def parse(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of an output; cut: it ended at max_tokens, so a call it began is a call too, with
        the arguments written so far."""
        if not cut:
            return self.parser.parse(text, self.names, self.parallel)
        stream = ToolCallStream(self)
        head, _ = stream.feed(text)
        rest, _ = stream.finish()
        return ((head + rest).strip() or None, stream.calls) if stream.calls else (text, [])


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
    if req.functions is not None:
        return _legacy_plan(req, parser)
    if req.function_call is not None:
        raise APIError(400, "function_call needs functions", "function_call")
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", "tool_choice")
        return None
    choice = req.tool_choice or "auto"
    return _plan(list(req.tools), choice if isinstance(choice, str) else choice.function.name,
                 req.parallel_tool_calls, parser, "tools", "tool_choice")


def _legacy_plan(req: ChatCompletionRequest, parser: ToolParser) -> ToolPlan:
    """OpenAI's deprecated `functions` / `function_call`: the same tools, one call at most."""
    if req.tools is not None or req.tool_choice is not None:
        raise APIError(400, "send functions (deprecated) or tools, not both", "functions")
    choice = req.function_call or "auto"
    tools = [ChatTool(type="function", function=f) for f in req.functions]
    plan = _plan(tools, choice if isinstance(choice, str) else choice.name, False, parser, "functions",
                 "function_call")
    plan.legacy = True
    return plan


def _plan(tools: list[ChatTool], choice: str, parallel: bool, parser: ToolParser, field_name: str,
          choice_field: str) -> ToolPlan:
    names = {t.function.name for t in tools}
    if len(names) != len(tools):
        raise APIError(400, "tool function names must be unique", field_name)
    _check_parameters(tools)
    if choice not in ("none", "auto", "required") and choice not in names:
        raise APIError(400, f"{choice_field} names function '{choice}', which is not in {field_name}", choice_field)
    return ToolPlan(tools, choice, parallel, names, parser)


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
    """Splits streamed text into content deltas and tool-call deltas, as OpenAI streams them: a call's first
    delta carries its index, id, type and name with empty arguments, and the arguments follow as fragments of
    their JSON text as the model writes them, one delta per chunk.
    Hermes: text that may begin a call tag is held back; inside a tag, once `{"name": "...", "arguments": `
    has been read, the arguments object streams until it closes. A call whose head cannot be read that way
    (another key order, an unknown name) is held whole and parsed at its closing tag, as is a Llama 3 JSON
    output that opens like a call (parsed when it ends). A call cut off by the end of the output stays a call,
    with the arguments written so far; a call tag whose head was never read stays text."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.pending = ""
        self.call: _OpenCall | None = None  # the call being read (Hermes)
        self.space = ""  # trailing whitespace of the content sent so far, held back (Hermes)
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
            if self.call is None:
                at = self.pending.find(parser.open)
                if at < 0:
                    keep = _partial_suffix(self.pending, parser.open)
                    content.append(self._text(self.pending[:len(self.pending) - keep]))
                    self.pending = self.pending[len(self.pending) - keep:]
                    break
                content.append(self._text(self.pending[:at]))
                self.pending, self.call = self.pending[at + len(parser.open):], _OpenCall()
            call = self.call
            call.body, self.pending = call.body + self.pending, ""
            if call.header is None and not call.whole:
                deltas += self._open(call)
            if call.header is not None and call.args_end is None:
                deltas += self._stream_arguments(call)
            end = call.body.find(parser.close, call.args_end or 0)
            if end < 0 or (call.header is not None and call.args_end is None):
                break
            self.pending, self.call = call.body[end + len(parser.close):], None
            if call.header is not None:
                self._close(call, call.body[call.args_start:call.args_end])
                continue
            whole = parser.block(call.body[:end].strip(), self.plan.names)
            if whole is None or not self._may_call():
                if whole is None:  # not a call after all: its text, after the whitespace held before it
                    content.append(self._text(parser.open + call.body[:end] + parser.close))
                continue
            deltas += self._whole(whole)
        return "".join(content), deltas

    def _open(self, call: _OpenCall) -> list[DeltaToolCall]:
        """The call's first delta, once its head is read; or the decision to hold it whole."""
        head = _HEAD.match(call.body)
        if head is None:
            call.whole = len(call.body) > HEAD_MAX_CHARS
            return []
        try:
            name = json.loads(f'"{head.group(1)}"')
        except json.JSONDecodeError:
            name = None
        if name not in self.plan.names or not self._may_call():
            call.whole = True
            return []
        call.header, self.space = new_call(name, {}), ""
        call.args_start = call.scanned = head.end()
        return [DeltaToolCall(index=len(self.calls), id=call.header.id, type="function",
                              function=DeltaFunctionCall(name=name, arguments=""))]

    def _stream_arguments(self, call: _OpenCall) -> list[DeltaToolCall]:
        start = call.scanned
        ends = call.value.scan(call.body[start:])
        call.scanned = len(call.body) if ends is None else start + ends
        if ends is not None:
            call.args_end = call.scanned
        fragment = call.body[start:call.scanned]
        return [DeltaToolCall(index=len(self.calls), function=DeltaFunctionCall(arguments=fragment))] \
            if fragment else []

    def _close(self, call: _OpenCall, arguments: str) -> None:
        header = call.header
        self.calls.append(ToolCall(id=header.id, function=FunctionCall(name=header.function.name,
                                                                       arguments=arguments)))

    def _may_call(self) -> bool:
        return self.plan.parallel or not self.calls

    def _text(self, piece: str) -> str:
        """Content to send: trailing whitespace is held until text follows it, and dropped when a call does
        (as in the unstreamed answer, whose content is stripped)."""
        piece = self.space + piece
        body = piece.rstrip()
        self.space = piece[len(body):]
        return body

    def finish(self) -> tuple[str, list[DeltaToolCall]]:
        """Whatever is held back when the output ends: Llama 3 calls are parsed now; a Hermes call cut off
        after its head stays a call (its arguments as written so far), one cut off before stays text."""
        rest, self.pending = self.pending, ""
        if isinstance(self.plan.parser, Llama3JsonParser) and rest:
            content, calls = self.plan.parse(rest)
            return content or "", [d for c in calls for d in self._whole(c)]
        call, self.call = self.call, None
        if call is None:
            space, self.space = self.space, ""
            return ("" if self.calls and not rest.strip() else space + rest), []
        deltas = [] if call.header is not None else self._cut_head(call)
        if call.header is not None:
            self._close(call, call.body[call.args_start:call.args_end or len(call.body)])
            return "", deltas
        space, self.space = self.space, ""
        return space + self.plan.parser.open + call.body + rest, []

    def _cut_head(self, call: _OpenCall) -> list[DeltaToolCall]:
        """A call cut off before its head was read is still a call when its function is known: the named one
        (a forced call), or the one tool whose name begins with what was written; its arguments, none."""
        if not self._may_call():
            return []
        begun = _NAME_BEGUN.match(call.body)
        written = begun.group(1) if begun else ""
        names = [self.plan.choice] if self.plan.named else [n for n in self.plan.names if n.startswith(written)]
        if len(names) != 1:
            return []
        call.header, self.space = new_call(names[0], {}), ""
        call.args_start = call.args_end = len(call.body)
        return [DeltaToolCall(index=len(self.calls), id=call.header.id, type="function",
                              function=DeltaFunctionCall(name=names[0], arguments=""))]

    def _whole(self, call: ToolCall) -> list[DeltaToolCall]:
        """A call parsed whole: its head, then its arguments, as two deltas (two chunks)."""
        index, self.space = len(self.calls), ""
        self.calls.append(call)
        return [DeltaToolCall(index=index, id=call.id, type="function",
                              function=DeltaFunctionCall(name=call.function.name, arguments="")),
                DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=call.function.arguments))]


# The head of a Hermes call as the model writes it (and the call grammar forces): its name, then its arguments.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_NAME_BEGUN = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)')
HEAD_MAX_CHARS = 256  # a head not read by then (another key order, say) is held whole until the closing tag


@dataclass(slots=True)
class _ValueEnd:
    """Where a JSON object or array ends, read a part at a time (strings and escapes respected)."""
    depth: int = 0
    in_string: bool = False
    escaped: bool = False

    def scan(self, text: str) -> int | None:
        """Reads the next part of the value; the offset just past the value's end, when it ends in this part."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


@dataclass(slots=True)
class _OpenCall:
    """A Hermes call tag being read: its text so far, and how far its arguments have streamed."""
    body: str = ""
    header: ToolCall | None = None  # set once its head is read: the call streams
    whole: bool = False  # its head cannot be read as it streams: held until the closing tag
    args_start: int = 0
    scanned: int = 0
    args_end: int | None = None
    value: _ValueEnd = field(default_factory=_ValueEnd)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of text that is a beginning of tag."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
