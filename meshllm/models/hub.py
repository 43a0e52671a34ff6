"""Hugging Face references: ``hf:ORG/REPO/FILE.gguf`` and ``hf:ORG/REPO:QUANT``, downloaded into the library.

``huggingface_hub`` does the talking: it builds the file URL against ``HF_ENDPOINT``, sends
``HF_TOKEN`` (or the saved login), reads the file's metadata (size, and for LFS files the sha256 as
its ETag), lists the repository to match ``:QUANT``, refuses in offline mode (``HF_HUB_OFFLINE``),
and streams the bytes with its progress bar. The download goes to ``models/incoming/<etag>.part``
and resumes from what is there (an HTTP range request) when a pull was interrupted; the finished
file is hashed, checked against the hub's sha256, and moved into the library under its id.

A reference already in the library (the same repository and file) resolves without any network
call, so a second pull is instant and works offline.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from meshllm.errors import MeshllmError
from meshllm.models.library import Library, LibraryEntry
from meshllm.models.manifest import MODEL_ID
from meshllm.models.refs import ModelNotFound, file_sha256, model_id_for

HF_PREFIX = "hf:"
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_SHARD = re.compile(r"-\d{5}-of-\d{5}\.gguf$", re.IGNORECASE)


class HubError(MeshllmError):
    """The hub could not be reached, or refused the download."""

    hint = "check HF_ENDPOINT and HF_TOKEN, or pull while online (HF_HUB_OFFLINE must be unset)"


@dataclass(frozen=True)
class HubRef:
    """A parsed ``hf:`` reference: a repository and either a file in it or a quantization to match."""

    repo: str
    file: str | None = None
    quant: str | None = None

    @property
    def prefix(self) -> str:
        return f"{HF_PREFIX}{self.repo}/"

    def source(self, file: str) -> str:
        """The library ``source`` of a file of this repository."""
        return f"{self.prefix}{file}"


def is_hub_ref(spec: str) -> bool:
    return spec.startswith(HF_PREFIX)


def parse_hub_ref(spec: str) -> HubRef:
    """``hf:ORG/REPO/FILE.gguf``, ``hf:ORG/REPO:QUANT`` or ``hf:ORG/REPO`` (the repository's only GGUF)."""
    body = spec[len(HF_PREFIX):].strip()
    quant = None
    if ":" in body:
        body, quant = body.rsplit(":", 1)
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", quant):
            raise ModelNotFound(f"{spec!r}: {quant!r} is not a quantization name (e.g. Q4_K_M)")
    parts = body.split("/")
    repo, file = "/".join(parts[:2]), "/".join(parts[2:]) or None
    if not _REPO.match(repo) or (file is not None and (not file.lower().endswith(".gguf") or ".." in parts)):
        raise ModelNotFound(f"{spec!r} is not a Hugging Face reference",
                            hint="write hf:ORG/REPO/FILE.gguf or hf:ORG/REPO:QUANT")
    if file is not None and quant is not None:
        raise ModelNotFound(f"{spec!r} names both a file and a quantization; name one")
    return HubRef(repo, file, quant)


def _matches(file: str, quant: str) -> bool:
    """Whether ``file`` is the ``quant`` quantization (``Q4_K_M`` matches ``model-Q4_K_M.gguf``, any case)."""
    stem = PurePosixPath(file).name[: -len(".gguf")].lower()
    return re.search(rf"(^|[-_.]){re.escape(quant.lower())}($|[-_.])", stem) is not None


def cached(ref: HubRef, library: Library) -> LibraryEntry | None:
    """The library's copy of what ``ref`` names, if it has one (no network)."""
    for entry in library.entries():
        if entry.kind != "whole" or not entry.source.startswith(ref.prefix):
            continue
        file = entry.source[len(ref.prefix):]
        if (ref.file is not None and file == ref.file) or (ref.quant is not None and _matches(file, ref.quant)) or (
                ref.file is None and ref.quant is None):
            return entry
    return None


Report = Callable[[int, int | None], None]
"""``report(bytes_done, bytes_total)`` during a download (the node turns it into transfer events)."""


def pull(spec: str, library: Library, *, report: Report | None = None) -> LibraryEntry:
    """The library entry of ``spec`` (``hf:...``), downloading (or resuming) it when it is not there yet.

    Without ``report`` the download shows huggingface_hub's progress bar on stderr.
    """
    ref = parse_hub_ref(spec)
    entry = cached(ref, library)
    if entry is not None:
        library.touch(entry)
        return entry
    from huggingface_hub import constants

    if constants.is_offline_mode():
        raise ModelNotFound(f"{spec} is not in the model library and HF_HUB_OFFLINE is set",
                            hint="unset HF_HUB_OFFLINE and pull it once: `meshllm models pull REF`")
    file = ref.file or _choose_file(ref, spec)
    return _download(ref, file, library, report)


def _choose_file(ref: HubRef, spec: str) -> str:
    """The one GGUF of the repository that ``ref.quant`` (or nothing) selects."""
    from huggingface_hub import HfApi

    with _hub_errors(ref, None):
        files = HfApi().list_repo_files(ref.repo)
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    chosen = [f for f in ggufs if ref.quant is None or _matches(f, ref.quant)]
    if len(chosen) > 1 and all(_SHARD.search(f) for f in chosen):
        raise ModelNotFound(f"{spec} is a GGUF split into {len(chosen)} shards, which meshllm cannot load yet")
    if len(chosen) != 1:
        listing = ", ".join(ggufs[:12]) or "none"
        what = f"no GGUF matching {ref.quant!r}" if not chosen else f"{len(chosen)} GGUFs"
        raise ModelNotFound(f"{ref.repo} has {what}; its GGUF files: {listing}",
                            hint="name one: hf:ORG/REPO/FILE.gguf or hf:ORG/REPO:QUANT")
    return chosen[0]


def _download(ref: HubRef, file: str, library: Library, report: Report | None) -> LibraryEntry:
    from huggingface_hub import file_download, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(ref.repo, file)
    with _hub_errors(ref, file):
        meta = file_download.get_hf_file_metadata(url)
    expected = meta.etag if meta.etag and MODEL_ID.match(meta.etag) else None
    tag = expected or hashlib.sha256(f"{ref.repo}/{file}@{meta.commit_hash}".encode()).hexdigest()
    part = library.incoming(f"{tag}.part")
    have = part.stat().st_size if part.exists() else 0
    if meta.size is not None and have > meta.size:
        part.unlink()
        have = 0
    if meta.size is not None:
        library.reserve(meta.size - have)
    bar = None if report is None else _reporting_bar(report, meta.size)
    with _hub_errors(ref, file), part.open("ab") as out:
        file_download.http_get(meta.location or url, out, resume_size=have, headers=build_hf_headers(),
                               expected_size=meta.size, displayed_filename=PurePosixPath(file).name, tqdm_class=bar)
    digest = file_sha256(part)
    if expected is not None and digest != expected:
        part.unlink(missing_ok=True)
        raise HubError(f"{ref.repo}/{file} arrived with sha256 {digest[:12]}, the hub says {expected[:12]}",
                       hint="pull it again (the damaged download was deleted)")
    existing = library.whole(digest)
    if existing is not None:  # the same bytes are already here under another name: keep one copy
        part.unlink()
        return existing
    return library.commit(part, model_id=digest, name=model_id_for(Path(PurePosixPath(file).name)),
                          source=ref.source(file))


def _reporting_bar(report: Report, total: int | None) -> type:
    """A huggingface_hub progress bar class that shows nothing and calls ``report`` instead."""
    from huggingface_hub.utils import tqdm as hub_tqdm

    class Bar(hub_tqdm):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self.done = int(kwargs.get("initial") or 0)
            report(self.done, total)

        def update(self, n: float | None = 1) -> bool | None:
            self.done += int(n or 0)
            report(self.done, total)
            return None

    return Bar


@contextlib.contextmanager
def _hub_errors(ref: HubRef, file: str | None) -> Iterator[None]:
    """Turn huggingface_hub's exceptions into clear meshllm errors."""
    from huggingface_hub import errors

    where = ref.repo if file is None else f"{ref.repo}/{file}"
    try:
        yield
    except errors.GatedRepoError:
        raise ModelNotFound(f"{ref.repo} is gated: accept its terms on the hub first",
                            hint="then set HF_TOKEN to a token of that account") from None
    except errors.RepositoryNotFoundError:
        raise ModelNotFound(f"no repository {ref.repo} on the hub (or it is private)",
                            hint="check the name; for a private repository set HF_TOKEN") from None
    except errors.EntryNotFoundError:
        raise ModelNotFound(f"{ref.repo} has no file {file}",
                            hint=f"name a quantization instead: hf:{ref.repo}:QUANT") from None
    except errors.RevisionNotFoundError:
        raise ModelNotFound(f"{where}: no such revision") from None
    except errors.OfflineModeIsEnabled:
        raise ModelNotFound(f"{where} is not in the model library and HF_HUB_OFFLINE is set") from None
    except (errors.HfHubHTTPError, OSError, ValueError) as exc:
        raise HubError(f"could not download {where}: {exc}") from None
