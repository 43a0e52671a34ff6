"""``meshllm discover``: list published meshes found on the LAN (mDNS) and in the DHT.

DHT bootstrap peers come from ``--dht-bootstrap``, else ``$MESHLLM_DHT_BOOTSTRAP``, else
``dht_bootstrap`` in ``config.toml``, else the DHT node of a node running on this machine
(``GET /api/dht`` at ``--api``), which is already part of the DHT, else the default bootstrap list
(``meshllm.config.DEFAULT_DHT_BOOTSTRAP``). Every listing shown passed signature, mesh-id and
expiry checks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from meshllm import logs
from meshllm.cli.common import api_option, dht_multiaddrs, echo_json, json_option
from meshllm.config import DEFAULT_DHT_BOOTSTRAP, dht_bootstrap, load_config, resolve_home
from meshllm.errors import MeshllmError

if TYPE_CHECKING:
    from meshllm.cli.api_client import NodeApi
    from meshllm.discovery.resolve import Found


def bootstrap_peers(option: tuple[str, ...], home: Path | None, api: NodeApi) -> list[str]:
    """Bootstrap multiaddrs: the option, the environment or config.toml, else a local node's DHT, else
    the default list."""
    peers, source = dht_bootstrap(option, load_config(resolve_home(home)), default=False)
    if peers or source != "nothing set":
        return peers
    try:
        info = api.get_json("/api/dht", timeout=2.0)
    except MeshllmError:
        info = None
    local = [str(a) for a in info.get("multiaddrs", [])] if isinstance(info, dict) else []
    return local or list(DEFAULT_DHT_BOOTSTRAP)


def describe(found: Found, now: float) -> dict[str, object]:
    """One mesh as ``--json`` shows it."""
    item = found.listing
    return {
        "name": item.name, "mesh_id": item.mesh_id, "models": list(item.models_served),
        "models_wanted": list(item.models_wanted), "nodes": item.node_count,
        "capacity": {"ram_bytes": item.capacity.ram_bytes, "vram_bytes": item.capacity.vram_bytes,
                     "gpu_nodes": item.capacity.gpu_nodes, "tokens_per_s": item.capacity.tokens_per_s},
        "age_s": round(max(0.0, now - item.issued), 1), "expires_in_s": round(item.expires - now, 1),
        "via": found.via, "bootstrap": list(item.bootstrap),
    }


def _capacity(found: Found) -> str:
    cap = found.listing.capacity
    text = f"{cap.ram_bytes / 2**30:.0f} GiB RAM"
    if cap.gpu_nodes:
        text += f", {cap.gpu_nodes} GPU ({cap.vram_bytes / 2**30:.0f} GiB)"
    return text


@click.command("discover")
@click.option("--model", default=None, help="Only meshes serving this model (substring match).")
@json_option
@click.option("--dht-bootstrap", multiple=True, metavar="MULTIADDR", callback=dht_multiaddrs,
              help="DHT peer to ask (repeatable; default: $MESHLLM_DHT_BOOTSTRAP, config.toml, the local node's DHT, "
                   "else the default bootstrap list).")
@click.option("--timeout", type=click.FloatRange(1.0, 120.0), default=5.0, show_default=True,
              help="Seconds to search.")
@click.option("--interface", "interfaces", multiple=True, metavar="IP",
              help="Browse mDNS only on the interface with this address (repeatable; default: all).")
@click.option("--no-mdns", is_flag=True, help="Do not browse the LAN (DHT only).")
@api_option
@click.option("-v", "--verbose", is_flag=True, help="Also log every lookup step.")
def discover(model: str | None, as_json: bool, dht_bootstrap: tuple[str, ...], timeout: float,
             interfaces: tuple[str, ...], no_mdns: bool, api: NodeApi, home: Path | None, verbose: bool) -> None:
    """List published meshes: name, id, models, nodes, capacity and listing age."""
    from meshllm.discovery.resolve import discover_all  # aioquic and zeroconf: only for this command

    logs.configure("pretty", verbose)
    if not verbose:  # refused listings (warnings) still show; routine lookups do not
        logging.getLogger().setLevel(logging.WARNING)
    bootstrap = bootstrap_peers(dht_bootstrap, home, api)
    scope = None if no_mdns else list(interfaces)
    found, notes = asyncio.run(discover_all(interfaces=scope, bootstrap=bootstrap, timeout=timeout))
    if model:
        found = [f for f in found if any(model.lower() in m.lower() for m in f.listing.models_served)]
    now = time.time()
    for note in notes:
        click.echo(f"note: {note}", err=True)
    if as_json:
        echo_json([describe(f, now) for f in found])
        return
    if not found:
        what = f" serving {model!r}" if model else ""
        searched = " and ".join(w for w, on in (("the LAN", scope is not None), ("the DHT", bool(bootstrap))) if on)
        click.echo(f"no published mesh{what} found on {searched or 'nothing (no LAN, no DHT)'} within {timeout:g} s")
        return
    rows = [(f.listing.name, f.listing.mesh_id, ", ".join(f.listing.models_served) or "-",
             str(f.listing.node_count), _capacity(f), f"{max(0.0, now - f.listing.issued):.0f} s", f.via)
            for f in found]
    header = ("NAME", "MESH ID", "MODELS", "NODES", "CAPACITY", "AGE", "VIA")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        click.echo("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
