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
    """Checks a constraint (compiling it, off the event loop and the engine's step thread) once per distinct spec;
    the engine then compiles each request's own matcher. A spec that is invalid, past a limit, or slower to
    compile than --grammar-compile-timeout is a 400 naming the field, and is refused at once from then on."""
    grammars = engine.grammars
    try:  # shielded: a spec's check is shared by the requests that wait for it, and runs on if one gives up
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(grammars.check(spec))),
                               grammars.limits.compile_timeout)
    except TimeoutError:
        reason = (f"it did not compile within {grammars.limits.compile_timeout:g} s (--grammar-compile-timeout); "
                  "simplify it")
        grammars.refuse(spec, reason)
        raise APIError(400, f"{param}: invalid {spec.key[0]} constraint: {reason}", param) from None
    except ValueError as exc:
        raise APIError(400, f"{param}: {exc}", param) from None
