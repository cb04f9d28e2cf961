"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}, with the right status."""
from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
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


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> ErrorResponse:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=code))


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code).model_dump(), status_code=status)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first validation problem as a sentence, plus the parameter it concerns."""
    err = exc.errors()[0]
    param = _field_path(err.get("loc", ()))
    kind = err.get("type", "")
    if kind == "json_invalid":
        return "request body is not valid JSON", None
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if kind == "missing":
        return f"'{param}' is a required property", param
    if kind == "model_attributes_type":
        return "request body must be a JSON object sent as Content-Type: application/json", None
    message = err.get("msg", "invalid request").removeprefix("Value error, ")
    return (f"{message} (parameter '{param}')" if param else message), param


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _field_path(loc: tuple) -> str | None:
    """'messages.0.role' from pydantic's loc, dropping 'body' and the branch tags unions add."""
    parts = []
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        text = str(part)
        if text in _TYPE_TAGS or "[" in text or "-" in text:
            break
        parts.append(text)
    return ".".join(parts) or None


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body().model_dump(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = 400 if exc.status_code == 422 else exc.status_code
        detail = exc.detail if isinstance(exc.detail, str) else HTTPStatus(status).phrase
        return error_response(status, detail)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(500, f"internal server error: {type(exc).__name__}", code="internal_error")
