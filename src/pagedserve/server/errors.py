"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}, with the right status."""
from __future__ import annotations

import collections
import logging
import re
import uuid
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)
REQUEST_ID_HEADER = "x-request-id"
_PLAIN_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> ErrorResponse:
        return error_body(self.status, self.message, self.param, self.code)


def printable(text: str) -> str:
    """text with lone UTF-16 surrogates written as \\udXXX escapes: JSON may carry them, UTF-8 cannot,
    and an error message that quotes the client's input must still be encodable."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> ErrorResponse:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return ErrorResponse(error=ErrorInfo(message=printable(message), type=kind,
                                         param=None if param is None else printable(param), code=code))


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code).model_dump(), status_code=status, headers=headers)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The most telling validation problem as a sentence, plus the parameter it concerns."""
    err = _most_telling(exc.errors())
    param, item = _field_path(err.get("loc", ()))
    kind = err.get("type", "")
    if kind == "json_invalid":
        return "request body is not valid JSON", None
    if kind == "extra_forbidden":  # the unknown key itself, whatever it looks like (its loc's last part)
        loc = err.get("loc", ())
        param = ".".join(str(p) for p in (loc[1:] if loc[:1] == ("body",) else loc)) or param
        return f"Unrecognized request argument supplied: {param}", param
    if kind == "missing":
        if param is None:
            return "the request body is missing: send a JSON object as Content-Type: application/json", None
        return f"'{param}' is a required property", param
    if kind == "string_unicode":  # e.g. a lone surrogate in a field's name, which pydantic cannot even read
        return "the request body holds text that is not valid Unicode (a lone UTF-16 surrogate)", param
    if kind == "model_attributes_type":
        return "request body must be a JSON object sent as Content-Type: application/json", None
    message = err.get("msg", "invalid request").removeprefix("Value error, ")
    where = f"'{param}'" + (f", at {param}{item}" if item else "")
    return (f"{message} (parameter {where})" if param else message), param


def _most_telling(errors: list[dict]) -> dict:
    """The error of the first failing field that explains it best. A union field fails once per branch
    (stop as a string and as a list): the one the client meant is a branch of the value's JSON type, with
    the fewest errors; there a wrong value says more than a wrong type, and a later item than an earlier."""
    first = _field_path(errors[0].get("loc", ()))[0]
    same_field = [e for e in errors if _field_path(e.get("loc", ()))[0] == first]
    per_branch = collections.Counter(_branch(e.get("loc", ())) for e in same_field)

    def score(err: dict) -> tuple:
        loc, wrong_type = err.get("loc", ()), err.get("type", "").endswith(("_type", "_parsing"))
        items = [p for p in _branch_rest(loc) if isinstance(p, int)]
        return not (wrong_type and not items), -per_branch[_branch(loc)], not wrong_type, items

    return max(same_field, key=score)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _is_tag(part: object) -> bool:
    text = str(part)
    return text in _TYPE_TAGS or "[" in text or "-" in text


def _branch(loc: tuple) -> str | None:
    return next((part for part in loc if isinstance(part, str) and _is_tag(part)), None)


def _branch_rest(loc: tuple) -> tuple:
    """The part of loc after a union's branch tag (where in the value the branch failed)."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and _is_tag(part):
            return tuple(loc[i + 1:])
    return ()


def _field_path(loc: tuple) -> tuple[str | None, str]:
    """('messages.0.role', '') from pydantic's loc, dropping 'body'; a union's branch tag ends the
    parameter, and the indices after it come back as '[0][1]'."""
    parts = []
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if _is_tag(part):
            break
        parts.append(str(part))
    item = "".join(f"[{p}]" for p in _branch_rest(loc) if isinstance(p, int))
    return ".".join(parts) or None, item


def request_id(request: Request) -> str:
    """The client's x-request-id when it is a plain token, else a new one: what ties a log line to an answer."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    return given if _PLAIN_ID.fullmatch(given) else uuid.uuid4().hex[:16]


def _answered(request: Request, status: int, body: ErrorResponse, headers: dict[str, str] | None) -> JSONResponse:
    """The error as sent; a client's error (4xx) also gets one log line saying why, and the request id in a
    header, so that the reason is in the log and not only in the body."""
    response = JSONResponse(body.model_dump(), status_code=status, headers=headers)
    if 400 <= status < 500:
        rid = request_id(request)
        response.headers[REQUEST_ID_HEADER] = rid
        error = body.error
        logger.info("%s %s -> %d %s param=%r code=%s request=%s: %r", request.method, request.url.path, status,
                    error.type, error.param, error.code, rid, error.message[:300])
    return response


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _answered(request, exc.status, exc.body(), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return _answered(request, 400, error_body(400, message, param), None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = 400 if exc.status_code == 422 else exc.status_code
        detail = exc.detail if isinstance(exc.detail, str) else HTTPStatus(status).phrase
        return _answered(request, status, error_body(status, detail), exc.headers)  # a 405 keeps its Allow

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(500, f"internal server error: {type(exc).__name__}", code="internal_error")
