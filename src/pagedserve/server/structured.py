"""A request body's output constraint: OpenAI's response_format or one of vLLM's guided_* fields."""
from __future__ import annotations

import asyncio

from pagedserve.sampling_params import GuidedDecodingParams
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import SamplingFields

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def guided_spec(req: SamplingFields) -> tuple[GuidedDecodingParams | None, str | None]:
    """The constraint the body asks for and the field that asked (for error messages), or (None, None)."""
    given = [f for f in GUIDED_FIELDS if getattr(req, f) is not None]
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        given.insert(0, "response_format")
    if not given:
        return None, None
    if len(given) > 1:
        raise APIError(400, f"give at most one output constraint; got {', '.join(given)}", given[1])
    param = given[0]
    try:
        return _spec(req, param), param
    except ValueError as exc:
        raise APIError(400, str(exc), param) from None


def _spec(req: SamplingFields, param: str) -> GuidedDecodingParams:
    if param == "response_format":
        schema = req.response_format.json_schema.schema_ if req.response_format.json_schema else None
        return GuidedDecodingParams(json=schema) if schema is not None else GuidedDecodingParams(json_object=True)
    if param == "guided_json":  # an object or its JSON text: GuidedDecodingParams reads and checks both
        return GuidedDecodingParams(json=req.guided_json)
    if param == "guided_regex":
        return GuidedDecodingParams(regex=req.guided_regex)
    if param == "guided_choice":
        return GuidedDecodingParams(choice=list(req.guided_choice))
    return GuidedDecodingParams(grammar=req.guided_grammar)


async def compile_spec(engine, spec: GuidedDecodingParams, param: str | None) -> None:
    """Compiles (and so validates) a constraint off the event loop and off the engine's step thread; the engine
    then finds it cached. An invalid schema, regex or grammar is a 400 naming the field."""
    try:
        await asyncio.wrap_future(engine.grammars.submit(spec))
    except ValueError as exc:
        raise APIError(400, str(exc), param) from None
