"""Internet discovery: published meshes in a libp2p Kademlia DHT (py-libp2p, run under trio).

py-libp2p is trio-only and, once imported, patches aioquic process-wide, so it lives in a thread
of its own, is imported only inside that thread's first call, and the asyncio side talks to it
through :class:`DhtNode`, whose every method has a deadline. What is stored where:

* ``/meshllm/mesh/<mesh_id>`` -> the signed :mod:`listing <meshllm.discovery.listing>` bytes. A
  validator checks signature, mesh id and expiry on every store and every fetch, so DHT peers
  can neither forge a listing nor keep serving a dead one past its TTL.
* provider records under ``/meshllm/meshes``: every publishing node announces itself; ``discover``
  asks each provider for its listings over the ``/meshllm/listings/1.0.0`` protocol (Kademlia
  provider records name peers, not meshes).

Security choices: Noise is the only security transport (py-libp2p's
default list also admits plaintext and secio), ``max_connections_per_peer=1`` (else each dial
waits 250 ms), and the DHT runs in strict validation mode (keys outside our validators are refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import msgspec

from meshllm.discovery.listing import MAX_LISTING_BYTES, MeshListing, log_refused, verify_listing
from meshllm.errors import DecodeError, MeshllmError, VerificationError

log = logging.getLogger(__name__)
T = TypeVar("T")

LISTING_NAMESPACE = "meshllm"
MESHES_KEY = "/meshllm/meshes"
LISTINGS_PROTOCOL = "/meshllm/listings/1.0.0"
MAX_LISTINGS_PER_PEER = 16
"""Most listings one provider may return (a node publishes the one mesh it owns)."""
PEER_FETCH_TIMEOUT_S = 3.0
DEFAULT_TIMEOUT_S = 10.0


class DhtError(MeshllmError):
    """The DHT could not do what was asked (not started, stopped, a libp2p failure)."""


class DhtTimeout(DhtError, TimeoutError):
    """A DHT operation did not finish before its deadline."""


def listing_key(mesh_id: str) -> str:
    """The DHT key a mesh's listing is stored under."""
    return f"/{LISTING_NAMESPACE}/mesh/{mesh_id}"


def check_listing_record(key: str, value: bytes, now: float) -> MeshListing:
    """What the DHT validator runs on every record: a live listing stored under its own key."""
    listing = verify_listing(value, now)
    if key != listing_key(listing.mesh_id):
        raise VerificationError(f"listing of {listing.mesh_id} stored under another key {key[:80]!r}")
    return listing


def pick_newest(values: Sequence[bytes], now: float) -> int:
    """Index of the newest valid listing among ``values`` (the DHT's ``select``); 0 when none is valid."""
    best, best_issued = 0, float("-inf")
    for index, value in enumerate(values):
        try:
            issued = verify_listing(value, now).issued
        except MeshllmError:
            continue
        if issued > best_issued:
            best, best_issued = index, issued
    return best


class DhtNode:
    """One node's presence in the DHT, driven from asyncio.

    ``server=True`` (the default, and what a publishing node must use) answers DHT queries and
    stores records for others; ``server=False`` only asks, for a short-lived ``discover``.
    Only ``host`` is listened on: tests and local runs pass 127.0.0.1.
    """

    def __init__(self, *, host: str = "127.0.0.1", server: bool = True, clock: Callable[[], float] = time.time) -> None:
        self.host = host
        self.server = server
        self.clock = clock
        self.multiaddrs: list[str] = []
        """Where peers reach this node, with ``/p2p/<peer id>`` (give one to others as bootstrap)."""
        self._published: dict[str, bytes] = {}
        """mesh id -> our latest listing bytes; served to whoever asks over LISTINGS_PROTOCOL."""
        self._thread: threading.Thread | None = None
        self._token: Any = None
        self._nursery: Any = None
        self._stop: Any = None
        self._dht: Any = None
        self._host: Any = None

    # -- lifecycle (asyncio side) -----------------------------------------------------------------

    async def start(self, listen_port: int = 0, bootstrap: Sequence[str] = (),
                    timeout: float = DEFAULT_TIMEOUT_S) -> list[str]:
        """Start libp2p in its thread, listen on ``host:listen_port`` (TCP), dial ``bootstrap``.

        Returns our multiaddrs. Raises :class:`DhtError` if libp2p is missing or cannot listen,
        or when no bootstrap peer (of several given) could be reached.
        """
        if self._thread is not None:
            raise DhtError("DHT node already started")
        loop = asyncio.get_running_loop()
        started: asyncio.Future[list[str]] = loop.create_future()
        self._thread = threading.Thread(
            target=self._thread_main, args=(loop, started, listen_port), name="meshllm-dht", daemon=True
        )
        self._thread.start()
        try:
            self.multiaddrs = await asyncio.wait_for(started, timeout)
        except TimeoutError:
            await self.stop()
            raise DhtTimeout(f"the DHT did not start within {timeout:.0f} s") from None
        except BaseException:
            await self.stop()
            raise
        if bootstrap:
            reached = await self._call(self._bootstrap, list(bootstrap), timeout=timeout)
            if reached == 0:
                await self.stop()
                raise DhtError("no DHT bootstrap peer could be reached",
                               hint="check the bootstrap multiaddrs (/ip4/HOST/tcp/PORT/p2p/PEERID)")
        return self.multiaddrs

    async def stop(self, timeout: float = 5.0) -> None:
        """Close every libp2p connection and end the thread (idempotent)."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if self._token is not None:
            with contextlib.suppress(Exception):
                self._token.run_sync_soon(self._stop.set)
        await asyncio.to_thread(thread.join, timeout)
        if thread.is_alive():
            log.warning("DHT thread did not stop within %.0f s; leaving it (daemon)", timeout)
        self._token = self._nursery = self._dht = self._host = None

    # -- operations (asyncio side) ----------------------------------------------------------------

    async def put_listing(self, raw: bytes, timeout: float = DEFAULT_TIMEOUT_S) -> MeshListing:
        """Store our listing under its mesh id, announce ourselves as a provider, and serve it.

        Verified first (a node never publishes what readers would refuse); call again every
        :data:`~meshllm.discovery.listing.REPUBLISH_INTERVAL_S` with a fresh listing.
        """
        listing = verify_listing(raw, self.clock())
        self._published[listing.mesh_id] = bytes(raw)
        await self._call(self._put, listing_key(listing.mesh_id), bytes(raw), timeout=timeout)
        return listing

    def unpublish(self, mesh_id: str) -> None:
        """Stop serving our listing of ``mesh_id``; copies in the DHT die at their expiry."""
        self._published.pop(mesh_id, None)

    async def get_listing(self, mesh_id: str, timeout: float = DEFAULT_TIMEOUT_S) -> MeshListing | None:
        """The newest live listing of ``mesh_id`` in the DHT (verified), or None when there is none."""
        values = await self._call(self._get, listing_key(mesh_id), mesh_id, timeout=timeout)
        found = _verified(values, self.clock(), expected_mesh_id=mesh_id)
        return found.get(mesh_id)

    async def find_meshes(self, timeout: float = DEFAULT_TIMEOUT_S) -> list[MeshListing]:
        """Every published mesh whose listing is live: providers of ``/meshllm/meshes``, asked in turn."""
        values = await self._call(self._find, timeout, timeout=timeout)
        return sorted(_verified(values, self.clock()).values(), key=lambda item: item.mesh_id)

    # -- trio side --------------------------------------------------------------------------------

    def _thread_main(self, loop: asyncio.AbstractEventLoop, started: asyncio.Future[list[str]], port: int) -> None:
        try:
            import trio

            trio.run(self._trio_main, loop, started, port)
        except BaseException as exc:  # report to start() instead of dying silently in a thread
            if isinstance(exc, ImportError):
                exc = DhtError(f"DHT discovery needs py-libp2p ({exc.name} is missing)",
                               hint="pip install 'meshllm[dht]'")
            elif not isinstance(exc, MeshllmError):
                exc = DhtError(f"the DHT stopped: {type(exc).__name__}: {exc}")
            _settle(loop, started, exc)

    async def _trio_main(self, loop: asyncio.AbstractEventLoop, started: asyncio.Future[list[str]], port: int) -> None:
        import multiaddr
        import trio
        from libp2p import new_host
        from libp2p.crypto.ed25519 import create_new_key_pair
        from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
        from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
        from libp2p.network.config import ConnectionConfig
        from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
        from libp2p.security.noise.transport import Transport as NoiseTransport
        from libp2p.tools.anyio_service import background_trio_service

        quiet = logging.getLogger("libp2p")  # libp2p sets WARNING on import, then warns on every closed stream
        if quiet.level == logging.WARNING:
            quiet.setLevel(logging.ERROR)
        key_pair = create_new_key_pair()
        host = new_host(
            key_pair=key_pair,
            sec_opt={NOISE_PROTOCOL_ID: NoiseTransport(key_pair, noise_privkey=create_x25519_key_pair().private_key)},
            connection_config=ConnectionConfig(max_connections_per_peer=1),
        )
        listen = multiaddr.Multiaddr(f"/ip4/{self.host}/tcp/{port}")
        async with host.run([listen]), trio.open_nursery() as nursery:
            dht = KadDHT(host, DHTMode.SERVER if self.server else DHTMode.CLIENT, strict_validation=True)
            dht.register_validator(LISTING_NAMESPACE, _listing_validator(self.clock))
            host.set_stream_handler(LISTINGS_PROTOCOL, self._serve_listings)
            async with background_trio_service(dht):
                self._host, self._dht, self._nursery = host, dht, nursery
                self._stop = trio.Event()
                self._token = trio.lowlevel.current_trio_token()
                peer = host.get_id().to_string()
                _settle(loop, started, [f"{addr}/p2p/{peer}" if "/p2p/" not in str(addr) else str(addr)
                                        for addr in host.get_addrs()])
                await self._stop.wait()
                nursery.cancel_scope.cancel()

    async def _call(self, fn: Callable[..., Awaitable[T]], *args: Any, timeout: float) -> T:
        """Run ``fn(*args)`` in the trio thread under ``timeout``; its result or typed error comes back here."""
        if self._token is None:
            raise DhtError("the DHT node is not running", hint="call DhtNode.start() first")
        import trio

        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        scope = trio.CancelScope()

        what = fn.__name__.strip("_")

        async def run() -> None:
            try:
                with scope, trio.fail_after(timeout):
                    _settle(loop, future, await fn(*args))
            except trio.TooSlowError:
                _settle(loop, future, DhtTimeout(f"DHT {what} timed out after {timeout:.1f} s"))
            except MeshllmError as exc:
                _settle(loop, future, exc)
            except Exception as exc:
                _settle(loop, future, DhtError(f"DHT {what} failed: {type(exc).__name__}: {exc}"))
            finally:  # cancelled (stop, or the caller gave up): a no-op when already settled
                _settle(loop, future, DhtError(f"DHT {what} was cancelled: the node is stopping"))

        try:
            self._token.run_sync_soon(self._nursery.start_soon, run)
        except trio.RunFinishedError:
            raise DhtError("the DHT node has stopped") from None
        try:
            return await asyncio.wait_for(future, timeout + 1.0)
        except TimeoutError:
            raise DhtTimeout(f"DHT {what} timed out after {timeout:.1f} s") from None
        finally:
            if not future.done() and self._token is not None:
                with contextlib.suppress(Exception):
                    self._token.run_sync_soon(scope.cancel)

    async def _bootstrap(self, addrs: list[str]) -> int:
        import multiaddr
        import trio
        from libp2p.peer.peerinfo import info_from_p2p_addr

        reached = 0

        async def one(text: str) -> None:
            nonlocal reached
            try:
                info = info_from_p2p_addr(multiaddr.Multiaddr(text))
                with trio.fail_after(PEER_FETCH_TIMEOUT_S):
                    await self._host.connect(info)
                    await self._dht.routing_table.add_peer(info)
                reached += 1
            except Exception as exc:
                log.info("DHT bootstrap peer %s unreachable: %s", text, exc)

        async with trio.open_nursery() as nursery:
            for text in addrs:
                nursery.start_soon(one, text)
        if reached:
            await self._dht.refresh_routing_table()
        return reached

    async def _put(self, key: str, raw: bytes) -> None:
        await self._dht.put_value(key, raw)
        await self._dht.provide(MESHES_KEY)

    async def _get(self, key: str, mesh_id: str) -> list[bytes]:
        """Ask the network, not just our local copy: py-libp2p answers from the local store when it
        has one, which would pin a reader to the first (soon stale) listing it ever saw."""
        store, key_bytes = self._dht.value_store, key.encode()
        local = store.get(key_bytes)
        if local is not None and mesh_id not in self._published:
            store.remove(key_bytes)
        try:
            value = await self._dht.get_value(key)
        finally:
            if local is not None and store.get(key_bytes) is None:
                store.put_record(key_bytes, local)
        return [v for v in (value, local.value if local is not None else None) if v is not None]

    async def _find(self, timeout: float) -> list[bytes]:
        import trio

        providers = await self._providers()
        values: list[bytes] = list(self._published.values())
        me = self._host.get_id()

        async def ask(info: Any) -> None:
            try:
                with trio.fail_after(min(PEER_FETCH_TIMEOUT_S, timeout)):
                    values.extend(await self._fetch_listings(info))
            except Exception as exc:
                log.info("provider %s gave no listings: %s", info.peer_id, exc)

        async with trio.open_nursery() as nursery:
            for info in providers:
                if info.peer_id != me:
                    nursery.start_soon(ask, info)
        return values

    async def _providers(self) -> list[Any]:
        """Providers of MESHES_KEY from the network, merged with (and restoring) our local records.

        Like values, py-libp2p's ``find_providers`` answers from the local store alone when it holds
        any record, so a node would never see meshes published after its first look."""
        store = self._dht.provider_store
        key = MESHES_KEY.encode()
        local = store.providers.pop(key, {})
        try:
            found = await self._dht.find_providers(MESHES_KEY)
        finally:
            merged = store.providers.setdefault(key, {})
            for peer, record in local.items():
                merged.setdefault(peer, record)
        unique = {info.peer_id: info for info in found}
        for record in local.values():
            unique.setdefault(record.peer_id, record.provider_info)
        return list(unique.values())

    async def _fetch_listings(self, info: Any) -> list[bytes]:
        from libp2p.network.stream.exceptions import StreamEOF

        await self._host.connect(info)
        stream = await self._host.new_stream(info.peer_id, [LISTINGS_PROTOCOL])
        data = bytearray()
        limit = MAX_LISTINGS_PER_PEER * (MAX_LISTING_BYTES + 16)
        try:
            while len(data) <= limit:
                chunk = await stream.read(65536)
                if not chunk:
                    break
                data += chunk
        except StreamEOF:
            pass
        finally:
            await stream.close()
        if len(data) > limit:
            raise DecodeError(f"provider {info.peer_id} sent more than {limit} bytes of listings")
        try:
            listings = msgspec.msgpack.decode(bytes(data), type=list[bytes])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise DecodeError(f"provider {info.peer_id} sent malformed listings: {exc}") from exc
        return listings[:MAX_LISTINGS_PER_PEER]

    async def _serve_listings(self, stream: Any) -> None:
        try:
            await stream.write(msgspec.msgpack.encode(list(self._published.values())[:MAX_LISTINGS_PER_PEER]))
        finally:
            await stream.close()


def _listing_validator(clock: Callable[[], float]) -> Any:
    """A py-libp2p ``Validator`` for ``/meshllm/...`` keys (built here: libp2p is imported lazily)."""
    from libp2p.records.validator import Validator

    class ListingValidator(Validator):  # type: ignore[misc]
        def validate(self, key: str, value: bytes) -> None:
            try:
                check_listing_record(key, value, clock())
            except MeshllmError as exc:
                raise ValueError(f"invalid mesh listing: {exc}") from exc

        def select(self, key: str, values: list[bytes]) -> int:
            return pick_newest(values, clock())

    return ListingValidator()


def _verified(values: Sequence[bytes], now: float, expected_mesh_id: str | None = None) -> dict[str, MeshListing]:
    """The newest valid listing per mesh among ``values``; invalid ones are logged and dropped."""
    best: dict[str, MeshListing] = {}
    for value in values:
        try:
            listing = verify_listing(value, now, expected_mesh_id)
        except MeshllmError as exc:
            log_refused(log, "the DHT", exc)
            continue
        if listing.mesh_id not in best or listing.issued > best[listing.mesh_id].issued:
            best[listing.mesh_id] = listing
    return best


def _settle(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], outcome: Any) -> None:
    """Complete an asyncio future from the trio thread (an exception instance fails it)."""

    def apply() -> None:
        if future.done():
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    with contextlib.suppress(RuntimeError):  # the asyncio loop is already closed
        loop.call_soon_threadsafe(apply)
