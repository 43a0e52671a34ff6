"""The errors a request can end with, and their OpenAI shape: ``{"error": {"message", "type", "code", "param"}}``.

The serving runtime raises them (an unknown model, no capacity, a failed peer) and carries them through
the request tunnel as a status and this body; :mod:`meshllm.runtime.errors` answers them over HTTP.

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
