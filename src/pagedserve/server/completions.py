"""POST /v1/completions: plain-text completions, streamed or not."""
from __future__ import annotations

from collections.abc import AsyncIterator

from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    KVTransferParams,
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
    sampling_params,
    sse,
    start_streams,
    token_text,
    usage,
)
from pagedserve.server.structured import compile_spec, guided_spec


def prompt_list(prompt: str | list) -> list[str | list[int]]:
    """One prompt per engine request (the schema has already refused empty ones)."""
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


async def create_completion(state: ServerState, req: CompletionRequest, ctx: RequestContext,
                            kv: KVTransferParams | None = None) -> CompletionResponse | EventStream:
    """kv: a peer's disaggregated request (server/peer_routes.py), never a client's."""
    lora = state.check_generation_model(req.model)
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo together with logprobs is not supported (no prompt logprobs)", "echo")
    prompts = prompt_list(req.prompt)
    guided, param = guided_spec(req)
    if guided is not None:
        await compile_spec(state.engine, guided, param)
    params = sampling_params(state, req, req.max_tokens, req.logprobs, guided)
    request_id = random_id("cmpl")
    call = await start_streams(state, ctx, request_id, prompts, params, lora=lora, kv=kv,
                               stream=req.stream)
    if req.stream:
        stream = await primed(merged(state, call))
        return EventStream(_stream(state, req, request_id, prompts, stream, ctx.degraded), call, ctx.headers)
    outputs = await final_outputs(state, call)
    choices = [
        CompletionChoice(
            index=i * req.n + c.index,
            text=(_echo_text(state, prompts[i]) if req.echo else "") + c.text,
            logprobs=_logprobs(state, c, 0, req.logprobs) if req.logprobs is not None else None,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
        )
        for i, out in enumerate(outputs) for c in out.outputs
    ]
    return CompletionResponse(id=request_id, model=state.response_model(req.model), choices=choices, usage=usage(outputs),
                              degraded=ctx.degraded, kv_transfer_params=await prefill_handle(state, call, outputs))


async def _stream(state: ServerState, req: CompletionRequest, request_id: str, prompts: list,
                  outputs: AsyncIterator, degraded: list[str] | None) -> AsyncIterator[str]:
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    finished: set[int] = set()
    last: dict[int, RequestOutput] = {}
    try:
        async for i, out in outputs:
            last[i] = out
            for c in out.outputs:
                index = i * req.n + c.index
                if index in finished:
                    continue
                start_text, start_tok = sent_text.get(index, 0), sent_tokens.get(index, 0)
                text = c.text[start_text:]
                if req.echo and index not in sent_text:
                    text = _echo_text(state, prompts[i]) + text
                if not text and not c.finish_reason and len(c.token_ids) == start_tok:
                    continue
                sent_text[index], sent_tokens[index] = len(c.text), len(c.token_ids)
                if c.finish_reason:
                    finished.add(index)
                chunk = CompletionResponse(id=request_id, model=state.response_model(req.model), degraded=degraded,
                                           choices=[CompletionChoice(
                    index=index, text=text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    logprobs=_logprobs(state, c, start_tok, req.logprobs) if req.logprobs is not None else None,
                )])
                yield sse(chunk.model_dump_json(exclude_none=True))
        if req.stream_options and req.stream_options.include_usage:
            outputs = [last[i] for i in sorted(last)]
            chunk = CompletionResponse(id=request_id, model=state.response_model(req.model), choices=[], usage=usage(outputs))
            yield sse(chunk.model_dump_json())
    except APIError as exc:
        yield sse(exc.body().model_dump_json())
    yield sse("[DONE]")


def _echo_text(state: ServerState, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else state.engine.tokenizer.decode(prompt)


def _logprobs(state: ServerState, c: CompletionOutput, start: int, top: int | None) -> CompletionLogprobs:
    """Logprobs of tokens [start:] of one sample, in the legacy completions layout."""
    result = CompletionLogprobs()
    entries = (c.logprobs or [])[start:]
    for token_id, entry in zip(c.token_ids[start:], entries, strict=False):
        chosen = entry.get(token_id)
        result.tokens.append(token_text(state, token_id, chosen.decoded_token if chosen else None))
        result.token_logprobs.append(chosen.logprob if chosen else None)
        ranked = sorted(entry.items(), key=lambda kv: kv[1].logprob, reverse=True)[: top or 0]
        result.top_logprobs.append({token_text(state, t, lp.decoded_token): lp.logprob for t, lp in ranked})
    # Character offsets of each token in the sample's text (the new tokens end where the text ends).
    offset = len(c.text) - sum(len(t) for t in result.tokens)
    for text in result.tokens:
        result.text_offset.append(max(0, offset))
        offset += len(text)
    return result
