"""Every gateway error leaves in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 kind: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.kind = kind or ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def bad_parameter(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = (exc.errors() or [{}])[0]
        param = str(err.get("loc", ("", ""))[-1]) or None
        return APIError(400, f"{err.get('msg', 'invalid parameter')} (parameter '{param}')", param=param,
                        code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        if type(exc).__module__.startswith(("redis", "sqlite3")):  # limits can't be checked: fail closed
            log.error("state store unavailable on %s %s: %r", request.method, request.url.path, exc)
            return APIError(503, f"the gateway's state store is unavailable ({type(exc).__name__}); retry later",
                            code="store_unavailable").response()
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal gateway error: {type(exc).__name__}").response()
