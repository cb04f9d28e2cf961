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
    DeltaToolCall,
    KVTransferParams,
    TokenLogprob,
    TopLogprob,
    Usage,
    random_id,
)
from pagedserve.server.serving import (
    EventStream,
    RequestContext,
    ServerState,
    final_outputs,
    merged,
    prefill_handle,
    primed,
    prompt_logprobs,
    sampling_params,
    sse,
    start_streams,
    token_text,
    usage,
)
from pagedserve.server.structured import compile_spec, guided_spec
from pagedserve.server.tools import ToolCallStream, ToolPlan, render_turns, tool_plan


def render_prompt(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool = True,
                  plan: ToolPlan | None = None) -> str:
    tokenizer = state.engine.tokenizer
    native = plan is not None and plan.choice != "none" and tokenizer.template_has_tools
    try:
        if native:  # the template writes tools, calls and results in its own syntax
            turns = [m.model_dump(exclude_none=True) for m in messages]
            return tokenizer.apply_chat_template(turns, add_generation_prompt,
                                                 tools=[t.model_dump(exclude_none=True) for t in plan.tools])
        return tokenizer.apply_chat_template(render_turns(messages, plan, state.tool_parser), add_generation_prompt)
    except Exception as exc:
        raise APIError(400, f"the chat template rejected these messages: {exc}", "messages") from exc


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, ctx: RequestContext,
                                 kv: KVTransferParams | None = None) -> ChatCompletionResponse | EventStream:
    """kv: a peer's disaggregated request (server/peer_routes.py), never a client's."""
    lora = state.check_generation_model(req.model)
    plan = tool_plan(req, state.tool_parser)
    guided, param = guided_spec(req)
    if plan is not None and plan.constraint() is not None:
        if guided is not None:
            raise APIError(400, f"tool_choice '{plan.choice}' constrains the output; it cannot be combined with "
                                f"{param}", param)
        guided, param = plan.constraint(), "tools"
    if guided is not None:
        await compile_spec(state.engine, guided, param)
    prompt = render_prompt(state, req.messages, req.add_generation_prompt, plan)
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(state, req, req.max_completion_tokens or req.max_tokens, top, guided)
    request_id = random_id("chatcmpl")
    call = await start_streams(state, ctx, request_id, [prompt], params, "messages", lora, kv, req.stream)
    parse = plan if plan is not None and plan.parses else None
    if req.stream:
        stream = await primed(merged(state, call))
        return EventStream(_stream(state, req, request_id, stream, ctx.degraded, parse), call, ctx.headers)
    outputs = await final_outputs(state, call)
    choices = [_choice(state, c, top, parse) for c in outputs[0].outputs]
    return ChatCompletionResponse(id=request_id, model=state.response_model(req.model), choices=choices, usage=usage(outputs),
                                  degraded=ctx.degraded, kv_transfer_params=await prefill_handle(state, call, outputs),
                                  prompt_logprobs=prompt_logprobs(state, outputs[0], req.prompt_logprobs))


def _choice(state: ServerState, c: CompletionOutput, top: int | None, plan: ToolPlan | None) -> ChatChoice:
    content, calls = plan.parse(c.text, cut=c.finish_reason == "length") if plan is not None else (c.text, [])
    if plan is not None and plan.legacy:
        message = AssistantMessage(content=content, function_call=calls[0].function if calls else None)
    else:
        message = AssistantMessage(content=content, tool_calls=calls or None)
    return ChatChoice(index=c.index, message=message, logprobs=_logprobs(state, c, 0, top) if top is not None else None,
                      finish_reason=_finish_reason(c.finish_reason, bool(calls), plan),
                      stop_reason=c.stop_reason)


def _finish_reason(reason: str | None, called: bool, plan: ToolPlan | None) -> str | None:
    """OpenAI's: `tool_calls` (`function_call` for legacy functions) when the model chose to call (auto,
    required); a named call ends with `stop`; a call cut off ends with `length`."""
    if reason == "stop" and called and plan is not None and not plan.named:
        return "function_call" if plan.legacy else "tool_calls"
    return reason


def _call_delta(delta: DeltaToolCall, plan: ToolPlan) -> DeltaMessage:
    return DeltaMessage(function_call=delta.function) if plan.legacy else DeltaMessage(tool_calls=[delta])


async def _stream(state: ServerState, req: ChatCompletionRequest, request_id: str, outputs: AsyncIterator,
                  degraded: list[str] | None, plan: ToolPlan | None) -> AsyncIterator[str]:
    options = req.stream_options
    top = (req.top_logprobs or 0) if req.logprobs else None
    so_far: Usage | None = None  # with continuous_usage_stats: the usage every chunk carries

    def chunk(choice: ChatChunkChoice) -> str:
        body = ChatCompletionChunk(id=request_id, model=state.response_model(req.model), choices=[choice],
                                   degraded=degraded, usage=so_far)
        return sse(body.model_dump_json(exclude_none=True))

    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    parsers = {i: ToolCallStream(plan) for i in range(req.n)} if plan is not None else {}
    finished: set[int] = set()
    last: RequestOutput | None = None
    try:
        async for _, out in outputs:
            if last is None:  # the stream is primed: the first output is at hand, and with it the prompt's usage
                so_far = usage([out], generated=False) if options and options.continuous_usage else None
                for i in range(req.n):
                    yield chunk(ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
            if so_far is not None:
                so_far = usage([out])
            last = out
            for c in out.outputs:
                if c.index in finished:
                    continue
                start_text, start_tok = sent_text.get(c.index, 0), sent_tokens.get(c.index, 0)
                text, calls = c.text[start_text:], []
                if c.index in parsers:
                    text, calls = parsers[c.index].feed(text)
                    if c.finish_reason:
                        rest, more = parsers[c.index].finish()
                        text, calls = text + rest, calls + more
                sent_text[c.index] = len(c.text)
                if text or not calls and top is not None and len(c.token_ids) > start_tok:
                    sent_tokens[c.index] = len(c.token_ids)
                    yield chunk(ChatChunkChoice(
                        index=c.index, delta=DeltaMessage(content=text),
                        logprobs=_logprobs(state, c, start_tok, top) if top is not None else None))
                for delta in calls:  # one call delta per chunk: never two entries of one index in a chunk
                    logprobs = None
                    if top is not None and len(c.token_ids) > sent_tokens.get(c.index, 0):
                        logprobs = _logprobs(state, c, sent_tokens.get(c.index, 0), top)
                        sent_tokens[c.index] = len(c.token_ids)
                    yield chunk(ChatChunkChoice(index=c.index, delta=_call_delta(delta, plan), logprobs=logprobs))
                if c.finish_reason:
                    finished.add(c.index)
                    called = c.index in parsers and bool(parsers[c.index].calls)
                    yield chunk(ChatChunkChoice(index=c.index, delta=DeltaMessage(),
                                                finish_reason=_finish_reason(c.finish_reason, called, plan),
                                                stop_reason=c.stop_reason))
        if options and options.final_usage and last is not None:
            body = ChatCompletionChunk(id=request_id, model=state.response_model(req.model), choices=[], usage=usage([last]))
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
