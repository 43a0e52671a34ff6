"""Who may call the node's HTTP API: the admin token, API keys, and the route dependencies that check them.

Two kinds of secret open the API, both sent as ``Authorization: Bearer <secret>`` (OpenAI's clients)
or ``x-api-key: <secret>`` (Anthropic's):

- the **admin token**, which the node writes at first start to ``$MESHLLM_HOME/admin.token``
  (mode 0600, in a 0700 folder): whoever can read it is the node's operator. The CLI reads it from
  the home; ``meshllm console`` hands it to the web console in the URL fragment;
- **API keys** (``meshllm serve --api-key``), for clients on other machines. An API key is a full
  credential: it also authorises management calls.

Routes declare what they need with one of two dependencies:

- :func:`require_api_key`: the OpenAI/Anthropic surfaces (``/v1/*``) and the read-only node routes
  (``/api/status``, ``/api/events``, ...). Open while no API key is configured (a node whose API
  only listens on loopback), else the caller needs an API key or the admin token;
- :func:`require_admin`: every route that changes the node or the mesh (invites, revocations,
  publishing, model load/unload, owner commands). Always needs the admin token or an API key.

Secrets travel only in request headers, never in cookies: a browser never attaches them to a
request on its own, so a web page cannot borrow the user's authority (no CSRF), and a cross-origin
page cannot even send the header without passing CORS.

Both dependencies declare their secrets as OpenAPI security schemes, so ``/docs`` shows them (and
its "Authorize" button works) and :func:`audit_routes` can check every route through the public
OpenAPI schema: an app in which any ``/api/`` or ``/v1/`` route, or any state-changing route, has
no guard is refused, so a route added later cannot be left open by mistake.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request, Security
from fastapi.security import APIKeyHeader, HTTPBearer

from meshllm.errors import ConfigError
from meshllm.runtime.errors import Unauthorized

SAFE_METHODS = frozenset({"get", "head", "options"})
GUARDED_PREFIXES = ("/api/", "/v1/")
MIN_API_KEY_CHARS = 16

_KEY_BEARER = HTTPBearer(scheme_name="KeyBearer", auto_error=False,
                         description="An API key (`meshllm serve --api-key`) or the node's admin token; "
                                     "needed only when the node has an API key.")
_KEY_HEADER = APIKeyHeader(name="x-api-key", scheme_name="KeyHeader", auto_error=False,
                           description="The same secret as an `x-api-key` header (Anthropic's clients).")
_ADMIN_BEARER = HTTPBearer(scheme_name="AdminBearer", auto_error=False,
                           description="The node's admin token (`$MESHLLM_HOME/admin.token`) or an API key.")
_ADMIN_HEADER = APIKeyHeader(name="x-api-key", scheme_name="AdminHeader", auto_error=False,
                             description="The same secret as an `x-api-key` header.")
ADMIN_SCHEMES = frozenset({"AdminBearer", "AdminHeader"})
KEY_SCHEMES = frozenset({"KeyBearer", "KeyHeader"})


@dataclass(frozen=True)
class ApiAccess:
    """The secrets this node's API accepts."""

    admin_token: str | None = None
    """The node's admin token (``None``: nobody can make management calls without an API key)."""
    api_keys: tuple[str, ...] = ()
    """API keys; when there is at least one, every guarded route needs a secret."""

    @property
    def keys_required(self) -> bool:
        """Whether read routes and ``/v1/*`` need a secret too."""
        return bool(self.api_keys)

    def accepts(self, presented: list[str]) -> bool:
        """Whether any presented secret is the admin token or an API key (constant-time comparisons)."""
        known = [s.encode() for s in (self.admin_token, *self.api_keys) if s]
        ok = False
        for secret in presented:
            for candidate in known:
                ok |= hmac.compare_digest(secret.encode("utf-8", "surrogateescape"), candidate)
        return ok


def check_api_key(key: str) -> str:
    """An API key as given on the command line, or :class:`ConfigError` saying what is wrong with it."""
    if len(key) < MIN_API_KEY_CHARS:
        raise ConfigError(f"an API key needs at least {MIN_API_KEY_CHARS} characters (got {len(key)})",
                          hint="make one with: python -c 'import secrets; print(secrets.token_urlsafe(24))'")
    if not key.isascii() or not key.isprintable() or " " in key:
        raise ConfigError("an API key must be printable ASCII without spaces (it travels in an HTTP header)")
    return key


def presented_secrets(request: Request) -> list[str]:
    """The secrets a request carries: the Bearer credential and the ``x-api-key`` header."""
    found = []
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        found.append(value.strip())
    if key := request.headers.get("x-api-key", "").strip():
        found.append(key)
    return found


def _access(request: Request) -> ApiAccess:
    access = getattr(request.app.state, "access", None)
    return access if isinstance(access, ApiAccess) else ApiAccess()


def may_read(request: Request) -> bool:
    """Whether ``request`` may see what :func:`require_api_key` guards (for routes that answer anyone, in part)."""
    access = _access(request)
    return not access.keys_required or access.accepts(presented_secrets(request))


async def require_api_key(request: Request, _bearer: object = Security(_KEY_BEARER),
                          _header: object = Security(_KEY_HEADER)) -> None:
    """Dependency of ``/v1/*`` and read routes: an API key or the admin token, once API keys are configured."""
    access = _access(request)
    if access.keys_required:
        _check(access, request, "this node's API needs an API key")


async def require_admin(request: Request, _bearer: object = Security(_ADMIN_BEARER),
                        _header: object = Security(_ADMIN_HEADER)) -> None:
    """Dependency of every state-changing route: the node's admin token or an API key, always."""
    _check(_access(request), request, "this call changes the node or its mesh: it needs the node's admin token "
                                      "or an API key")


def check_admin(request: Request) -> None:
    """:func:`require_admin` for a route that is not a FastAPI endpoint (``/mcp``, an ASGI app)."""
    _check(_access(request), request, "this endpoint speaks for the node: it needs the node's admin token "
                                      "or an API key")


def _check(access: ApiAccess, request: Request, need: str) -> None:
    presented = presented_secrets(request)
    if not presented:
        raise Unauthorized(f"{need} (send Authorization: Bearer <secret>, or x-api-key)", hint=_HINT)
    if not access.accepts(presented):
        raise Unauthorized("the API key or admin token sent is not valid for this node", hint=_HINT)


_HINT = ("the meshllm CLI reads the admin token from the node's home (--home or $MESHLLM_HOME, as the user "
         "that runs the node); clients pass an API key set with `meshllm serve --api-key`")


def document_access(app: FastAPI, access: ApiAccess) -> None:
    """Make ``/openapi.json`` say what this node asks for: without API keys, the key is optional on ``/v1``.

    OpenAPI writes "optional" as an empty security requirement next to the schemes; admin routes
    never get one (they always need a secret).
    """
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            if not access.keys_required:
                for item in schema.get("paths", {}).values():
                    for operation in item.values():
                        security = operation.get("security") if isinstance(operation, dict) else None
                        names = {name for requirement in security or [] for name in requirement}
                        if names and names <= KEY_SCHEMES:
                            security.append({})
        return app.openapi_schema or generate()

    app.openapi = openapi  # type: ignore[method-assign]


def audit_routes(app: FastAPI) -> None:
    """Refuse an app with an unguarded route: each ``/api/``/``/v1/`` route needs a guard, each state change admin.

    Reads the app's OpenAPI schema (routes hidden from it are not checked: keep management routes
    in it). Raises :class:`ConfigError` naming every offending route, so a route added without a
    guard fails every test that builds the app instead of shipping open.
    """
    problems = []
    for path, item in app.openapi().get("paths", {}).items():
        for method, operation in item.items():
            if not isinstance(operation, dict):
                continue
            schemes = {name for requirement in operation.get("security", []) for name in requirement}
            if method not in SAFE_METHODS and not path.startswith("/v1/") and not schemes & ADMIN_SCHEMES:
                problems.append(f"{method.upper()} {path} changes state without require_admin")
            elif path.startswith(GUARDED_PREFIXES) and not schemes & (ADMIN_SCHEMES | KEY_SCHEMES):
                problems.append(f"{method.upper()} {path} has no require_api_key")
    app.openapi_schema = None  # routes included later must show in /openapi.json too
    if problems:
        raise ConfigError("unguarded API routes: " + "; ".join(problems),
                          hint="add dependencies=[Depends(require_admin)] or [Depends(require_api_key)] "
                               "(meshllm/api/auth.py)")
