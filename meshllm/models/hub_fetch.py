"""Byte ranges of one file on the Hugging Face hub, fetched in hashed pieces and pinned to one version.

Everything that reads model bytes from the hub goes through here: ``meshllm models pull`` (every
piece of the file), a split's coordinator (the header, to plan, and its own layers) and each
stage's worker (the header and its own layers' tensors only, ``models/hub_stage.py``).
``huggingface_hub`` builds the URL (``hf_hub_url`` against ``HF_ENDPOINT``), reads the file's
metadata (its size; for an LFS file the sha256 as its ETag; the CDN location the hub redirects
to), supplies the auth headers (``HF_TOKEN`` or the saved login) and retries 5xx answers and
dropped connections with backoff (``http_backoff``); each request here asks for one piece with a
``Range`` header.

**One version.** The metadata's size and ETag pin the version a fetch is for. Every range answer
must carry the same ETag (when it comes from the hub itself; from a CDN, the first answer's) and a
``Content-Range`` of that size: anything else means the file changed on the hub mid-fetch
(:class:`HubFileChanged`), and the caller starts over from fresh metadata.

**Pieces.** A fetch is a list of :class:`Want` (a piece's offset and length in the hub's file, and
where it goes in the output). Each piece arrives whole and is hashed; when another holder's digest
of the same piece is known (``reference``), they are compared. A piece that disagrees is fetched
again (up to three hub answers) until two sources agree; that version is kept, and every source
that sent another is named: ``hub <host>`` for a wrong hub answer, the other holder when the hub's
answers agree against it (:class:`Disagreement` records each).

**Resume.** :class:`PieceBook` keeps the digests of the pieces written beside the output, with the
version; a fetch that finds them re-hashes those pieces on disk and keeps the ones that match.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from meshllm.errors import MeshllmError
from meshllm.models.manifest import MODEL_ID, PIECE
from meshllm.models.refs import ModelNotFound

THREADS = 4
"""Pieces in flight at once per fetch (one TCP connection each to the hub or its CDN)."""
RETRY_WAIT_S = 0.25
"""First backoff after a 5xx or a dropped connection (doubling, at most :data:`RETRY_MAX_S`)."""
RETRY_MAX_S = 4.0
RETRIES = 5
MAX_ANSWERS = 3
"""Hub answers asked for one piece that disagrees with another holder, until two sources agree."""


class HubError(MeshllmError):
    """The hub could not be reached, or refused the download."""

    hint = "check HF_ENDPOINT and HF_TOKEN, or pull while online (HF_HUB_OFFLINE must be unset)"


class HubFileChanged(HubError):
    """The file on the hub is not the version the fetch started with (a new ETag or size)."""

    hint = "the repository was updated: the fetch starts again from the new version"


@dataclass(frozen=True)
class HubFile:
    """One version of one file on the hub: where to ask for its ranges, its size and ETag."""

    repo: str
    file: str
    url: str
    """Where ranges are asked: the hub's URL, or the CDN location it redirects to."""
    size: int
    etag: str
    redirected: bool = False

    @property
    def spec(self) -> str:
        return f"hf:{self.repo}/{self.file}"

    @property
    def model_id(self) -> str | None:
        """The file's sha256 when the hub states it (an LFS file's ETag), the id a model goes by."""
        return self.etag if MODEL_ID.match(self.etag) else None

    @property
    def host(self) -> str:
        """The host that answers range requests (named when it sends bad bytes)."""
        return urlparse(self.url).netloc


@dataclass(frozen=True)
class Want:
    """One piece to fetch: ``length`` bytes at ``offset`` of the hub's file, written at ``dest``."""

    offset: int
    length: int
    dest: int


@dataclass(frozen=True)
class Disagreement:
    """A piece whose first hub answer and another holder's digest differed, and who was wrong."""

    offset: int
    length: int
    bad: str
    """``hub <host>`` (its first answer was wrong) or the other holder's name."""


@dataclass
class FetchResult:
    fetched: int = 0
    """Bytes asked of the hub by this fetch (refetches included)."""
    kept: int = 0
    """Bytes already on disk from an earlier, interrupted fetch of the same version."""
    digests: dict[int, bytes] = field(default_factory=dict)
    """sha256 of every piece now in the output, by its offset in the hub's file."""
    disagreements: list[Disagreement] = field(default_factory=list)


Report = Callable[[int, int], None]
"""``report(bytes_done, bytes_total)``, called from the fetch's threads."""


@contextlib.contextmanager
def hub_errors(repo: str, file: str | None) -> Iterator[None]:
    """Turn huggingface_hub's exceptions into clear meshllm errors."""
    from huggingface_hub import errors

    where = repo if file is None else f"{repo}/{file}"
    try:
        yield
    except errors.GatedRepoError:
        raise ModelNotFound(f"{repo} is gated: accept its terms on the hub first",
                            hint="then set HF_TOKEN to a token of that account") from None
    except errors.RepositoryNotFoundError:
        raise ModelNotFound(f"no repository {repo} on the hub (or it is private)",
                            hint="check the name; for a private repository set HF_TOKEN") from None
    except errors.EntryNotFoundError:
        raise ModelNotFound(f"{repo} has no file {file}",
                            hint=f"name a quantization instead: hf:{repo}:QUANT") from None
    except errors.RevisionNotFoundError:
        raise ModelNotFound(f"{where}: no such revision") from None
    except errors.OfflineModeIsEnabled:
        raise ModelNotFound(f"{where} is not in the model library and HF_HUB_OFFLINE is set") from None
    except (errors.HfHubHTTPError, OSError, ValueError) as exc:
        raise HubError(f"could not download {where}: {exc}") from None
    except Exception as exc:  # httpx's transport errors after the retries ran out
        if type(exc).__module__.split(".")[0] not in ("httpx", "httpx2", "httpcore"):
            raise
        raise HubError(f"could not download {where}: {type(exc).__name__}: {exc}") from None


def locate(repo: str, file: str) -> HubFile:
    """The current version of ``repo/file``: its size, ETag and where to ask for ranges."""
    from huggingface_hub import file_download, hf_hub_url

    url = hf_hub_url(repo, file)
    with hub_errors(repo, file):
        meta = file_download.get_hf_file_metadata(url, retry_on_errors=True)
    if meta.size is None or not meta.etag:
        raise HubError(f"the hub states no size or ETag for {repo}/{file}: it cannot be fetched by range")
    location = meta.location or url
    return HubFile(repo, file, location, meta.size, meta.etag, redirected=location != url)


def _etag(raw: str | None) -> str | None:
    if not raw:
        return None
    return raw.removeprefix("W/").strip('"')


class VersionPin:
    """The ETag every range answer of one fetch must carry."""

    def __init__(self, hub: HubFile) -> None:
        self.hub = hub
        self.etag: str | None = None if hub.redirected else hub.etag
        self.lock = threading.Lock()

    def check(self, etag: str | None, total: int | None) -> None:
        if total is not None and total != self.hub.size:
            raise HubFileChanged(f"{self.hub.spec} is now {total} bytes, not {self.hub.size}: it changed on the hub")
        if etag is None:
            return
        with self.lock:
            if self.etag is None:
                self.etag = etag
        if etag != self.etag:
            raise HubFileChanged(f"{self.hub.spec} changed on the hub mid-fetch (ETag {self.etag[:12]} -> {etag[:12]})")


def get_range(hub: HubFile, offset: int, length: int, pin: VersionPin | None = None) -> bytes:
    """Bytes ``[offset, offset + length)`` of ``hub``'s file (blocking).

    Raises :class:`HubFileChanged` when the answer is of another version, :class:`HubError` when
    the hub does not answer the range as asked (after its retries).
    """
    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_backoff

    pin = pin or VersionPin(hub)
    headers = build_hf_headers()
    headers.update({"Range": f"bytes={offset}-{offset + length - 1}", "Accept-Encoding": "identity"})
    with hub_errors(hub.repo, hub.file):
        response = http_backoff("GET", hub.url, headers=headers, max_retries=RETRIES, base_wait_time=RETRY_WAIT_S,
                                max_wait_time=RETRY_MAX_S, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT)
        hf_raise_for_status(response)
    whole = response.status_code == 200 and offset == 0 and length == hub.size
    total = None
    if response.status_code == 206:
        _, _, after = response.headers.get("Content-Range", "").partition("/")
        total = int(after) if after.isdigit() else None
    elif not whole:
        raise HubError(f"{hub.host} answered a range request for {hub.spec} with HTTP {response.status_code}, "
                       "not 206: it cannot serve stages by range")
    pin.check(_etag(response.headers.get("X-Linked-Etag") or response.headers.get("ETag")), total)
    data = response.content
    if len(data) != length:
        raise HubError(f"{hub.host} sent {len(data)} bytes of {hub.spec} at {offset}, not the {length} asked for")
    return data


def pwrite_all(fd: int, data: bytes, at: int) -> None:
    """Write all of ``data`` at offset ``at`` of ``fd`` (``os.pwrite`` may write less)."""
    while data:
        n = os.pwrite(fd, data, at)
        data, at = data[n:], at + n


def pieces_of(offset: int, length: int, dest: int, piece: int = PIECE) -> list[Want]:
    """A range cut into pieces of at most ``piece`` bytes (the last one shorter)."""
    return [Want(offset + k, min(piece, length - k), dest + k) for k in range(0, length, piece)]


Write = Callable[[int, bytes], None]
"""``write(dest, data)``: put a verified piece into the output."""


def fetch_pieces(hub: HubFile, wants: list[Want], write: Write, *, reference: Mapping[int, bytes] | None = None,
                 reference_name: str = "another holder", reference_names: Mapping[int, str] | None = None,
                 have: Mapping[int, bytes] | None = None,
                 report: Report | None = None, on_piece: Callable[[int, bytes], None] | None = None,
                 stop: threading.Event | None = None, threads: int = THREADS) -> FetchResult:
    """Fetch ``wants`` from the hub in parallel, each hashed and cross-checked, into ``write`` (blocking).

    ``have`` holds digests of pieces already in the output (verified by the caller: skipped);
    ``reference`` other holders' digests by offset (named ``reference_names[offset]``, else
    ``reference_name``); ``on_piece(offset, digest)`` is called after each
    piece is written (the caller's :class:`PieceBook`); ``stop`` set ends the fetch early
    (:class:`HubError`).
    """
    reference = reference or {}
    pin = VersionPin(hub)
    result = FetchResult()
    lock = threading.Lock()
    todo = [w for w in wants if w.offset not in (have or {})]
    for w in wants:
        if have and w.offset in have:
            result.kept += w.length
            result.digests[w.offset] = have[w.offset]
    total = sum(w.length for w in wants)
    done = result.kept
    if report is not None:
        report(done, total)

    def one(want: Want) -> None:
        nonlocal done
        if stop is not None and stop.is_set():
            raise HubError(f"the fetch of {hub.spec} was stopped")
        data = get_range(hub, want.offset, want.length, pin)
        digest = hashlib.sha256(data).digest()
        fetched = want.length
        expected = reference.get(want.offset)
        disagreements = []
        if expected is not None and digest != expected:
            holder = (reference_names or {}).get(want.offset, reference_name)
            answers = [(digest, data)]
            while True:  # ask again until two sources agree (at most three hub answers)
                again = get_range(hub, want.offset, want.length, pin)
                fetched += want.length
                answers.append((hashlib.sha256(again).digest(), again))
                votes = [d for d, _ in answers] + [expected]
                winner = next((d for d in votes if votes.count(d) >= 2), None)
                if winner is not None:
                    break
                if len(answers) == MAX_ANSWERS:
                    raise HubError(f"{hub.host} sent {len(answers)} different versions of {hub.spec} bytes "
                                   f"{want.offset}+{want.length}, none matching {holder}'s")
            digest, data = next((d, b) for d, b in answers if d == winner)  # two votes: a hub answer has it
            if any(d != winner for d, _ in answers):
                disagreements.append(Disagreement(want.offset, want.length, f"hub {hub.host}"))
            if expected != winner:
                disagreements.append(Disagreement(want.offset, want.length, holder))
        write(want.dest, data)
        if on_piece is not None:
            on_piece(want.offset, digest)
        with lock:
            result.fetched += fetched
            result.digests[want.offset] = digest
            result.disagreements += disagreements
            done += want.length
            now = done
        if report is not None:
            report(now, total)

    if not todo:
        return result
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(todo))), thread_name_prefix="hub-fetch") as pool:
        futures = [pool.submit(one, w) for w in todo]
        finished, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in finished if f.exception() is not None), None)
        if failed is not None:
            for f in futures:
                f.cancel()
            exc = failed.exception()
            assert exc is not None
            raise exc
    return result


class PieceBook:
    """Digests of the pieces written to one output, for one version of the hub's file (JSON beside it).

    A book of another version (ETag or size) is empty: the caller starts the output over.
    """

    def __init__(self, path: Path, hub: HubFile) -> None:
        self.path = path
        self.hub = hub
        self.lock = threading.Lock()
        self.digests: dict[int, bytes] = {}
        with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
            raw = json.loads(path.read_text())
            if raw.get("etag") == hub.etag and raw.get("size") == hub.size:
                self.digests = {int(k): bytes.fromhex(v) for k, v in raw["pieces"].items()}

    def add(self, offset: int, digest: bytes) -> None:
        with self.lock:
            self.digests[offset] = digest
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"etag": self.hub.etag, "size": self.hub.size,
                                       "pieces": {str(k): v.hex() for k, v in self.digests.items()}}))
            os.replace(tmp, self.path)

    def verified(self, wants: list[Want], read: Callable[[int, int], bytes]) -> dict[int, bytes]:
        """The digests of ``wants`` whose bytes on disk (``read(dest, length)``) still match the book."""
        good = {}
        for w in wants:
            digest = self.digests.get(w.offset)
            if digest is not None and hashlib.sha256(read(w.dest, w.length)).digest() == digest:
                good[w.offset] = digest
        return good

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)
        self.digests = {}
