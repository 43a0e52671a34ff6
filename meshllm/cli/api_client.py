"""Small blocking helpers for commands that talk to a running node's HTTP API.

Every wait has a deadline: connecting and reading are bounded by timeouts, and an event stream
that stays silent for ``idle_timeout`` seconds simply ends, so a caller can reconnect or give up.
When nothing listens at the URL, every helper raises the same :class:`NodeUnreachable`, whose
message tells the user how to start a node; the CLI prints it as one line.

Proxy variables from the environment are ignored on purpose: the API binds 127.0.0.1 by default,
and a stray ``HTTP_PROXY`` would otherwise send local calls to a proxy that cannot reach them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from meshllm.config import DEFAULT_API_PORT
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


def _client(timeout: httpx.Timeout) -> httpx.Client:
    return httpx.Client(timeout=timeout, trust_env=False)


def _error_message(response: httpx.Response) -> str:
    """The message of the node's OpenAI-shaped error body, else the start of the raw body."""
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200].strip() or response.reason_phrase


def _check(api: str, path: str, response: httpx.Response) -> None:
    if response.status_code == 404:
        raise NodeApiError(f"{api} answered 404 for {path}: is it a meshllm node?",
                           hint="check --api (or $MESHLLM_API)")
    if response.is_error:
        raise NodeApiError(f"the node at {api} answered {response.status_code} for {path}: {_error_message(response)}")


def get_json(api: str, path: str, timeout: float = 5.0) -> Any:
    """GET ``api + path`` and decode its JSON body, mapping every failure to a meshllm error."""
    return request_json(api, path, timeout=timeout)


def post_json(api: str, path: str, body: Any, timeout: float = 5.0) -> Any:
    """POST ``body`` as JSON to ``api + path`` and decode the JSON answer (errors as in :func:`get_json`)."""
    return request_json(api, path, method="POST", body=body, timeout=timeout)


def request_json(api: str, path: str, *, method: str = "GET", body: Any = None, timeout: float = 5.0) -> Any:
    """One JSON request to a node's API; every failure becomes a meshllm error naming what to do."""
    try:
        with _client(httpx.Timeout(timeout)) as client:
            response = client.request(method, api + path, json=body)
    except (httpx.ConnectError, httpx.ConnectTimeout):
        raise unreachable(api) from None
    except httpx.TimeoutException:
        raise NodeUnreachable(f"the node at {api} did not answer {path} within {timeout:g} s",
                              hint="it may be overloaded or stuck; check its log") from None
    except httpx.HTTPError as exc:
        raise NodeApiError(f"talking to {api} failed: {exc}") from None
    _check(api, path, response)
    try:
        return response.json()
    except ValueError:
        raise NodeApiError(f"{api} answered {path} with something that is not JSON",
                           hint="check --api (or $MESHLLM_API)") from None


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


@contextmanager
def open_events(api: str, connect_timeout: float = 5.0, idle_timeout: float = 30.0) -> Iterator[Iterator[Event]]:
    """Connect to ``/api/events`` and give an iterator over its events.

    Connecting raises :class:`NodeUnreachable` (nothing answers) or :class:`NodeApiError` (a wrong
    answer). The iterator ends, without an error, when the stream closes, breaks, or stays silent
    for ``idle_timeout`` seconds; the caller decides whether to reconnect.
    """
    timeout = httpx.Timeout(connect_timeout, read=idle_timeout)
    try:
        with _client(timeout) as client, client.stream(
            "GET", api + "/api/events", headers={"Accept": "text/event-stream"}
        ) as response:
            if response.is_error:
                response.read()  # a streamed response's error body must be read before it is reported
            _check(api, "/api/events", response)
            yield _until_broken(parse_sse(response.iter_lines()))
    except (httpx.ConnectError, httpx.ConnectTimeout):
        raise unreachable(api) from None
    except httpx.HTTPError as exc:
        raise NodeApiError(f"talking to {api} failed: {exc}") from None


def _until_broken(events: Iterator[Event]) -> Iterator[Event]:
    """Yield from ``events`` and end quietly when the transport fails or goes silent."""
    try:
        yield from events
    except httpx.TransportError:
        return
