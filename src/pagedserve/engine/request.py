"""A request as the scheduler sees it: token ids, progress, blocks and sampling state."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pagedserve.outputs import Logprob, SampleLogprobs
from pagedserve.sampling_params import SamplingParams


def takes_output_from_elsewhere(params: SamplingParams) -> bool:
    """Whether a request can go on from output generated elsewhere (a disaggregated request's first token): a
    plain single sample, since the tokens come without their logprobs, a grammar's state or siblings."""
    return (params.n == 1 and params.logprobs is None and params.prompt_logprobs is None
            and params.guided_decoding is None)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str  # unique per sequence; a parent with n > 1 has children "<id>#<i>"
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seed: int  # per-sequence seed: the params' seed, or one drawn by the engine
    priority: int = 0  # lower is more important (vLLM convention)
    parent_id: str | None = None
    index: int = 0  # which of the parent's n samples this is
    cache_salt: str | None = None  # extra key of the prefix-cache hash chain (e.g. LoRA id, tenant salt)
    eos_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first scheduled
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: SampleLogprobs | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # grows as prompt chunks are computed
    pending_children: int = 0  # n - 1 samples still to fork from this one when its prompt is done
    matcher: Any = None  # llguidance.LLMatcher of a constrained request (its own copy), else None
    lora: Any = None  # the LoRAAdapter it runs under, else None (the base model)
    held: bool = False  # kept out of the scheduler until released (its prompt's KV is on its way)
    spec_token_ids: list[int] = field(default_factory=list)  # proposals to verify next step, after all_token_ids
    spec_state: Any = None  # the proposer's own per-request state (engine/spec_decode/)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first token has no context to be predicted from

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def max_tokens(self) -> int:
        assert self.params.max_tokens is not None, "the engine fills max_tokens in before scheduling"
        return self.params.max_tokens

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
