"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

A request becomes a chat request (instructions as the system turn, the stored conversation of
previous_response_id, then the input items; function tools and text.format as tools and response_format) and
runs through the chat path (chat.py: template, tool plans and parsing, output constraints, sampling, admission,
streaming); its answer, or its chunks as they come, are turned into the response object and its typed events.
Errors name the Responses API's fields (input, text.format, max_output_tokens, tools.N.parameters).
"""
from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pagedserve.server.chat import create_chat_completion
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    JSONSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    ToolCall,
    ignored_fields,
)
from pagedserve.server.response_store import ResponseStore, StoredResponse
from pagedserve.server.responses_protocol import (
    REPLICA_TAG_HEADER,
    REPLICA_TAG_PATTERN,
    AllowedTools,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    IncompleteDetails,
    InputItem,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputText,
    ResponseDeleted,
    ResponseFunctionCall,
    ResponseMessage,
    ResponseObject,
    ResponseOutputText,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
    TextFormatJSONSchema,
    TextFormatText,
    new_response_id,
)
from pagedserve.server.serving import EventStream, RequestContext, ServerState, respond, until_disconnect

logger = logging.getLogger(__name__)
STREAM_DOC = {200: {"content": {"text/event-stream": {}}, "description": "the response, or its typed events "
                                                                          "when stream is true"}}
# The chat path's names for what the Responses API calls otherwise (first part of an error's param).
PARAMS = {"messages": "input", "response_format": "text.format", "max_tokens": "max_output_tokens",
          "max_completion_tokens": "max_output_tokens"}


def responses_routes(state: ServerState) -> APIRouter:
    store = ResponseStore()  # this process's own: a restart forgets them
    r = APIRouter()

    @r.post("/v1/responses", response_model=ResponseObject, responses=STREAM_DOC)
    async def create(req: ResponsesRequest, request: Request) -> Response:
        ctx = RequestContext.build(req.priority, req.timeout, request.headers)
        tag = request.headers.get(REPLICA_TAG_HEADER)
        if tag is not None and not re.fullmatch(REPLICA_TAG_PATTERN, tag):
            raise APIError(400, f"header {REPLICA_TAG_HEADER} must be 8 hex digits (a pagedserve router sets it)",
                           REPLICA_TAG_HEADER)
        return await until_disconnect(request, respond(create_response(state, store, req, ctx, tag), ctx))

    @r.get("/v1/responses/{response_id}", response_model=ResponseObject)
    async def retrieve(response_id: str) -> JSONResponse:
        return JSONResponse(_stored(store, response_id, "response_id").body)

    @r.delete("/v1/responses/{response_id}", response_model=ResponseDeleted)
    async def delete(response_id: str) -> ResponseDeleted:
        _stored(store, response_id, "response_id")
        store.pop(response_id)
        return ResponseDeleted(id=response_id)

    return r


def _stored(store: ResponseStore, response_id: str, param: str) -> StoredResponse:
    entry = store.get(response_id)
    if entry is None:
        what = "Previous response" if param == "previous_response_id" else "Response"
        raise APIError(404, f"{what} with id '{response_id}' not found (responses are kept in this server's memory "
                            "for an hour, unless store was false; a restart forgets them).", param,
                       "previous_response_not_found" if param == "previous_response_id" else "response_not_found")
    return entry


async def create_response(state: ServerState, store: ResponseStore, req: ResponsesRequest, ctx: RequestContext,
                          tag: str | None) -> Response:
    if (unserved := req.unserved()) is not None:
        raise APIError(400, unserved[1], unserved[0])
    for name in sorted(ignored_fields(req)):
        logger.debug("%s: accepted and ignored (not supported by this server)", name)
    previous = _stored(store, req.previous_response_id, "previous_response_id") if req.previous_response_id else None
    items = (previous.items if previous else ()) + _input_items(req.input)
    base = _echo(state, req, new_response_id(tag))
    try:
        answer = await create_chat_completion(state, _chat_request(req, items), ctx)
    except APIError as exc:
        exc.param, exc.message = _param(exc.param), _renamed(exc.message)
        raise
    done = _Finisher(store, req, items, previous)
    if isinstance(answer, EventStream):
        events = _Events(base, done).stream(answer.body_iterator, ctx.degraded)
        return EventStream(events, answer.call, ctx.headers)
    final = done.finish(base, _output_items(answer), answer.choices[0].finish_reason, _usage(answer.usage.model_dump()),
                        ctx.degraded)
    return JSONResponse(final.model_dump(mode="json", by_alias=True), headers=ctx.headers)


def _param(param: str | None) -> str | None:
    """A chat-path error's param in the Responses API's names."""
    if param is None:
        return None
    head, _, rest = param.partition(".")
    if head == "tools":
        rest = rest.replace(".function.", ".", 1)
    return PARAMS.get(head, ".".join(filter(None, [head, rest])))


def _renamed(message: str) -> str:
    """A chat-path error's message in the Responses API's names."""
    return message.replace("response_format", "text.format").replace(".function.parameters", ".parameters")


def _input_items(given: str | list[InputItem]) -> tuple[InputItem, ...]:
    return (MessageItem(role="user", content=given),) if isinstance(given, str) else tuple(given)


def _chat_request(req: ResponsesRequest, items: tuple[InputItem, ...]) -> ChatCompletionRequest:
    messages = [ChatMessage(role="system", content=req.instructions)] if req.instructions is not None else []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append(ChatMessage(role=item.role, content=item.text()))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=item.text()))
        else:  # a call belongs to the assistant turn it follows: one answer's text and calls are one turn
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            if messages and messages[-1].role == "assistant":
                messages[-1].tool_calls = [*(messages[-1].tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
    tools, choice = _tools(req)
    fmt = req.text.format if req.text is not None else None
    chosen = {"temperature": req.temperature, "top_p": req.top_p, "max_completion_tokens": req.max_output_tokens,
              "parallel_tool_calls": req.parallel_tool_calls}
    return ChatCompletionRequest(
        messages=messages, model=req.model, tools=tools or None, tool_choice=choice, response_format=_format(fmt),
        seed=req.seed, top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty, priority=req.priority,
        timeout=req.timeout, stream=bool(req.stream),
        stream_options=StreamOptions(include_usage=True) if req.stream else None,
        **{k: v for k, v in chosen.items() if v is not None})


def _tools(req: ResponsesRequest) -> tuple[list[ChatTool], str | NamedToolChoice | None]:
    tools = [ChatTool(type="function", function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)) for t in req.tools or []]
    choice = req.tool_choice
    if isinstance(choice, FunctionChoice):
        return tools, NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    if isinstance(choice, AllowedTools):
        names = {t.function.name for t in tools}
        for i, allowed in enumerate(choice.tools):
            if allowed.name not in names:
                raise APIError(400, f"tool_choice allows function '{allowed.name}', which is not in tools",
                               f"tool_choice.tools.{i}.name")
        allowed_names = {a.name for a in choice.tools}
        return [t for t in tools if t.function.name in allowed_names], choice.mode
    return tools, choice


def _format(fmt) -> ResponseFormat | None:
    if fmt is None or isinstance(fmt, TextFormatText):
        return None
    if isinstance(fmt, TextFormatJSONSchema):
        return ResponseFormat(type="json_schema", json_schema=JSONSchemaFormat(
            name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict))
    return ResponseFormat(type="json_object")


def _echo(state: ServerState, req: ResponsesRequest, response_id: str) -> ResponseObject:
    """The response as it starts: in progress, no output yet, the request's settings echoed."""
    echoed = {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
              "previous_response_id": req.previous_response_id, "tools": req.tools or [],
              "tool_choice": req.tool_choice, "parallel_tool_calls": req.parallel_tool_calls,
              "text": req.text or TextConfig(format=TextFormatText(type="text")), "temperature": req.temperature,
              "top_p": req.top_p, "truncation": req.truncation, "store": req.store, "metadata": req.metadata,
              "user": req.user}
    return ResponseObject(id=response_id, status="in_progress", model=state.response_model(req.model),
                          **{k: v for k, v in echoed.items() if v is not None})


def _output_items(answer: ChatCompletionResponse) -> list[OutputItem]:
    choice = answer.choices[0]
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    message, calls = choice.message, choice.message.tool_calls or []
    items: list[OutputItem] = []
    if message.content or not calls:
        items.append(ResponseMessage(id=_item_id("msg"), status=status,
                                     content=[ResponseOutputText(text=message.content or "")]))
    items += [ResponseFunctionCall(id=_item_id("fc"), call_id=c.id, name=c.function.name,
                                   arguments=c.function.arguments, status="completed") for c in calls]
    return items


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(usage: dict) -> ResponseUsage:
    """The chat path's usage (as its JSON) in the Responses API's names."""
    details = usage.get("prompt_tokens_details") or {}
    return ResponseUsage(input_tokens=usage["prompt_tokens"], output_tokens=usage["completion_tokens"],
                         total_tokens=usage["total_tokens"],
                         input_tokens_details=InputTokensDetails(cached_tokens=details.get("cached_tokens", 0)))


class _Finisher:
    """Completes a response (status, output, usage) and keeps it, with its conversation, unless store is false."""

    def __init__(self, store: ResponseStore, req: ResponsesRequest, items: tuple[InputItem, ...],
                 previous: StoredResponse | None) -> None:
        self.store, self.req, self.items, self.previous = store, req, items, previous

    def finish(self, base: ResponseObject, output: list[OutputItem], finish_reason: str | None,
               usage: ResponseUsage | None, degraded: list[str] | None) -> ResponseObject:
        incomplete = finish_reason == "length"
        final = base.model_copy(update={
            "status": "incomplete" if incomplete else "completed", "output": output, "usage": usage,
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if incomplete else None,
            "completed_at": None if incomplete else int(time.time()), "degraded": degraded})
        if self.req.store is not False:
            self._keep(final)
        return final

    def _keep(self, final: ResponseObject) -> None:
        body = final.model_dump(mode="json", by_alias=True)
        answer = tuple(_as_input(item) for item in final.output)
        own = list(self.items[len(self.previous.items):] if self.previous else self.items) + list(answer)
        size = len(json.dumps(body)) + sum(len(item.model_dump_json()) for item in own)
        if not self.store.put(final.id, body, self.items + answer, size + (self.previous.size if self.previous else 0)):
            logger.info("response %s is over the store's byte bound; not kept", final.id)


def _as_input(item: OutputItem) -> InputItem:
    """An output item as the input item that carries it into the next turn."""
    if isinstance(item, ResponseMessage):
        return MessageItem(role="assistant", id=item.id, status=item.status,
                           content=[OutputText(type="output_text", text=part.text) for part in item.content])
    return FunctionCallItem(type="function_call", id=item.id, call_id=item.call_id, name=item.name,
                            arguments=item.arguments, status=item.status)


class _Events:
    """The Responses API's typed events from the chat path's chunks: the response created and in progress; each
    output item added, its deltas (text as it comes, a call's arguments whole once the call is parsed) and done;
    then response.completed or response.incomplete (or an `error` event). A message item opens at the first text
    that is not blank, so the blank lines between tool calls do not make one."""

    def __init__(self, base: ResponseObject, done: _Finisher) -> None:
        self.base, self.done = base, done
        self.seq = 0
        self.output: list[OutputItem] = []
        self.open: OutputItem | None = None
        self.held = ""  # blank text before any message item

    def event(self, kind: str, **fields) -> str:
        body = json.dumps({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return f"event: {kind}\ndata: {body}\n\n"

    def _item_event(self, kind: str, item: OutputItem) -> str:
        return self.event(kind, output_index=self.output.index(item), item=item.model_dump(mode="json"))

    async def stream(self, chunks: AsyncIterator[str], degraded: list[str] | None) -> AsyncIterator[str]:
        snapshot = self.base.model_dump(mode="json", by_alias=True)
        yield self.event("response.created", response=snapshot)
        yield self.event("response.in_progress", response=snapshot)
        finish, usage = None, None
        try:
            async for data in chunks:
                payload = data.removeprefix("data: ").strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    error = chunk["error"]
                    yield self.event("error", code=error.get("code"), message=_renamed(error.get("message", "")),
                                     param=_param(error.get("param")))
                    return
                usage = _usage(chunk["usage"]) if chunk.get("usage") else usage
                for choice in chunk.get("choices", []):
                    for event in self._delta(choice["delta"]):
                        yield event
                    finish = choice.get("finish_reason") or finish
        finally:
            await chunks.aclose()
        status = "incomplete" if finish == "length" else "completed"
        for event in self._close(status):
            yield event
        if not self.output:  # no call and no text but blanks: still one message, as a whole answer has
            for event in self._text("", force=True):
                yield event
            for event in self._close(status):
                yield event
        final = self.done.finish(self.base, self.output, finish, usage, degraded)
        kind = "response.incomplete" if final.status == "incomplete" else "response.completed"
        yield self.event(kind, response=final.model_dump(mode="json", by_alias=True))

    def _delta(self, delta: dict) -> list[str]:
        events = self._text(delta.get("content") or "")
        for call in delta.get("tool_calls") or []:
            function = call.get("function") or {}
            if call.get("id"):
                events += self._close("completed")
                self.open = ResponseFunctionCall(id=_item_id("fc"), call_id=call["id"], name=function.get("name", ""),
                                                 arguments="", status="in_progress")
                self.output.append(self.open)
                events.append(self._item_event("response.output_item.added", self.open))
            if function.get("arguments") and isinstance(self.open, ResponseFunctionCall):
                self.open.arguments += function["arguments"]
                events.append(self.event("response.function_call_arguments.delta", item_id=self.open.id,
                                         output_index=len(self.output) - 1, delta=function["arguments"]))
        return events

    def _text(self, text: str, force: bool = False) -> list[str]:
        events: list[str] = []
        if not isinstance(self.open, ResponseMessage):
            if not text.strip() and not force:
                self.held += text if not self.output else ""
                return events
            events += self._close("completed")
            self.open = ResponseMessage(id=_item_id("msg"), status="in_progress", content=[])
            self.output.append(self.open)
            events.append(self._item_event("response.output_item.added", self.open))
            events.append(self.event("response.content_part.added", item_id=self.open.id,
                                     output_index=len(self.output) - 1, content_index=0,
                                     part=ResponseOutputText(text="").model_dump(mode="json")))
            self.open.content.append(ResponseOutputText(text=""))
            text, self.held = self.held + text, ""
        if text:
            self.open.content[0].text += text
            events.append(self.event("response.output_text.delta", item_id=self.open.id,
                                     output_index=len(self.output) - 1, content_index=0, delta=text, logprobs=[]))
        return events

    def _close(self, status: str) -> list[str]:
        """Ends the open item, if any, with its done events."""
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = status
        where = {"item_id": item.id, "output_index": self.output.index(item)}
        if isinstance(item, ResponseMessage):
            part = item.content[0]
            events = [self.event("response.output_text.done", **where, content_index=0, text=part.text, logprobs=[]),
                      self.event("response.content_part.done", **where, content_index=0,
                                 part=part.model_dump(mode="json"))]
        else:
            events = [self.event("response.function_call_arguments.done", **where, name=item.name,
                                 arguments=item.arguments)]
        return events + [self._item_event("response.output_item.done", item)]
