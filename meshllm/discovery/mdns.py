"""LAN discovery: published meshes advertised and browsed over mDNS (zeroconf, asyncio).

A publishing node registers one ``_meshllm._udp.local.`` service per mesh it publishes. The SRV
port is its **listing endpoint** (see :mod:`.quic_listing`); the TXT record carries only hints:
``v`` (format), ``mesh`` (mesh id), ``name``, ``node`` (node id, checked by TLS when the listing
is fetched) and ``quic`` (the mesh endpoint's port). Nothing in mDNS is trusted: anyone on the LAN
can answer anything, so :func:`browse` only yields :class:`Candidate` addresses, and the signed
listing fetched from one (:func:`~meshllm.discovery.quic_listing.fetch_listing`) is what counts.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass

from meshllm.errors import DecodeError
from meshllm.identity.ids import node_public_key, short
from meshllm.mesh.admission import is_mesh_id
from meshllm.net.interfaces import lan_addresses

log = logging.getLogger(__name__)

SERVICE_TYPE = "_meshllm._udp.local."
TXT_VERSION = "1"
RESOLVE_TIMEOUT_MS = 1500


@dataclass(frozen=True)
class Candidate:
    """A node on the LAN that says it publishes a mesh (unverified until its listing is fetched)."""

    addr: str
    """IP address (v4 or v6) to dial."""
    port: int
    """UDP port of its listing endpoint."""
    mesh_id: str
    name: str
    """The advertised mesh name (a hint; the listing's name is the signed one)."""
    node_id: str
    """The advertising node's id; the listing fetch checks its TLS certificate against it."""
    quic_port: int
    """UDP port of its mesh endpoint (where members dial)."""


def service_name(mesh_id: str, node_id: str) -> str:
    """Instance name: unique per (mesh, node), short enough for a DNS label (< 64 bytes)."""
    return f"{mesh_id}-{short(node_id)}.{SERVICE_TYPE}"


def txt_record(mesh_id: str, name: str, node_id: str, quic_port: int) -> dict[str, str]:
    """The TXT properties a publisher advertises."""
    return {"v": TXT_VERSION, "mesh": mesh_id, "name": name[:64], "node": node_id, "quic": str(quic_port)}


def parse_txt(properties: dict[bytes, bytes | None]) -> tuple[str, str, str, int]:
    """``(mesh_id, name, node_id, quic_port)`` from a TXT record; :class:`DecodeError` if malformed."""
    try:
        text = {k.decode(): (v or b"").decode() for k, v in properties.items()}
    except UnicodeDecodeError as exc:
        raise DecodeError("mDNS TXT record is not UTF-8") from exc
    mesh_id, node, quic = text.get("mesh", ""), text.get("node", ""), text.get("quic", "")
    if text.get("v") != TXT_VERSION or not is_mesh_id(mesh_id) or not quic.isdigit() or not 0 < int(quic) < 65536:
        raise DecodeError(f"not a meshllm v{TXT_VERSION} TXT record: {sorted(text)}")
    node_public_key(node)  # raises DecodeError unless it is a node id
    return mesh_id, text.get("name", "")[:64], node, int(quic)


class MdnsAdvertiser:
    """Advertises one published mesh on the LAN until :meth:`stop`."""

    def __init__(self, *, mesh_id: str, name: str, node_id: str, listing_port: int, quic_port: int,
                 addresses: list[str] | None = None, interfaces: list[str] | None = None) -> None:
        self.mesh_id, self.name, self.node_id = mesh_id, name, node_id
        self.listing_port, self.quic_port = listing_port, quic_port
        self.addresses = addresses
        self.interfaces = interfaces
        """IP addresses of the interfaces to use (None: all); tests pin this to their namespace."""
        self._zc: object | None = None
        self._info: object | None = None

    async def start(self) -> None:
        """Register the service (zeroconf probes for name conflicts first, about 1-2 s)."""
        from zeroconf import InterfaceChoice
        from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

        addresses = self.addresses if self.addresses is not None else lan_addresses()
        self._info = AsyncServiceInfo(
            SERVICE_TYPE, service_name(self.mesh_id, self.node_id), port=self.listing_port,
            properties=txt_record(self.mesh_id, self.name, self.node_id, self.quic_port),
            server=f"meshllm-{short(self.node_id)}.local.",
            addresses=[socket.inet_pton(_family(a), a) for a in addresses],
        )
        self._zc = AsyncZeroconf(interfaces=self.interfaces or InterfaceChoice.All)
        await self._zc.async_register_service(self._info)  # type: ignore[attr-defined]

    async def stop(self) -> None:
        """Withdraw the service (sends goodbye packets) and close the sockets."""
        zc, self._zc = self._zc, None
        if zc is None:
            return
        try:
            await asyncio.wait_for(zc.async_unregister_service(self._info), 3.0)  # type: ignore[attr-defined]
        except (TimeoutError, OSError) as exc:
            log.debug("mDNS unregister failed: %s", exc)
        await zc.async_close()  # type: ignore[attr-defined]


async def browse(timeout: float = 3.0, *, interfaces: list[str] | None = None) -> list[Candidate]:
    """Listen for ``_meshllm._udp`` services for ``timeout`` seconds; resolve each to candidates.

    Malformed TXT records are skipped (logged); one candidate per advertised address.
    """
    from zeroconf import InterfaceChoice, ServiceStateChange
    from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

    zc = AsyncZeroconf(interfaces=interfaces or InterfaceChoice.All)
    names: set[str] = set()

    def on_change(zeroconf: object, service_type: str, name: str, state_change: ServiceStateChange) -> None:
        if state_change is not ServiceStateChange.Removed:
            names.add(name)

    browser = AsyncServiceBrowser(zc.zeroconf, [SERVICE_TYPE], handlers=[on_change])
    try:
        await asyncio.sleep(timeout)
        infos = [AsyncServiceInfo(SERVICE_TYPE, name) for name in sorted(names)]
        await asyncio.gather(*(info.async_request(zc.zeroconf, RESOLVE_TIMEOUT_MS) for info in infos))
    finally:
        await browser.async_cancel()
        await zc.async_close()
    found: list[Candidate] = []
    for info in infos:
        try:
            mesh_id, name, node, quic = parse_txt(info.properties or {})
        except DecodeError as exc:
            log.info("ignoring mDNS service %s: %s", info.name, exc)
            continue
        if not info.port:
            continue
        found.extend(Candidate(addr, info.port, mesh_id, name, node, quic) for addr in info.parsed_addresses())
    return found


def _family(addr: str) -> int:
    return socket.AF_INET6 if ":" in addr else socket.AF_INET
