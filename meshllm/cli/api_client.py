"""Small blocking helpers for commands that talk to a running node's HTTP API.

Every wait has a deadline: connecting and reading are bounded by timeouts, and an event stream
that stays silent for ``idle_timeout`` seconds simply ends, so a caller can reconnect or give up.
When nothing listens at the URL, every helper raises the same :class:`NodeUnreachable`, whose
message tells the user how to start a node; the CLI prints it as one line.

Every call carries the caller's secret as ``Authorization: Bearer``: an API key when one is given
(``--api-key``, ``$MESHLLM_API_KEY``), else the node's admin token read from its home (``--home``,
``$MESHLLM_HOME``, ``~/.meshllm``), which only the user running that node can read.

Proxy variables from the environment are ignored on purpose: the API binds 127.0.0.1 by default,
and a stray ``HTTP_PROXY`` would otherwise send local calls to a proxy that cannot reach them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from meshllm.config import ADMIN_TOKEN_FILE, DEFAULT_API_PORT, read_admin_token, resolve_home
from meshllm.errors import MeshllmError

DEFAULT_API = f"http://127.0.0.1:{DEFAULT_API_PORT}"

Event = dict[str, Any]


class NodeUnreachable(MeshllmError):
    """Nothing answers at the node's API URL (no node running there, or it stopped answering)."""


class NodeApiError(MeshllmError):
    """Something answered at the URL, but not with what a meshllm node sends."""


def unreachable(api: str) -> NodeUnreachable:
    """The one error for "no node at this URL", worded the same for every command."""
    return NodeUnreachable(f"no meshllm node is running at {api} (start one with `meshllm serve`)")


@dataclass(frozen=True)
class NodeApi:
    """A running node's API: its base URL and the secret every call sends."""

    url: str
    secret: str | None = None
    """An API key or the node's admin token (``None``: calls go without one)."""
    source: str = ""
    """Where the secret came from, for error messages (``--api-key``, a token file)."""

    @classmethod
    def for_cli(cls, url: str, api_key: str | None, home: Path | None) -> NodeApi:
        """``--api-key`` if given, else the admin token in the home, else no secret."""
        if api_key:
            return cls(url, api_key, "--api-key")
        folder = resolve_home(home)
        token = read_admin_token(folder)
        return cls(url, token, str(folder / ADMIN_TOKEN_FILE) if token else "")

    def __str__(self) -> str:
        return self.url

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.secret}"} if self.secret else {}

    def get_json(self, path: str, timeout: float = 5.0) -> Any:
        """GET ``path`` and decode its JSON body, mapping every failure to a meshllm error."""
        return self.request_json(path, timeout=timeout)

    def post_json(self, path: str, body: Any, timeout: float = 5.0) -> Any:
        """POST ``body`` as JSON to ``path`` and decode the JSON answer (errors as in :meth:`get_json`)."""
        return self.request_json(path, method="POST", body=body, timeout=timeout)

    def request_json(self, path: str, *, method: str = "GET", body: Any = None, timeout: float = 5.0) -> Any:
        """One JSON request to the node's API; every failure becomes a meshllm error naming what to do."""
        try:
            with _client(httpx.Timeout(timeout)) as client:
                response = client.request(method, self.url + path, json=body, headers=self._headers())
        except (httpx.ConnectError, httpx.ConnectTimeout):
            raise unreachable(self.url) from None
        except httpx.TimeoutException:
            raise NodeUnreachable(f"the node at {self.url} did not answer {path} within {timeout:g} s",
                                  hint="it may be overloaded or stuck; check its log") from None
        except httpx.HTTPError as exc:
            raise NodeApiError(f"talking to {self.url} failed: {exc}") from None
        self._check(path, response)
        try:
            return response.json()
        except ValueError:
            raise NodeApiError(f"{self.url} answered {path} with something that is not JSON",
                               hint="check --api (or $MESHLLM_API)") from None

    @contextmanager
    def events(self, connect_timeout: float = 5.0, idle_timeout: float = 30.0) -> Iterator[Iterator[Event]]:
        """Connect to ``/api/events`` and give an iterator over its events.

        Connecting raises :class:`NodeUnreachable` (nothing answers) or :class:`NodeApiError` (a wrong
        answer). The iterator ends, without an error, when the stream closes, breaks, or stays silent
        for ``idle_timeout`` seconds; the caller decides whether to reconnect.
        """
        with self.stream("GET", "/api/events", connect_timeout=connect_timeout, idle_timeout=idle_timeout) as events:
            yield _until_broken(events)

    @contextmanager
    def stream(self, method: str, path: str, body: Any = None, *, connect_timeout: float = 5.0,
               idle_timeout: float = 30.0) -> Iterator[Iterator[Event]]:
        """One request whose answer is a server-sent-event stream; gives an iterator over its events.

        Connecting fails as :meth:`request_json` does. The iterator raises :class:`NodeApiError` when
        the stream breaks or stays silent for ``idle_timeout`` seconds (:meth:`events` turns that into
        a quiet end). Leaving the block closes the connection, which tells the node to stop.
        """
        timeout = httpx.Timeout(connect_timeout, read=idle_timeout)
        headers = {"Accept": "text/event-stream", **self._headers()}
        try:
            with _client(timeout) as client, client.stream(method, self.url + path, json=body,
                                                           headers=headers) as response:
                if response.is_error:
                    response.read()  # a streamed response's error body must be read before it is reported
                self._check(path, response)
                yield _broken_as_error(self.url, parse_sse(response.iter_lines()), idle_timeout)
        except (httpx.ConnectError, httpx.ConnectTimeout):
            raise unreachable(self.url) from None
        except httpx.HTTPError as exc:
            raise NodeApiError(f"talking to {self.url} failed: {exc}") from None

    def _check(self, path: str, response: httpx.Response) -> None:
        if response.status_code == 404:
            raise NodeApiError(f"{self.url} answered 404 for {path}: is it a meshllm node?",
                               hint="check --api (or $MESHLLM_API)")
        if response.status_code == 401:
            raise NodeApiError(f"the node at {self.url} refused {path}: {_error_message(response)}",
                               hint=self._auth_hint())
        if response.is_error:
            raise NodeApiError(f"the node at {self.url} answered {response.status_code} for {path}: "
                               f"{_error_message(response)}")

    def _auth_hint(self) -> str:
        if not self.secret:
            return ("no admin token was found: run the command as the user that runs the node, with its --home "
                    "(or $MESHLLM_HOME), or pass --api-key")
        return (f"the secret from {self.source} is not valid there: pass the node's --home (its admin.token) "
                "or one of its API keys with --api-key")


def _client(timeout: httpx.Timeout) -> httpx.Client:
    return httpx.Client(timeout=timeout, trust_env=False)


def _error_message(response: httpx.Response) -> str:
    """The message of the node's OpenAI-shaped error body, else the start of the raw body."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200].strip() or response.reason_phrase


def parse_sse(lines: Iterable[str]) -> Iterator[Event]:
    """Decode server-sent-event lines into event dicts (sans-IO, so it is tested without sockets).

    Each event's ``data`` must be one JSON object; its ``type`` falls back to the ``event:`` field.
    Comments (keep-alives), ``id:``/``retry:`` fields and data that is not a JSON object are skipped:
    one bad event must not end a stream the dashboard depends on.
    """
    kind = ""
    data: list[str] = []
    for raw in lines:
        line = raw.rstrip("\r\n")
        if not line:
            if data:
                event = _decode(kind, "\n".join(data))
                if event is not None:
                    yield event
            kind, data = "", []
            continue
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if field == "event":
            kind = value
        elif field == "data":
            data.append(value)


def _decode(kind: str, text: str) -> Event | None:
    try:
        event = json.loads(text)
    except ValueError:
        return None
    if not isinstance(event, dict):
        return None
    if kind:
        event.setdefault("type", kind)
    return event


def _broken_as_error(url: str, events: Iterator[Event], idle_timeout: float) -> Iterator[Event]:
    """Yield from ``events``; a transport failure or silence becomes one :class:`NodeApiError`."""
    try:
        yield from events
    except httpx.ReadTimeout:
        raise NodeApiError(f"the node at {url} sent nothing for {idle_timeout:g} s",
                           hint="it may be overloaded or stuck; check its log") from None
    except httpx.TransportError as exc:
        raise NodeApiError(f"the connection to {url} broke: {exc or type(exc).__name__}") from None


def _until_broken(events: Iterator[Event]) -> Iterator[Event]:
    """Yield from ``events`` and end quietly when the transport fails or goes silent."""
    try:
        yield from events
    except NodeApiError:
        return
