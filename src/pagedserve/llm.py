"""Offline API, vLLM-style: LLM(...).generate(prompts, SamplingParams) and .chat(messages)."""
from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.lora_request import LoRARequest
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

Prompt = str | dict  # a string, or {"prompt_token_ids": [...]}


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", config: EngineConfig | None = None,
                 **engine_args) -> None:
        self.engine = LLMEngine(config or EngineConfig(model=model, dtype=dtype, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 progress: Callable[[int, int], None] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Runs all prompts together (continuous batching); returns outputs in prompt order. lora_request:
        one adapter for every prompt, or one (or None: the base model) per prompt."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = params or SamplingParams()
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        loras = list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * len(prompts)
        if len(per_prompt) != len(prompts) or len(loras) != len(prompts):
            raise ValueError(f"got {len(per_prompt)} SamplingParams and {len(loras)} LoRA requests for "
                             f"{len(prompts)} prompts")
        # Offline, an invalid constraint raises here (the server answers 400); each distinct spec is checked once.
        specs = {p.guided_decoding.key: p.guided_decoding for p in per_prompt if p.guided_decoding is not None}
        for spec in specs.values():
            self.engine.grammars.check(spec).result()
        for lora in {lora for lora in loras if lora is not None}:  # and an adapter that cannot load
            if self.engine.loras is not None and self.engine.loras.get(lora) is None:
                self.engine.loras.load(lora)
        ids = []
        for prompt, p, lora in zip(prompts, per_prompt, loras):
            request_id = str(next(self._ids))
            self.engine.add_request(request_id, _prompt_input(prompt), p, lora_request=lora)
            ids.append(request_id)
        return self._run(ids, progress)

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | None = None) -> list[RequestOutput]:
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, params)

    def _run(self, ids: list[str], progress: Callable[[int, int], None] | None) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.error is not None:
                    raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                if out.finished:
                    done[out.request_id] = out
                    if progress:
                        progress(len(done), len(ids))
            if not self.engine.has_unfinished_requests() and len(done) < len(ids):
                raise RuntimeError("the engine stopped with requests unfinished")
        return [done[i] for i in ids]


def _prompt_input(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    raise ValueError("a prompt is a string or {'prompt_token_ids': [...]}")
