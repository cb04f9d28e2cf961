"""Bodies of OpenAI's Responses API (POST /v1/responses and its stream events), as the official SDK's types in
openai/types/responses/ define them: what a request may carry (input items, function tools, text formats, and
the documented fields this server accepts without acting on them), the response object and its output items."""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, Discriminator, Field, Tag

from pagedserve.server.protocol import OrDefault, Seed, StrictModel, Text, ignored

# A pagedserve router sends each replica this tag (8 hex digits naming the replica); the replica writes it into
# the ids of the responses it makes, so that a later previous_response_id is routed back to it.
REPLICA_TAG_HEADER = "x-pagedserve-replica-tag"
REPLICA_TAG_PATTERN = r"[0-9a-f]{8}"
RESPONSE_ID_PATTERN = r"resp_[A-Za-z0-9_-]{1,128}"
ResponseId = Annotated[str, Field(pattern=f"^{RESPONSE_ID_PATTERN}$")]


def new_response_id(replica_tag: str | None) -> str:
    """resp_<32 hex>, or resp_<tag>_<32 hex> when a router names the replica."""
    return f"resp_{replica_tag}_{uuid.uuid4().hex}" if replica_tag else f"resp_{uuid.uuid4().hex}"


def replica_tag_of(response_id: str) -> str | None:
    parts = response_id.split("_")
    return parts[1] if len(parts) == 3 and parts[0] == "resp" and len(parts[1]) == 8 else None


def _valid_json_text(value: Any) -> Any:
    """Every string and key inside a free-form JSON value (a schema) is valid Unicode: such values are echoed
    back and stored, and no encoder takes a lone UTF-16 surrogate. Iterative: schemas may nest deeply."""
    stack = [(value, "")]
    while stack:
        node, path = stack.pop()
        texts = [node] if isinstance(node, str) else list(node) if isinstance(node, dict) else []
        for text in texts:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"text must be valid Unicode: a lone UTF-16 surrogate at '{path or '.'}'") from None
        if isinstance(node, dict):
            stack += [(v, f"{path}.{k}" if path else str(k)) for k, v in node.items()]
        elif isinstance(node, list):
            stack += [(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(node)]
    return value


JSONObject = Annotated[dict, AfterValidator(_valid_json_text)]
Status = Literal["in_progress", "completed", "incomplete"]


# ---- input items ----

class InputText(StrictModel):
    type: Literal["input_text"]
    text: Text
    prompt_cache_breakpoint: JSONObject | None = ignored("explicit prompt caching (prefix caching is automatic)")


class OutputText(StrictModel):
    """An earlier answer's text, sent back as input."""
    type: Literal["output_text"]
    text: Text
    annotations: list[JSONObject] | None = None
    logprobs: list[JSONObject] | None = None


class OutputRefusal(StrictModel):
    type: Literal["refusal"]
    refusal: Text


ContentPart = Annotated[InputText | OutputText | OutputRefusal, Field(discriminator="type")]


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | Annotated[list[ContentPart], Field(max_length=1024)]
    id: Text | None = None
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.refusal if isinstance(p, OutputRefusal) else p.text for p in self.content)


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: Text = Field(min_length=1, max_length=256)
    name: Text = Field(min_length=1, max_length=256)
    arguments: Text = Field(description="a JSON object, as a string")
    id: Text | None = None
    status: Status | None = None
    namespace: Text | None = None
    caller: JSONObject | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: Text = Field(min_length=1, max_length=256)
    output: Text | Annotated[list[InputText], Field(max_length=1024)]
    id: Text | None = None
    status: Status | None = None
    name: Text | None = None
    namespace: Text | None = None
    caller: JSONObject | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


def _item_type(value: Any) -> str | None:
    """An item's `type`; an easy input message may leave it out."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")], Discriminator(_item_type)]


# ---- tools and text formats ----

class FunctionTool(StrictModel):
    type: Literal["function"] = Field(description="only function tools are served")
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Text | None = None
    parameters: JSONObject | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = Field(None, description="accepted; a forced call always follows the schema")
    defer_loading: bool | None = ignored("every tool is in the prompt")
    output_schema: JSONObject | None = ignored("a tool's output is the client's to shape")
    allowed_callers: list[Literal["direct", "programmatic"]] | None = ignored("calls are always direct")


class FunctionChoice(StrictModel):
    type: Literal["function"]
    name: Text


class AllowedTool(StrictModel):
    type: Literal["function"]
    name: Text


class AllowedTools(StrictModel):
    """Restricts the model to some of `tools` (which stay as given, for the prompt cache's sake)."""
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: Annotated[list[AllowedTool], Field(min_length=1, max_length=128)]


class TextFormatText(StrictModel):
    type: Literal["text"]


class TextFormatJSONObject(StrictModel):
    type: Literal["json_object"]


class TextFormatJSONSchema(StrictModel):
    type: Literal["json_schema"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    schema_: JSONObject = Field(alias="schema")
    description: Text | None = None
    strict: bool | None = Field(None, description="accepted; the schema is always enforced")


TextFormat = Annotated[TextFormatText | TextFormatJSONObject | TextFormatJSONSchema, Field(discriminator="type")]


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = ignored("no verbosity control")


class ResponsesStreamOptions(StrictModel):
    include_obfuscation: bool | None = ignored("no obfuscation field is ever sent")


class Reasoning(StrictModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


MetadataKey = Annotated[Text, Field(max_length=64)]
MetadataValue = Annotated[Text, Field(max_length=512)]


class ResponsesRequest(StrictModel):
    model: Text | None = Field(None, description="served model name; defaults to the one model served")
    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=4096)] = Field(
        description="a user message as a string, or a list of items: messages, function_call and "
                    "function_call_output")
    instructions: Text | None = Field(None, description="a system turn before the input (not carried over by "
                                                        "previous_response_id)")
    previous_response_id: ResponseId | None = Field(None, description="continue this stored response's "
                                                                      "conversation")
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | AllowedTools | None = Field(
        None, description="default auto when tools are given")
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool | None = None
    store: bool | None = Field(None, description="default true: kept in this server's memory for "
                                                 "previous_response_id and GET")
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None
    user: Annotated[Text, Field(max_length=256)] | None = None
    background: bool | None = Field(None, description="only false: responses are not run in the background")
    conversation: Text | JSONObject | None = Field(None, description="not served: use previous_response_id")
    prompt: JSONObject | None = Field(None, description="not served: reusable prompt templates")
    include: Annotated[list[Text], Field(max_length=32)] | None = ignored("no extra output data (logprobs, "
                                                                          "encrypted reasoning) is sent")
    max_tool_calls: Annotated[int, Field(ge=0)] | None = ignored("it bounds built-in tools, none of which is served")
    prompt_cache_key: Annotated[Text, Field(max_length=1024)] | None = ignored("prefix caching is automatic")
    prompt_cache_retention: Literal["in_memory", "24h"] | None = ignored("prefix caching is automatic")
    prompt_cache_options: JSONObject | None = ignored("prefix caching is automatic")
    reasoning: Reasoning | None = ignored("no reasoning model is served (reasoning_tokens is 0)")
    safety_identifier: Annotated[Text, Field(max_length=256)] | None = ignored("no usage policy checks")
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"] | None = ignored(
        "one tier; use priority for classes of service")
    stream_options: ResponsesStreamOptions | None = ignored("only include_obfuscation, which changes nothing here")
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = ignored("no logprobs are sent")
    truncation: Literal["auto", "disabled"] | None = ignored("input past the context is always a 400")
    context_management: Annotated[list[JSONObject], Field(max_length=16)] | None = ignored("no compaction")
    moderation: JSONObject | None = ignored("no moderation")
    # pagedserve extras, as on chat
    seed: Seed | None = None
    top_k: Annotated[int, OrDefault] = Field(-1, ge=-1, description="pagedserve extra: -1 or 0 disables")
    min_p: Annotated[float, OrDefault] = Field(0.0, ge=0.0, le=1.0, description="pagedserve extra")
    repetition_penalty: Annotated[float, OrDefault] = Field(1.0, gt=0.0, description="pagedserve extra")
    presence_penalty: Annotated[float, OrDefault] = Field(0.0, ge=-2.0, le=2.0, description="pagedserve extra")
    frequency_penalty: Annotated[float, OrDefault] = Field(0.0, ge=-2.0, le=2.0, description="pagedserve extra")
    priority: int | Literal["critical", "standard", "sheddable"] | None = Field(
        None, description="pagedserve extra: as on chat; also the x-priority header")
    timeout: float | None = Field(None, gt=0, description="pagedserve extra: seconds to the last token; also the "
                                                           "x-request-timeout header")

    def unserved(self) -> tuple[str, str] | None:
        """(field, why) when the request asks for something this server does not do."""
        if self.background:
            return "background", "background responses are not served: send background false or leave it out"
        if self.conversation is not None:
            return "conversation", "conversation objects are not served: continue with previous_response_id"
        if self.prompt is not None:
            return "prompt", "reusable prompt templates are not served: send the prompt as input"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        return None


# ---- the response ----

class ResponseOutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict] = Field(default_factory=list)
    logprobs: list[dict] = Field(default_factory=list)


class ResponseMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Status
    content: list[ResponseOutputText]


class ResponseFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Status


OutputItem = Annotated[ResponseMessage | ResponseFunctionCall, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: dict | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    # the request's settings, echoed (defaults made explicit), as OpenAI's responses carry them
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | AllowedTools = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig
    temperature: float = 1.0
    top_p: float = 1.0
    truncation: Literal["auto", "disabled"] = "disabled"
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    background: bool = False
    service_tier: str = "default"
    degraded: list[str] | None = Field(None, description="pagedserve extra: what was cut under load")


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True
