"""Errors as the OpenAI API shapes them: ``{"error": {"message", "type",
"param", "code"}}`` with 400 for invalid requests (FastAPI's 422 included),
404 for an unknown model, 503 with ``Retry-After`` when overloaded and 500
for a server fault."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from mstar.serve.protocol import ParamError

log = logging.getLogger(__name__)
TYPES = {400: "invalid_request_error", 404: "not_found_error", 503: "server_overloaded"}


class APIError(Exception):
    """An error response: ``status``, and the body's fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict:
        kind = TYPES.get(
            self.status, "server_error" if self.status >= 500 else "invalid_request_error"
        )
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def install(app: FastAPI) -> None:
    """Route every error the app can raise to the OpenAI error body."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return err.response()

    @app.exception_handler(ParamError)
    async def bad_param(request: Request, err: ParamError) -> JSONResponse:
        return APIError(400, str(err), param=err.param).response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        return from_validation(err).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        return APIError(err.status_code, str(err.detail), headers=err.headers).response()

    @app.exception_handler(Exception)
    async def fault(request: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal server error: {err!r}").response()


def from_validation(err: RequestValidationError) -> APIError:
    """The first problem pydantic found, its location as ``param``
    (``messages.0.content``); a body that is not JSON names no param."""
    first = err.errors()[0]
    if first["type"] == "json_invalid":
        return APIError(
            400, f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}"
        )
    loc = [str(part) for part in first["loc"] if part != "body"]
    # a union (str | list[int]) reports each branch; the field is what matters
    loc = [part for part in loc if not _is_type_tag(part)]
    param = ".".join(loc) or None
    got = first.get("input")
    return APIError(400, f"{param or 'body'}: {first['msg']}, got {got!r:.80}", param=param)


def _is_type_tag(part: str) -> bool:
    return part in ("str", "int", "float", "bool") or part.startswith(("list[", "function-"))
