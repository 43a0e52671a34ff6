"""OpenAI-shaped errors: ``{"error": {"message", "type", "code", "param"}}`` with a fitting status.

OpenAI clients (the official SDKs, LangChain, curl scripts) read ``error.message`` and switch on
the status, so every failure, including FastAPI's own validation errors, malformed JSON and
exceptions nobody expected, leaves in that shape. A traceback never reaches a client: unexpected
exceptions are logged here and answered with a plain 500.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, ClassVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from meshllm.engine.base import BadChat, EngineBusy, EngineNotLoaded, InvalidRequest, PromptTooLong, Unsupported
from meshllm.errors import MeshllmError

log = logging.getLogger(__name__)


class ApiError(MeshllmError):
    """An error with an HTTP status and OpenAI's ``type``/``code``; subclasses fix all three."""

    status = 500
    type = "server_error"
    code = "internal_error"
    headers: ClassVar[Mapping[str, str] | None] = None
    """Response headers the status needs (``WWW-Authenticate`` on a 401)."""


class BadRequest(ApiError):
    """The request is well-formed JSON but asks for something we do not do; ``param`` names the field."""

    status, type, code = 400, "invalid_request_error", "invalid_request"

    def __init__(self, message: str, *, param: str | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint)
        self.param = param


class Unauthorized(ApiError):
    """The request carries no valid API key or admin token for a route that needs one."""

    status, type, code = 401, "invalid_request_error", "invalid_api_key"
    headers: ClassVar[Mapping[str, str] | None] = {"WWW-Authenticate": 'Bearer realm="meshllm"'}


class HostNotAllowed(ApiError):
    """The ``Host`` header names a host this node does not answer for (a DNS-rebinding page sends one)."""

    status, type, code = 403, "invalid_request_error", "host_not_allowed"


class OriginNotAllowed(ApiError):
    """A web page of an origin this node does not trust tried to change something."""

    status, type, code = 403, "invalid_request_error", "origin_not_allowed"


class RequestTimeout(ApiError):
    """The client did not send its request body within the deadline."""

    status, type, code = 408, "invalid_request_error", "request_timeout"


class UnknownModel(ApiError):
    """No node in the mesh serves the requested model."""

    status, type, code = 404, "invalid_request_error", "model_not_found"
    hint = "GET /v1/models lists the models this mesh serves"


class BodyTooLarge(ApiError):
    """The request body exceeds the API's size limit."""

    status, type, code = 413, "invalid_request_error", "request_too_large"


class NoCapacity(ApiError):
    """Every node that could serve the request is busy or unreachable."""

    status, type, code = 503, "server_error", "no_capacity"
    hint = "retry later, or add nodes serving this model"


class Saturated(ApiError):
    """Every slot that could serve the request is taken and its wait would be too long, or its client
    already holds its share of the queue: 429 with ``Retry-After`` (OpenAI clients retry it)."""

    status, type, code = 429, "rate_limit_error", "rate_limit_exceeded"
    hint = "retry after the number of seconds in the Retry-After header"

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    @property
    def headers(self) -> dict[str, str]:
        """``Retry-After`` in whole seconds (at least 1)."""
        return {"retry-after": str(max(1, math.ceil(self.retry_after_s)))}


class UpstreamError(ApiError):
    """The peer serving the request failed after accepting it."""

    status, type, code = 502, "server_error", "upstream_error"


class UpstreamTimeout(ApiError):
    """The peer serving the request did not answer within its deadline."""

    status, type, code = 504, "server_error", "upstream_timeout"


_ENGINE_ERRORS: tuple[tuple[type[MeshllmError], int, str, str], ...] = (
    (PromptTooLong, 400, "invalid_request_error", "context_length_exceeded"),
    (BadChat, 400, "invalid_request_error", "invalid_messages"),
    (Unsupported, 400, "invalid_request_error", "unsupported_parameter"),
    (InvalidRequest, 400, "invalid_request_error", "invalid_request"),
    (EngineBusy, 503, "server_error", "no_capacity"),
    (EngineNotLoaded, 503, "server_error", "model_not_loaded"),
)


def classify(exc: BaseException) -> tuple[int, str, str]:
    """``(status, type, code)`` for any exception; unknown ones are a 500."""
    if isinstance(exc, ApiError):
        return exc.status, exc.type, exc.code
    for cls, status, type_, code in _ENGINE_ERRORS:
        if isinstance(exc, cls):
            return status, type_, code
    return 500, "server_error", "internal_error"


def error_body(message: str, type_: str, code: str, param: str | None = None) -> dict[str, Any]:
    """The JSON OpenAI sends for an error."""
    return {"error": {"message": message, "type": type_, "code": code, "param": param}}


def error_for(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """Status and body for ``exc``; the message of an unexpected exception is not exposed."""
    status, type_, code = classify(exc)
    if isinstance(exc, MeshllmError):
        message = f"{exc} ({exc.hint})" if exc.hint else str(exc)
    else:
        log.error("unexpected error while serving a request", exc_info=exc)
        message = "internal error (see the node's log)"
    return status, error_body(message, type_, code, getattr(exc, "param", None))


BUSY_RETRY_AFTER_S = 1
"""``Retry-After`` of a 503 that names no wait of its own: no capacity now, or a model still loading."""


def error_headers(exc: BaseException, status: int) -> Mapping[str, str] | None:
    """The headers an error answer carries: those ``exc`` names, else ``Retry-After`` on a 503, so a
    client (OpenAI's and Anthropic's retry 503s) comes back after a second rather than at once."""
    headers = getattr(exc, "headers", None)
    if headers is None and status == 503:
        return {"retry-after": str(BUSY_RETRY_AFTER_S)}
    return headers


def error_response(exc: BaseException) -> JSONResponse:
    """A JSONResponse for ``exc`` (with the headers :func:`error_headers` gives it)."""
    status, body = error_for(exc)
    return JSONResponse(body, status_code=status, headers=error_headers(exc, status))


def _validation_response(exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        return JSONResponse(error_body("request body is not valid JSON", "invalid_request_error", "invalid_json"),
                            status_code=400)
    unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
    first = unknown[0] if unknown else errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_union_tag(p)]
    param = ".".join(loc) or None
    if unknown:  # OpenAI's answer to a field it does not know, word for word
        return JSONResponse(error_body(f"Unrecognized request argument supplied: {param}", "invalid_request_error",
                                       "unknown_parameter", param), status_code=400)
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg", "invalid request"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problems)"
    return JSONResponse(error_body(message, "invalid_request_error", "invalid_value", param), status_code=422)


def _is_union_tag(part: object) -> bool:
    """pydantic names the union member that failed in ``loc`` (``str``, ``list[str]``): not a field."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "literal"})


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app can produce OpenAI-shaped."""

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return _validation_response(exc)

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), type_, code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    async def on_error(_: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(MeshllmError, on_error)
    app.add_exception_handler(Exception, on_error)
