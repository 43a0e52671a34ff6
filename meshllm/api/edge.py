"""Where requests may come from: the ``Host`` they name and the web origin of the page that sends them.

**DNS rebinding.** A web page on ``evil.example`` can point its own name at 127.0.0.1 and then read
and call the node's API as if it were same-origin; the only trace is the ``Host`` header, which
still says ``evil.example``. So a request must name this node: ``localhost``, an IP literal (a
literal cannot be rebound), a name the node binds to, or one the operator allowed
(``--allowed-host``). Anything else is a 403 before any route runs.

**Web origins.** CORS lets pages from the configured origins (and, by default, pages served from
this machine's loopback addresses) read the API. CORS only decides what a page may *read*; to make
cross-site request forgery impossible as well, a state-changing request whose ``Origin`` is
neither allowed nor the node itself is refused outright (403). Management routes also need a
bearer secret (:mod:`meshllm.api.auth`) that no foreign page has.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from meshllm.errors import ConfigError
from meshllm.runtime.errors import HostNotAllowed, OriginNotAllowed, error_for

LOOPBACK_NAMES = frozenset({"localhost"})
LOOPBACK_ORIGIN_RE = r"https?://(localhost|127(\.\d{1,3}){3}|\[::1\])(:\d{1,5})?"
"""Pages served from this machine's loopback addresses, any port."""
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def host_name(host_header: str) -> str:
    """The host part of a ``Host`` header or origin netloc, lowercased: ``[::1]:9337`` -> ``::1``."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def is_loopback_host(host: str) -> bool:
    """Whether a bind address or host name stays on this machine (``localhost``, 127.0.0.0/8, ``::1``)."""
    name = host_name(host)
    if name in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class EdgePolicy:
    """Which ``Host`` names and web origins the node's API answers."""

    host_names: frozenset[str] = LOOPBACK_NAMES
    """Names a ``Host`` header may carry (IP literals are always fine: they cannot be rebound)."""
    any_host: bool = False
    """``--allowed-host '*'``: no ``Host`` check (behind a proxy that checks it)."""
    cors_origins: tuple[str, ...] = ()
    """Origins (``scheme://host[:port]``) whose pages may use the API, besides loopback pages."""
    any_origin: bool = False
    """``--cors-origin '*'``: pages of any origin may use the API (they still need a key for most of it)."""
    _origins: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_origins", frozenset(o.lower() for o in self.cors_origins))

    @classmethod
    def build(cls, bind_host: str, allowed_hosts: Iterable[str] = (), cors_origins: Iterable[str] = ()) -> EdgePolicy:
        """The policy for an API bound to ``bind_host``, with the operator's extra hosts and origins."""
        hosts = [h.strip().lower() for h in allowed_hosts if h.strip()]
        origins = [check_origin(o) for o in cors_origins]
        names = set(LOOPBACK_NAMES) | {host_name(h) for h in hosts if h != "*"}
        if bind_host and not is_ip_literal(host_name(bind_host)):
            names.add(host_name(bind_host))
        return cls(host_names=frozenset(names), any_host="*" in hosts,
                   cors_origins=tuple(o for o in origins if o != "*"), any_origin="*" in origins)

    def allows_host(self, host_header: str | None) -> bool:
        """Whether a request naming ``host_header`` is for this node (no header: not from a browser)."""
        if self.any_host or host_header is None:
            return True
        name = host_name(host_header)
        return name in self.host_names or is_ip_literal(name)

    def allows_origin(self, origin: str, host_header: str | None) -> bool:
        """Whether a page of ``origin`` may change state here: allowed, loopback, or the node itself."""
        origin = origin.strip().lower()
        if self.any_origin or origin in self._origins or re.fullmatch(LOOPBACK_ORIGIN_RE, origin):
            return True
        netloc = urlsplit(origin).netloc
        return bool(netloc) and host_header is not None and netloc == host_header.strip().lower()


def check_origin(origin: str) -> str:
    """A ``--cors-origin`` value: ``*`` or ``scheme://host[:port]`` with nothing after it."""
    value = origin.strip().rstrip("/")
    if value == "*":
        return value
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path or parts.query or parts.fragment:
        raise ConfigError(f"{origin!r} is not a web origin like https://app.example.com or http://localhost:3000")
    return value


class EdgeGuard:
    """ASGI middleware: 403 for a foreign ``Host``, and for a state change from a foreign web page."""

    def __init__(self, app: ASGIApp, policy: EdgePolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode(): v.decode("latin-1") for k, v in scope.get("headers") or [] if k in (b"host", b"origin")}
        host = headers.get("host")
        if not self.policy.allows_host(host):
            await _refuse(scope, send, HostNotAllowed(
                f"this node does not answer for host {host_name(host or '')!r}",
                hint="call it by IP address or localhost, or start it with --allowed-host NAME"))
            return
        origin = headers.get("origin")
        if scope["method"] not in SAFE_METHODS and origin is not None and not self.policy.allows_origin(origin, host):
            await _refuse(scope, send, OriginNotAllowed(
                f"pages from {origin[:100]!r} may not change anything on this node",
                hint="allow the page's origin with `meshllm serve --cors-origin ORIGIN`"))
            return
        await self.app(scope, receive, send)


async def _refuse(scope: Scope, send: Send, exc: Exception) -> None:
    status, body = error_for(exc)
    await JSONResponse(body, status_code=status)(scope, _disconnected, send)


async def _disconnected() -> dict[str, str]:
    return {"type": "http.disconnect"}


def add_edge(app: Starlette, policy: EdgePolicy) -> None:
    """Put CORS and the :class:`EdgeGuard` around ``app`` (call it last: the guard runs first).

    CORS is Starlette's middleware for ``policy``: no cookies, any request header (browser SDKs send
    their own), preflights cached for 10 minutes.
    """
    app.add_middleware(
        CORSMiddleware, allow_origins=["*"] if policy.any_origin else list(policy.cors_origins),
        allow_origin_regex=None if policy.any_origin else LOOPBACK_ORIGIN_RE,
        allow_methods=["*"], allow_headers=["*"], allow_credentials=False, expose_headers=["Retry-After"],
        max_age=600,
    )
    app.add_middleware(EdgeGuard, policy=policy)
