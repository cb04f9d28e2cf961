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
    prompt_logprobs,
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
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens 0 generates nothing: it is allowed only with echo (the prompt alone)",
                       "max_tokens")
    best_of = req.best_of or req.n
    if best_of < req.n:
        raise APIError(400, f"best_of ({best_of}) must be at least n ({req.n})", "best_of")
    if best_of > req.n and req.stream:
        raise APIError(400, "best_of cannot be streamed: which samples are best is known only at the end",
                       "best_of")
    prompts = prompt_list(req.prompt)
    guided, param = guided_spec(req)
    if guided is not None:
        await compile_spec(state.engine, guided, param)
    # echo with logprobs scores the prompt's tokens too (OpenAI's legacy layout; lm-eval's loglikelihood)
    wanted = [n for n in (req.logprobs if req.echo else None, req.prompt_logprobs) if n is not None]
    # best_of ranks samples by their tokens' logprobs: it needs the sampled ones' at least
    logprobs = req.logprobs if best_of == req.n else req.logprobs or 0
    params = sampling_params(state, req, 1 if req.max_tokens == 0 else req.max_tokens, logprobs, guided,
                             max(wanted, default=None), n=best_of)
    request_id = random_id("cmpl")
    call = await start_streams(state, ctx, request_id, prompts, params, lora=lora, kv=kv,
                               stream=req.stream)
    if req.stream:
        stream = await primed(merged(state, call))
        return EventStream(_stream(state, req, request_id, prompts, stream, ctx.degraded), call, ctx.headers)
    outputs = await final_outputs(state, call)
    if req.max_tokens == 0:
        _prompt_only(outputs)
    used = usage(outputs)  # every sample counts, kept or not (as OpenAI bills best_of)
    if best_of > req.n:
        _keep_best(outputs, req.n)
    choices = [
        CompletionChoice(
            index=i * req.n + c.index,
            text=(_echo_text(state, prompts[i]) if req.echo else "") + c.text,
            logprobs=_choice_logprobs(state, req, prompts[i], out, c, 0, first=True),
            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
            prompt_logprobs=prompt_logprobs(state, out, req.prompt_logprobs),
        )
        for i, out in enumerate(outputs) for c in out.outputs
    ]
    return CompletionResponse(id=request_id, model=state.response_model(req.model), choices=choices, usage=used,
                              degraded=ctx.degraded, kv_transfer_params=await prefill_handle(state, call, outputs))


def _keep_best(outputs: list[RequestOutput], n: int) -> None:
    """best_of: each prompt's n samples with the highest mean token logprob, renumbered best first."""
    def mean_logprob(c: CompletionOutput) -> float:
        chosen = [entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs or [], strict=False) if t in entry]
        return sum(chosen) / max(1, len(chosen))

    for out in outputs:
        out.outputs = sorted(out.outputs, key=mean_logprob, reverse=True)[:n]
        for index, c in enumerate(out.outputs):
            c.index = index


async def _stream(state: ServerState, req: CompletionRequest, request_id: str, prompts: list,
                  outputs: AsyncIterator, degraded: list[str] | None) -> AsyncIterator[str]:
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    finished: set[int] = set()
    last: dict[int, RequestOutput] = {}
    continuous = bool(req.stream_options and req.stream_options.continuous_usage)
    try:
        async for i, out in outputs:
            if req.max_tokens == 0:
                _prompt_only([out])
            last[i] = out
            so_far = usage([last[j] for j in sorted(last)]) if continuous else None
            for c in out.outputs:
                index = i * req.n + c.index
                if index in finished:
                    continue
                start_text, start_tok = sent_text.get(index, 0), sent_tokens.get(index, 0)
                first = index not in sent_text
                text = c.text[start_text:]
                if req.echo and first:
                    text = _echo_text(state, prompts[i]) + text
                if not text and not c.finish_reason and len(c.token_ids) == start_tok:
                    continue
                sent_text[index], sent_tokens[index] = len(c.text), len(c.token_ids)
                if c.finish_reason:
                    finished.add(index)
                chunk = CompletionResponse(id=request_id, model=state.response_model(req.model), degraded=degraded,
                                           usage=so_far, choices=[CompletionChoice(
                    index=index, text=text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    logprobs=_choice_logprobs(state, req, prompts[i], out, c, start_tok, first),
                    prompt_logprobs=prompt_logprobs(state, out, req.prompt_logprobs) if first else None,
                )])
                yield sse(chunk.model_dump_json(exclude_none=True))
        if req.stream_options and req.stream_options.final_usage:
            outputs = [last[i] for i in sorted(last)]
            chunk = CompletionResponse(id=request_id, model=state.response_model(req.model), choices=[], usage=usage(outputs))
            yield sse(chunk.model_dump_json())
    except APIError as exc:
        yield sse(exc.body().model_dump_json())
    yield sse("[DONE]")


def _echo_text(state: ServerState, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else state.engine.tokenizer.decode(prompt)


def _prompt_only(outputs: list[RequestOutput]) -> None:
    """max_tokens 0 (with echo): the one token the engine had to sample is not part of the answer."""
    for out in outputs:
        for c in out.outputs:
            c.text, c.token_ids, c.logprobs = "", [], []
            c.finish_reason, c.stop_reason = ("length" if c.finish_reason else None), None


def _choice_logprobs(state: ServerState, req: CompletionRequest, prompt: str | list[int], out: RequestOutput,
                     c: CompletionOutput, start: int, first: bool) -> CompletionLogprobs | None:
    """A choice's (or a stream chunk's) logprobs: the sample's tokens from start, after the prompt's when echoed
    (in the first chunk only)."""
    if req.logprobs is None:
        return None
    sample = _logprobs(state, c, start, req.logprobs)
    if not (req.echo and first):
        return sample
    head = _prompt_part(state, out, req.logprobs)
    shift = len(_echo_text(state, prompt))
    return CompletionLogprobs(tokens=head.tokens + sample.tokens,
                              token_logprobs=head.token_logprobs + sample.token_logprobs,
                              top_logprobs=head.top_logprobs + sample.top_logprobs,
                              text_offset=head.text_offset + [shift + o for o in sample.text_offset])


def _prompt_part(state: ServerState, out: RequestOutput, top: int) -> CompletionLogprobs:
    """The prompt's tokens in the legacy layout: the first has no logprob (nothing comes before it)."""
    result, offset = CompletionLogprobs(), 0
    for token_id, entry in zip(out.prompt_token_ids, out.prompt_logprobs or [], strict=False):
        chosen = entry.get(token_id) if entry else None
        text = token_text(state, token_id, chosen.decoded_token if chosen else None)
        result.tokens.append(text)
        result.text_offset.append(offset)
        offset += len(text)
        result.token_logprobs.append(chosen.logprob if chosen else None)
        result.top_logprobs.append(None if entry is None else _top(state, entry, top))
    return result


def _top(state: ServerState, entry: dict, n: int) -> dict[str, float]:
    ranked = sorted(entry.items(), key=lambda kv: kv[1].logprob, reverse=True)[:n]
    return {token_text(state, t, lp.decoded_token): lp.logprob for t, lp in ranked}


def _logprobs(state: ServerState, c: CompletionOutput, start: int, top: int | None) -> CompletionLogprobs:
    """Logprobs of tokens [start:] of one sample, in the legacy completions layout."""
    result = CompletionLogprobs()
    entries = (c.logprobs or [])[start:]
    for token_id, entry in zip(c.token_ids[start:], entries, strict=False):
        chosen = entry.get(token_id)
        result.tokens.append(token_text(state, token_id, chosen.decoded_token if chosen else None))
        result.token_logprobs.append(chosen.logprob if chosen else None)
        result.top_logprobs.append(_top(state, entry, top or 0))
    # Character offsets of each token in the sample's text (the new tokens end where the text ends).
    offset = len(c.text) - sum(len(t) for t in result.tokens)
    for text in result.tokens:
        result.text_offset.append(max(0, offset))
        offset += len(text)
    return result
