"""OpenAI-shaped HTTP errors: every failure the app can produce leaves as ``{"error": {...}}``.

OpenAI clients (the official SDKs, LangChain, curl scripts) read ``error.message`` and switch on
the status, so every failure, including FastAPI's own validation errors, malformed JSON and
exceptions nobody expected, leaves in that shape. A traceback never reaches a client: unexpected
exceptions are logged (:func:`~meshllm.runtime.errors.error_for`) and answered with a plain 500.
The errors themselves and their body are the runtime's (:mod:`meshllm.runtime.errors`).
"""

from __future__ import annotations

from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from meshllm.errors import MeshllmError
from meshllm.runtime.errors import error_body, error_for

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
