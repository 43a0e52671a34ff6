"""``meshllm serve`` and ``meshllm join``: run a node until Ctrl-C or SIGTERM, then leave gracefully."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from pathlib import Path
from typing import Any

import click

from meshllm import logs
from meshllm.api.events import EventHub
from meshllm.cli.common import home_option
from meshllm.config import DEFAULT_API_PORT, DEFAULT_MESH_PORT
from meshllm.errors import DecodeError
from meshllm.wire.addr import parse_addr


def _addr(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> list[str]:
    for value in values:
        try:
            parse_addr(value)
        except DecodeError as exc:
            raise click.BadParameter(str(exc)) from None
    return list(values)


def node_options(func: Any) -> Any:
    """The options ``serve`` and ``join`` share."""
    options = [
        home_option,
        click.option("--name", default="", help="Name shown to peers (default: the node id's first 8 characters)."),
        click.option("--port", "api_port", type=click.IntRange(0, 65535), default=DEFAULT_API_PORT,
                     show_default=True, help="HTTP API port on 127.0.0.1 (0: any free port)."),
        click.option("--host", "api_host", default="127.0.0.1", show_default=True,
                     help="Address the HTTP API binds to."),
        click.option("--mesh-port", type=click.IntRange(0, 65535), default=DEFAULT_MESH_PORT, show_default=True,
                     help="UDP port of the QUIC mesh endpoint (0: any free port)."),
        click.option("--mesh-host", default="0.0.0.0", show_default=True, help="Address the mesh endpoint binds to."),
        click.option("--announce", multiple=True, callback=_addr, metavar="HOST:PORT",
                     help="Address peers should dial (port-forwarded nodes); repeatable."),
        click.option("--bootstrap", multiple=True, callback=_addr, metavar="HOST:PORT",
                     help="Member to dial instead of the invite's addresses; repeatable."),
        click.option("--ephemeral", is_flag=True, help="Use a fresh node key that is never saved."),
        click.option("--client", is_flag=True, help="Take part in the mesh and the API, but serve no model."),
        click.option("--model", "models", multiple=True, metavar="REF",
                     help="Model to serve: a GGUF path or 'default' (repeatable; default: the bundled model)."),
        click.option("--engine", type=click.Choice(["llama", "numpy"]), default="llama", show_default=True,
                     help="Inference engine for served models."),
        click.option("--log-format", type=click.Choice(["pretty", "json"]), default="pretty", show_default=True,
                     help="pretty: for people, on stderr; json: one event per line on stdout."),
        click.option("-v", "--verbose", is_flag=True, help="Debug logging."),
    ]
    for option in reversed(options):
        func = option(func)
    return func


@click.command()
@click.option("--join", "join_token", metavar="TOKEN", help="Join the mesh of this invite instead of owning one.")
@node_options
def serve(join_token: str | None, **kwargs: Any) -> None:
    """Start a node: own a private mesh (or --join one) and serve models on the local API."""
    _run(join_token, **kwargs)


@click.command()
@click.argument("token")
@node_options
def join(token: str, **kwargs: Any) -> None:
    """Join a mesh with an invite TOKEN (the same as `serve --join TOKEN`)."""
    _run(token, **kwargs)


def _run(join_token: str | None, *, home: Path | None, name: str, api_port: int, api_host: str, mesh_port: int,
         mesh_host: str, announce: list[str], bootstrap: list[str], ephemeral: bool, client: bool,
         models: tuple[str, ...], engine: str, log_format: str, verbose: bool) -> None:
    from meshllm.node import Node, NodeOptions

    logs.configure(log_format, verbose)
    hub = EventHub()
    hub.add_sink(logs.event_sink(log_format))
    options = NodeOptions(
        home=home, name=name, api_host=api_host, api_port=api_port, mesh_host=mesh_host, mesh_port=mesh_port,
        announce=announce, join=join_token, bootstrap=bootstrap, ephemeral=ephemeral,
        role="client" if client else "host", models=list(models) or ["default"], engine=engine,
    )
    asyncio.run(_serve(Node(options, hub), log_format))


async def _serve(node: Any, log_format: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.create_task(node.start())
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()  # a start failure propagates as a one-line error
            if log_format == "pretty":
                _print_ready(node)
            await stopped
        else:
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await starting
    finally:
        stopped.cancel()
        await node.stop()


def _print_ready(node: Any) -> None:
    """The lines a person needs after start: where the API is and how others join."""
    click.echo(f"meshllm node {node.name} is ready", err=True)
    click.echo(f"  API:     {node.api_url}/v1", err=True)
    click.echo(f"  mesh:    {node.membership.mesh_id} (UDP {node.mesh_addr})", err=True)
    invite = node.invite
    if invite:
        click.echo("  invite (24 h, any number of nodes):", err=True)
        click.echo(f"    meshllm join {invite}", err=True)
    click.echo("Stop with Ctrl-C.", err=True)
