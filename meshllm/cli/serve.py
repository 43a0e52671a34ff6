"""``meshllm serve`` and ``meshllm join``: run a node until Ctrl-C or SIGTERM, then leave gracefully."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import click

from meshllm import logs
from meshllm.cli.common import GIGABYTES, dht_multiaddrs, home_option, mesh_passphrase
from meshllm.config import DEFAULT_API_PORT, DEFAULT_MESH_PORT, load_config, read_private, resolve_home
from meshllm.config import dht_bootstrap as dht_bootstrap_of
from meshllm.discovery.listing import LISTING_TTL_S
from meshllm.engine.base import DEFAULT_MAX_TOKENS
from meshllm.errors import ConfigError, DecodeError
from meshllm.events import EventHub
from meshllm.mesh.admission import MESH_PASSPHRASE_ENV, MeshKey, is_mesh_id
from meshllm.mesh.routes import PULL_INTERVAL_MAX_S, PULL_INTERVAL_S
from meshllm.runtime.replay import DEFAULT_MAX_REPLAYS
from meshllm.tasks import task_group
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
                     help="Address the HTTP API binds to (beyond loopback it needs --api-key)."),
        click.option("--api-key", "api_keys", multiple=True, envvar="MESHLLM_API_KEY", metavar="KEY",
                     help="Secret clients must send (Bearer or x-api-key) on /v1 and every /api route; repeatable, "
                          "at least 16 characters (also $MESHLLM_API_KEY; a command line is visible to other users, "
                          "the variable or --api-key-file is not)."),
        click.option("--api-key-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help="File (mode 0600) with one API key per line."),
        click.option("--cors-origin", "cors_origins", multiple=True, metavar="ORIGIN",
                     help="Web origin whose pages may use the API, e.g. https://app.example.com (repeatable; "
                          "pages served from localhost are always allowed; '*': any)."),
        click.option("--metrics-public", is_flag=True,
                     help="Serve GET /metrics without the admin token or an API key (for a scraper)."),
        click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
                     help="Host name clients may use in URLs besides localhost and IP addresses (repeatable; "
                          "guards against DNS rebinding; '*': any, behind a proxy that checks it)."),
        click.option("--mesh-port", type=click.IntRange(0, 65535), default=DEFAULT_MESH_PORT, show_default=True,
                     help="UDP port of the QUIC mesh endpoint (0: any free port)."),
        click.option("--mesh-host", default="0.0.0.0", show_default=True, help="Address the mesh endpoint binds to."),
        click.option("--announce", multiple=True, callback=_addr, metavar="HOST:PORT",
                     help="Address peers should dial (port-forwarded nodes); repeatable."),
        click.option("--bootstrap", multiple=True, callback=_addr, metavar="HOST:PORT",
                     help="Member to dial instead of the invite's addresses; repeatable."),
        click.option("--relay", type=click.Choice(["on", "off", "auto"]), default="auto", show_default=True,
                     help="Relay for members behind NATs (auto: when peers can reach this node directly)."),
        click.option("--ephemeral", is_flag=True, help="Use a fresh node key that is never saved."),
        click.option("--client", is_flag=True,
                     help="Serve no model, only the API. Joining a mesh, stay out of gossip: keep connections to "
                          "two members and route from the signed route table they serve (members hold nothing "
                          "about this node). Owning the mesh (no invite), it is a member."),
        click.option("--member", is_flag=True,
                     help="With --client: join gossip as a full member instead (in every view; accepts connections, "
                          "offers its library's model files to the mesh, holds the blackboard)."),
        click.option("--routes-interval", type=click.FloatRange(0.5, PULL_INTERVAL_MAX_S), default=PULL_INTERVAL_S,
                     show_default=True,
                     help="Seconds between a joining --client's route-table pulls (it also pulls on demand: a "
                          "failed node, an unknown model, a lost anchor)."),
        click.option("--worker", is_flag=True,
                     help="Serve no whole model; offer this node's memory to host layer ranges of split models."),
        click.option("--split", type=click.Choice(["auto", "force", "off"]), default="off", show_default=True,
                     help="Split served models over workers: auto (only when a model does not fit), force (always)."),
        click.option("--speculate", type=click.Choice(["auto", "on", "off"]), default=None,
                     help="Speculative decoding: draft tokens from the prompt and the output and verify them in "
                          "one pass (auto: where the measured costs say it pays; on: every draft found; off). "
                          "Default: speculate in config.toml, else auto."),
        click.option("--split-audit", "split_audit", type=click.FloatRange(0.0, 1.0), default=None, metavar="RATE",
                     help="Share of split requests this coordinator recomputes from its own file to catch a stage "
                          "forging output (plus each new chain's first; 0: none). Default: split_audit in "
                          "config.toml, else 0.05."),
        click.option("--split-audit-memory", type=click.FloatRange(min=1.0), default=None, metavar="MB",
                     help="Memory (MiB) an audit's loaded layers may take at once; it recomputes range by range "
                          "within it (default 1024)."),
        click.option("--split-batch", type=click.IntRange(1, 32), default=8, show_default=True, metavar="N",
                     help="Requests whose decode steps go down a split chain as one pass (1: one at a time)."),
        click.option("--split-spares/--no-split-spares", "split_spares", default=True, show_default=True,
                     help="Keep warm spares: workers keep on disk the layers a rebuilt chain would give them, so "
                          "a rebuild after a stage's death moves no bytes (costs their disk and a transfer each)."),
        click.option("--stages", type=click.IntRange(2, 8), default=None,
                     help="Stages of a split (default: the planner chooses; force: one per worker plus this node)."),
        click.option("--max-memory", type=GIGABYTES, default=None, metavar="GB",
                     help="Memory (GiB) this node gives models or, with --worker, offers to splits "
                          "(this node only: every worker declares its own)."),
        click.option("--model", "models", multiple=True, metavar="REF",
                     help="Model to serve: a GGUF path or 'default' (repeatable; default: the bundled model)."),
        click.option("--standby", is_flag=True,
                     help="Load no model at start: serve each --model when the mesh asks for it and cannot keep up "
                          "(nobody serves it, requests queue or are refused); unload it again once idle."),
        click.option("--standby-idle", "standby_idle_s", type=click.FloatRange(1.0, 86400.0), default=300.0,
                     show_default=True, metavar="SECONDS",
                     help="With --standby: unload a model after this long without a request."),
        click.option("--engine", type=click.Choice(["llama", "ggml"]), default="llama", show_default=True,
                     help="Inference engine for served models: llama.cpp, or the ggml stage runtime splits use."),
        click.option("--threads", type=click.IntRange(min=1), default=None,
                     help="CPU threads per model and stage (default: the machine's cores, up to 8)."),
        click.option("--gpu-layers", type=click.IntRange(min=-1), default=None, metavar="N",
                     help="Layers to put on the GPU when llama-cpp-python has one (-1: all; "
                          "default: all that fit; ignored on CPU-only builds)."),
        click.option("--parallel", type=click.IntRange(1, 64), default=None,
                     help="Requests each llama.cpp model generates at once, in one batch (default: up to 8, "
                          "as many as a quarter of the free memory holds KV caches for)."),
        click.option("--max-tokens-default", type=click.IntRange(min=1), default=DEFAULT_MAX_TOKENS,
                     show_default=True, help="Tokens generated for a request that sets no max_tokens."),
        click.option("--replays", type=click.IntRange(0, 10), default=DEFAULT_MAX_REPLAYS, show_default=True,
                     help="Times a routed answer whose serving node fails mid-stream is continued on another "
                          "node (0: the client gets the error)."),
        click.option("--kernels", type=click.Choice(["exact", "fast"]), default="exact", show_default=True,
                     help="ggml kernels of models and stages: exact (a request's text never depends on what runs "
                          "beside it) or fast (also repacked and tiled kernels: faster prompts on some CPUs)."),
        click.option("--dht-bootstrap", multiple=True, metavar="MULTIADDR", callback=dht_multiaddrs,
                     help="DHT peer to join at start, /ip4/HOST/tcp/PORT/p2p/PEERID (repeatable; default: "
                          "$MESHLLM_DHT_BOOTSTRAP, else dht_bootstrap in config.toml; looking a mesh up also "
                          "falls back to the default bootstrap list)."),
        click.option("--auto", is_flag=True,
                     help="Find the best published mesh (LAN, then the DHT) for the --model names and join it: "
                          "serving one first, then wanting one, then the most tokens/s and nodes."),
        click.option("--dht-port", type=click.IntRange(0, 65535), default=None,
                     help="TCP port of this node's DHT node; given, the DHT starts at once (default: it starts "
                          "with --dht-bootstrap or on the first publish, on any free port)."),
        click.option("--listing-ttl", "listing_ttl", type=click.FloatRange(2.0, 3600.0), default=LISTING_TTL_S,
                     hidden=True, help="Lifetime of published listings in seconds (tests)."),
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
@click.argument("token", metavar="TOKEN|MESH-ID", required=False)
@click.option("--timeout", "lookup_timeout", type=click.FloatRange(1.0, 300.0), default=15.0, show_default=True,
              help="Seconds to look a MESH-ID (or, with --auto, every published mesh) up on the LAN and in the DHT.")
@node_options
def join(token: str | None, lookup_timeout: float, **kwargs: Any) -> None:
    """Join a mesh with an invite TOKEN, a published MESH-ID (looked up by mDNS, then the DHT), or with
    --auto the best published mesh."""
    if token is None and not kwargs["auto"]:
        raise click.UsageError("give an invite TOKEN or a MESH-ID, or --auto to pick a published mesh")
    _run(token, lookup_timeout=lookup_timeout, **kwargs)


def _run(join_token: str | None, *, home: Path | None, name: str, api_port: int, api_host: str, mesh_port: int,
         mesh_host: str, announce: list[str], bootstrap: list[str], relay: str, ephemeral: bool, client: bool,
         member: bool, routes_interval: float, auto: bool,
         models: tuple[str, ...], engine: str, threads: int | None, gpu_layers: int | None, parallel: int | None,
         max_tokens_default: int, replays: int, kernels: str, log_format: str, verbose: bool,
         dht_bootstrap: tuple[str, ...], dht_port: int | None, listing_ttl: float, worker: bool, split: str,
         stages: int | None, split_batch: int, split_spares: bool, max_memory: float | None, speculate: str | None,
         split_audit: float | None, split_audit_memory: float | None, api_keys: tuple[str, ...],
         api_key_file: Path | None, cors_origins: tuple[str, ...], allowed_hosts: tuple[str, ...], standby: bool,
         metrics_public: bool,
         standby_idle_s: float, lookup_timeout: float = 15.0) -> None:
    from meshllm.node import Node, NodeOptions

    logs.configure(log_format, verbose)
    hub = EventHub()
    hub.add_sink(logs.event_sink(log_format, verbose=verbose))
    config = load_config(resolve_home(home))
    dht_peers, _ = dht_bootstrap_of(dht_bootstrap, config, default=False)  # the node's own DHT: only when set
    lookup = dht_bootstrap_of(dht_bootstrap, config, default=True)
    if auto:
        if join_token is not None:
            raise click.UsageError("--auto finds a mesh itself: give it no invite token or mesh id")
        join_token, bootstrap = _auto_join(hub, list(models), mesh_host, lookup, lookup_timeout, bootstrap)
    elif join_token is not None and is_mesh_id(join_token):
        join_token, bootstrap = _resolve_published(hub, join_token, mesh_host, lookup[0], lookup_timeout, bootstrap)
    if member and not client:
        raise click.UsageError("--member is for a --client: hosts and workers are always gossip members")
    if join_token is None:
        _unlock_mesh_key(resolve_home(home))
    options = NodeOptions(
        home=home, name=name, api_host=api_host, api_port=api_port, mesh_host=mesh_host, mesh_port=mesh_port,
        announce=announce, join=join_token, bootstrap=bootstrap, ephemeral=ephemeral,
        role="client" if client else "worker" if worker else "host", models=list(models) or ["default"],
        passive=client and not member and join_token is not None, routes_interval_s=routes_interval,
        engine=engine, threads=threads, gpu_layers=gpu_layers, parallel=parallel, max_tokens_default=max_tokens_default,
        replays=replays, kernels=kernels, split=split_options(split, stages, max_memory, split_batch,
                                             config.split_audit if split_audit is None else split_audit,
                                             split_audit_memory, split_spares),
        speculate=speculate or config.speculate,  # type: ignore[arg-type]
        dht_bootstrap=dht_peers, dht_port=dht_port, listing_ttl_s=listing_ttl, relay=relay,  # type: ignore[arg-type]
        api_keys=[*api_keys, *_key_file(api_key_file)], cors_origins=list(cors_origins),
        allowed_hosts=list(allowed_hosts), metrics_public=metrics_public, standby=standby,
        standby_idle_s=standby_idle_s,
    )
    asyncio.run(_serve(Node(options, hub), log_format))


def _key_file(path: Path | None) -> list[str]:
    """API keys from ``--api-key-file``: one per line; blank lines and ``#`` comments skipped."""
    if path is None:
        return []
    try:
        text = read_private(path, "API key file").decode("utf-8", "replace")
    except FileNotFoundError:
        raise ConfigError(f"no API key file at {path}") from None
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _unlock_mesh_key(home: Path) -> None:
    """Ask for the passphrase of an encrypted mesh key before the node starts (not needed when it is in the env).

    The node reads it from ``$MESHLLM_MESH_PASSPHRASE``; a passphrase typed here is handed to it the
    same way, in this process's own environment, which other users cannot read.
    """
    stored = MeshKey.stored(home) if home.is_dir() else None
    if stored is not None and stored[1] and MESH_PASSPHRASE_ENV not in os.environ:
        os.environ[MESH_PASSPHRASE_ENV] = mesh_passphrase(confirm=False)


def split_options(mode: str, stages: int | None, max_memory_gb: float | None, batch: int = 8,
                  audit_rate: float | None = None, audit_memory_mb: float | None = None, spares: bool = True) -> Any:
    """The split flags (``--split``, ``--stages``, ``--max-memory``, ``--split-batch``, ``--split-audit*``,
    ``--split-spares``) as ``SplitOptions``."""
    from meshllm.split.audit import AUDIT_MEMORY, AUDIT_RATE
    from meshllm.split.placement import SplitOptions
    from meshllm.split.planner import GIB

    cap = int(max_memory_gb * GIB) if max_memory_gb is not None else None
    return SplitOptions(mode=mode, stages=stages, max_memory=cap, batch=batch, spares=spares,  # type: ignore[arg-type]
                        audit_rate=AUDIT_RATE if audit_rate is None else audit_rate,
                        audit_memory=int(audit_memory_mb * 2**20) if audit_memory_mb is not None else AUDIT_MEMORY)


def _resolve_published(hub: EventHub, mesh_id: str, mesh_host: str, dht_peers: list[str], timeout: float,
                       bootstrap: list[str]) -> tuple[str, list[str]]:
    """The open invite of a published mesh and the members to dial (``--bootstrap`` wins over the listing's).

    mDNS is browsed on the interface the mesh endpoint binds (none for loopback), then the DHT is
    asked; the listing is verified (signature, expiry, mesh id) before its invite is used.
    """
    from meshllm.discovery.publisher import lan_scope
    from meshllm.discovery.resolve import find_listing

    found = asyncio.run(find_listing(mesh_id, interfaces=lan_scope(mesh_host), bootstrap=dht_peers, timeout=timeout))
    listing = found.listing
    hub.publish("mesh_found", mesh_id=mesh_id, name=listing.name, via=found.via, bootstrap=list(listing.bootstrap))
    return listing.open_invite, bootstrap or list(listing.bootstrap)


def _auto_join(hub: EventHub, wanted: list[str], mesh_host: str, lookup: tuple[list[str], str], timeout: float,
               bootstrap: list[str]) -> tuple[str, list[str]]:
    """``--auto``: the open invite of the best published mesh for ``wanted`` and the members to dial."""
    from meshllm.discovery.publisher import lan_scope
    from meshllm.discovery.resolve import auto_find

    peers, source = lookup
    names = [Path(w).stem if w.endswith(".gguf") else w for w in wanted]
    found = asyncio.run(auto_find(names, interfaces=lan_scope(mesh_host), bootstrap=peers, timeout=timeout,
                                  source=source))
    listing = found.listing
    hub.publish("mesh_found", mesh_id=listing.mesh_id, name=listing.name, via=found.via,
                bootstrap=list(listing.bootstrap), auto=True, dht_bootstrap_from=source)
    return listing.open_invite, bootstrap or list(listing.bootstrap)


async def _serve(node: Any, log_format: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with task_group() as group:
            starting = group.create_task(node.start())  # (a start failure propagates as a one-line error)
            stopped = group.create_task(stop.wait())
            await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if starting.done():
                if log_format == "pretty":
                    _print_ready(node)
            else:
                starting.cancel()
            await stopped
    except Exception:
        if not stop.is_set():  # (a start cut short by the signal may end in any error: the node stops anyway)
            raise
    finally:
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
