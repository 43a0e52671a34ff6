"""The node's MCP server at ``/mcp`` (streamable HTTP, the official ``mcp`` SDK): the mesh for agents.

Tools: ``blackboard_post``, ``blackboard_search``, ``blackboard_feed`` (the mesh blackboard),
``mesh_status`` (nodes, their models and load), ``mesh_models`` (what the API serves) and ``ask``
(one chat completion on a model of the mesh, routed like any API request: a sub-agent call).

Posting to the blackboard and spending the mesh's compute speak for the node, so ``/mcp`` answers
only callers with the node's admin token or an API key, as the management routes do
(:func:`meshllm.api.auth.check_admin`); the ``Host``/``Origin`` guard and body limit of the rest of
the API apply too. The SDK runs stateless with JSON answers: no session lives between calls, so
nothing is held for a client that went away.

The SDK is imported, and its server built and started, at the first call to ``/mcp`` (0.3 s of
imports a node would otherwise pay at every start: time to serve counts it, issue 24).
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from meshllm import __version__, tasks
from meshllm.api.auth import check_admin
from meshllm.api.blackboard import Board, query_from
from meshllm.api.generation import collect, reply, route_auto, start
from meshllm.api.limits import Admission
from meshllm.api.schemas import ChatCompletionRequest
from meshllm.mesh.blackboard import BoardRefusal
from meshllm.runtime.backend import Backend
from meshllm.runtime.errors import ApiError, error_for

if TYPE_CHECKING:
    from mcp.server.mcpserver import MCPServer
    from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

PATH = "/mcp"
ASK_MAX_TOKENS = 4096
INSTRUCTIONS = (
    "meshllm mesh tools. The blackboard is shared by every node and agent of the mesh for 48 hours: start "
    "notes with STATUS:, QUESTION:, FINDING:, TIP: or DONE:, search before asking, post what others can "
    "reuse. `ask` runs one chat completion on a model of the mesh (see mesh_models)."
)


def build_server(board: Board, status: Callable[[], dict[str, Any]], backend: Backend, admission: Admission,
                 on_event: Callable[..., None] | None = None) -> MCPServer:
    """The MCP server and its tools over the node's parts (``on_event`` hears how ``ask`` routed ``auto``).

    Every tool is a coroutine: the SDK runs plain functions in worker threads, and the node's parts live
    on its event loop.
    """
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError

    server = MCPServer("meshllm", version=__version__, instructions=INSTRUCTIONS)

    @server.tool()
    async def blackboard_post(text: str) -> dict[str, Any]:
        """Post a note to the mesh blackboard (every member sees it for 48 h; 4 KB, 10 a minute).

        Start it with STATUS:, QUESTION:, FINDING:, TIP: or DONE:. E-mail addresses, keys and home
        folders are removed before it leaves this node.
        """
        try:
            return board.post(text).json()
        except BoardRefusal as exc:
            raise ToolError(f"not posted ({exc.code}): {exc}") from None

    @server.tool()
    async def blackboard_search(query: str = "", from_node: str | None = None, since_hours: float | None = None,
                          limit: int = 20) -> dict[str, Any]:
        """Search the blackboard: every word must appear; a KIND: word (QUESTION:, FINDING:, ...) picks the
        kind; from_node is a node name or id; since_hours limits the age. Newest first."""
        since_s = None if since_hours is None else max(0.0, since_hours * 3600)
        notes = board.search(query_from(query, from_node, since_s, None, max(1, min(limit, 500))))
        return {"notes": [n.json() for n in notes]}

    @server.tool()
    async def blackboard_feed(limit: int = 20) -> dict[str, Any]:
        """The latest notes on the blackboard, newest first."""
        return {"notes": [n.json() for n in board.search(query_from(limit=max(1, min(limit, 500))))]}

    @server.tool()
    async def mesh_status() -> dict[str, Any]:
        """This node and every member of its mesh: state, models served, load and RTT."""
        s = status()
        nodes = [{"node_id": s["node_id"], "name": s["name"], "state": "self", "role": s["role"],
                  "models": [m["name"] for m in s["models"]], "load": s["load"]}]
        nodes += [{"node_id": p["node_id"], "name": p["name"], "state": p["state"], "role": p["role"],
                   "models": [m["name"] for m in p["models"]], "load": p["load"], "rtt_ms": p["rtt_ms"]}
                  for p in s["peers"]]
        return {"mesh_id": s["mesh_id"], "node_id": s["node_id"], "name": s["name"], "nodes": nodes}

    @server.tool()
    async def mesh_models() -> dict[str, Any]:
        """The models the mesh serves (names for `ask` and the API), with their nodes and context length."""
        return {"models": [{"id": m.id, "nodes": list(m.node_names or m.nodes), "context_length": m.context_length}
                           for m in backend.models()]}

    @server.tool()
    async def ask(model: str, prompt: str, system: str | None = None, max_tokens: int = 512,
                  temperature: float = 0.7) -> dict[str, Any]:
        """Run one chat completion on a model of the mesh (a sub-agent call) and return its answer.

        model "auto" lets the mesh pick the model that fits the prompt; the answer names the one it took.
        """
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
        try:
            body = ChatCompletionRequest.model_validate({
                "model": model, "messages": messages, "max_tokens": max(1, min(max_tokens, ASK_MAX_TOKENS)),
                "temperature": temperature})
            tools = body.tool_spec()
            requests, _ = route_auto(backend, body.to_engine(tools), on_event)
            generation = await start(backend, admission, requests[0])
        except ApiError as exc:
            raise ToolError(error_for(exc)[1]["error"]["message"]) from None
        try:
            out = await collect(reply(generation, tools))
        finally:
            await generation.close()
        return {"model": generation.model, "text": out.text, "finish_reason": out.reason,
                "usage": {"prompt_tokens": out.usage.prompt_tokens, "completion_tokens": out.usage.completion_tokens}}

    return server


class McpEndpoint:
    """``/mcp`` on the node's app: the admin check, then the SDK's streamable HTTP transport, started by
    the first call (``build()`` makes the server then)."""

    def __init__(self, build: Callable[[], MCPServer]) -> None:
        self._build = build
        self.manager: StreamableHTTPSessionManager | None = None
        self._starting = asyncio.Lock()
        self._scope = tasks.Scope("mcp")
        """Holds the SDK's task group while it runs."""
        self._served: asyncio.Future[None] | None = None
        self._stopping = asyncio.Event()

    def mount(self, app: FastAPI) -> None:
        app.router.add_route(PATH, self, methods=["GET", "POST", "DELETE"], include_in_schema=False)

    async def _start(self) -> StreamableHTTPSessionManager:
        """Build the server and run the SDK's task group (uvicorn's lifespan is off in the node), in a task
        of its own: its cancel scope must be left by the task that entered it."""
        await asyncio.to_thread(importlib.import_module, "mcp.server.mcpserver")  # seconds under load: off the loop
        from mcp.server.transport_security import TransportSecuritySettings

        server = self._build()
        # The node's edge guard already checks Host and Origin for every route, this one included. The SDK's
        # own Starlette app is not used: its manager (made with it) is served behind the admin check instead.
        server.streamable_http_app(json_response=True, stateless_http=True,
                                   transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False))
        manager = server.session_manager
        running = asyncio.Event()

        async def serve() -> None:
            async with manager.run():
                running.set()
                await self._stopping.wait()

        self._served = self._scope.spawn(serve())
        await asyncio.wait_for(running.wait(), timeout=10.0)
        return manager

    async def stop(self) -> None:
        """Let the SDK's task group end (3 s at most, then it is cancelled)."""
        if self._served is not None:
            self._stopping.set()
            await asyncio.wait([self._served], timeout=3.0)
        await self._scope.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            check_admin(Request(scope, receive))
        except ApiError as exc:
            status, body = error_for(exc)
            await JSONResponse(body, status_code=status, headers=dict(exc.headers or {}))(scope, receive, send)
            return
        async with self._starting:
            if self.manager is None:
                self.manager = await self._start()
        await self.manager.handle_request(scope, receive, send)

