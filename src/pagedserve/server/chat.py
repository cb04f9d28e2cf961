"""POST /v1/chat/completions: messages rendered by the model's chat template, streamed or not."""
from __future__ import annotations

from collections.abc import AsyncIterator

from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChoiceLogprobs,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    random_id,
)
from pagedserve.server.serving import (
    EventStream,
    RequestContext,
    ServerState,
    final_outputs,
    merged,
    primed,
    sampling_params,
    sse,
    start_streams,
    token_text,
    usage,
)


def render_prompt(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
    turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    try:
        return state.engine.tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt)
    except Exception as exc:
        raise APIError(400, f"the chat template rejected these messages: {exc}", "messages") from exc


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest,
                                 ctx: RequestContext) -> ChatCompletionResponse | EventStream:
    state.check_generation_model(req.model)
    if req.response_format is not None and req.response_format.type != "text":
        raise APIError(400, f"response_format type '{req.response_format.type}' is not supported; "
                            "only 'text' is (no constrained decoding)", "response_format")
    prompt = render_prompt(state, req.messages, req.add_generation_prompt)
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(state, req, req.max_completion_tokens or req.max_tokens, top)
    request_id = random_id("chatcmpl")
    call = await start_streams(state, ctx, request_id, [prompt], params, "messages")
    if req.stream:
        stream = await primed(merged(state, call))
        return EventStream(_stream(state, req, request_id, stream, ctx.degraded), call, ctx.headers)
    outputs = await final_outputs(state, call)
    choices = [
        ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                   logprobs=_logprobs(state, c, 0, top) if top is not None else None,
                   finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        for c in outputs[0].outputs
    ]
    return ChatCompletionResponse(id=request_id, model=state.model_name, choices=choices, usage=usage(outputs),
                                  degraded=ctx.degraded)


async def _stream(state: ServerState, req: ChatCompletionRequest, request_id: str,
                  outputs: AsyncIterator, degraded: list[str] | None) -> AsyncIterator[str]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    top = (req.top_logprobs or 0) if req.logprobs else None

    def chunk(choice: ChatChunkChoice) -> str:
        body = ChatCompletionChunk(id=request_id, model=state.model_name, choices=[choice], degraded=degraded)
        return sse(body.model_dump_json(exclude_none=True))

    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    finished: set[int] = set()
    last: RequestOutput | None = None
    try:
        for i in range(req.n):
            yield chunk(ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
        async for _, out in outputs:
            last = out
            for c in out.outputs:
                if c.index in finished:
                    continue
                start_text, start_tok = sent_text.get(c.index, 0), sent_tokens.get(c.index, 0)
                text = c.text[start_text:]
                if text or len(c.token_ids) > start_tok:
                    sent_text[c.index], sent_tokens[c.index] = len(c.text), len(c.token_ids)
                    yield chunk(ChatChunkChoice(
                        index=c.index, delta=DeltaMessage(content=text),
                        logprobs=_logprobs(state, c, start_tok, top) if top is not None else None))
                if c.finish_reason:
                    finished.add(c.index)
                    yield chunk(ChatChunkChoice(index=c.index, delta=DeltaMessage(),
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        if include_usage and last is not None:
            body = ChatCompletionChunk(id=request_id, model=state.model_name, choices=[], usage=usage([last]))
            yield sse(body.model_dump_json())
    except APIError as exc:
        yield sse(exc.body().model_dump_json())
    yield sse("[DONE]")


def _logprobs(state: ServerState, c: CompletionOutput, start: int, top: int) -> ChoiceLogprobs:
    content = []
    for token_id, entry in zip(c.token_ids[start:], (c.logprobs or [])[start:], strict=False):
        chosen = entry.get(token_id)
        text = token_text(state, token_id, chosen.decoded_token if chosen else None)
        ranked = sorted(entry.items(), key=lambda kv: kv[1].logprob, reverse=True)[:top]
        content.append(TokenLogprob(
            token=text, logprob=chosen.logprob if chosen else -9999.0, bytes=list(text.encode()),
            top_logprobs=[_top(state, t, lp) for t, lp in ranked],
        ))
    return ChoiceLogprobs(content=content)


def _top(state: ServerState, token_id: int, lp) -> TopLogprob:
    text = token_text(state, token_id, lp.decoded_token)
    return TopLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode()))
