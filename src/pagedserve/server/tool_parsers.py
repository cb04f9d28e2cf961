"""How a model family writes tool calls (vLLM's `--tool-call-parser`): the instructions that list the tools
when the chat template has no tool syntax of its own, how a past call and a tool result are written back,
the grammar that forces calls (tool_choice `required` or a named function), and how output text is split
into content and calls, whole or streamed.

  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block per call (Hermes, Qwen2.5,
               SmolLM2 and most ChatML models)
  llama3_json  {"name": ..., "parameters": {...}}, calls separated by "; ", optionally after <|python_tag|>
               (Llama 3.1 and later)
"""
from __future__ import annotations

import json
import re
import uuid

from pagedserve.server.protocol import FunctionCall, ToolCall

COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def new_call(name: str, arguments: dict) -> ToolCall:
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                    function=FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False)))


def read_call(obj: object, names: set[str], args_keys: tuple[str, ...]) -> ToolCall | None:
    """A decoded call object as a ToolCall, or None when it is not a call of a known function."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = next((obj[k] for k in args_keys if k in obj), {})
    return new_call(obj["name"], arguments) if isinstance(arguments, dict) else None


class HermesParser:
    name, args_key = "hermes", "arguments"
    open, close = "<tool_call>", "</tool_call>"

    def instructions(self, signatures: str) -> str:
        return ("You can call functions. Their signatures, one JSON object per line, are inside <tools></tools>:\n"
                f"<tools>\n{signatures}\n</tools>\n"
                "To call a function, answer with a JSON object holding its name and arguments inside "
                "<tool_call></tool_call> tags, one block per call:\n"
                '<tool_call>\n{"name": "function_name", "arguments": {"argument": "value"}}\n</tool_call>')

    def call_text(self, name: str, arguments: object) -> str:
        return f"{self.open}\n{json.dumps({'name': name, 'arguments': arguments})}\n{self.close}"

    def result_turn(self, text: str) -> tuple[str, str]:
        return "user", f"<tool_response>\n{text}\n</tool_response>"

    def grammar(self, call_json: str, repeat: bool) -> str:
        more = ' ("\\n" call)*' if repeat else ""
        return f'start: call{more}\ncall: "{self.open}\\n" %json {call_json} "\\n{self.close}"'

    def parse(self, text: str, names: set[str], parallel: bool) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished output; blocks that do not parse stay in the content."""
        calls, content, at = [], [], 0
        for match in re.finditer(re.escape(self.open) + r"\s*(.*?)\s*" + re.escape(self.close), text, re.DOTALL):
            call = self.block(match.group(1), names)
            if call is None:
                continue
            content.append(text[at:match.start()])
            at = match.end()
            if parallel or not calls:  # without parallel calls, only the first is kept
                calls.append(call)
        content.append(text[at:])
        rest = "".join(content).strip()
        return (rest or None) if calls else text, calls

    def block(self, body: str, names: set[str]) -> ToolCall | None:
        try:
            return read_call(json.loads(body), names, ("arguments", "parameters"))
        except json.JSONDecodeError:
            return None


class Llama3JsonParser:
    name, args_key = "llama3_json", "parameters"
    tag = "<|python_tag|>"

    def instructions(self, signatures: str) -> str:
        return ("You can call functions. Their signatures, one JSON object per line:\n"
                f"{signatures}\n"
                "To call a function, answer only with a JSON object of the form "
                '{"name": "function_name", "parameters": {"argument": "value"}}; separate several calls with "; ".')

    def call_text(self, name: str, arguments: object) -> str:
        return json.dumps({"name": name, "parameters": arguments})

    def result_turn(self, text: str) -> tuple[str, str]:
        return "ipython", text

    def grammar(self, call_json: str, repeat: bool) -> str:
        more = ' ("; " call)*' if repeat else ""
        return f"start: call{more}\ncall: %json {call_json}"

    def starts_call(self, text: str) -> bool:
        """Whether an output is calls rather than prose (decided on its first visible characters)."""
        stripped = text.lstrip()
        return stripped.startswith(("{", self.tag)) or self.tag.startswith(stripped)

    def parse(self, text: str, names: set[str], parallel: bool) -> tuple[str | None, list[ToolCall]]:
        """The whole output is calls, or it is content: a half-parsable output stays text."""
        body = text.strip().removeprefix(self.tag).strip()
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return text, []
            call = read_call(obj, names, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            at = end
            while at < len(body) and body[at] in "; \n\t":
                at += 1
        return (None, calls if parallel else calls[:1]) if calls else (text, [])


ToolParser = HermesParser | Llama3JsonParser
PARSERS: dict[str, type[HermesParser | Llama3JsonParser]] = {"hermes": HermesParser,
                                                                     "llama3_json": Llama3JsonParser}


def choose_parser(name: str, chat_template: str | None) -> ToolParser:
    """`auto`: Llama 3's format when the template speaks it (its python tag or ipython role), else Hermes."""
    if name == "auto":
        llama3 = chat_template is not None and ("<|python_tag|>" in chat_template or "ipython" in chat_template)
        name = "llama3_json" if llama3 else "hermes"
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser '{name}' (have: auto, {', '.join(PARSERS)})")
    return PARSERS[name]()
