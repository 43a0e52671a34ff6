"""Model references: what the user names and how the mesh names it, resolved in one place.

A reference is a GGUF path, a bundled model (``default``: SmolLM2-135M-Instruct, ``smollm2``,
``gemma``: Gemma 3 270M; ``models/bundled.py``), a name or id from the model library
(``models/library.py``), or ``hf:ORG/REPO/FILE.gguf`` / ``hf:ORG/REPO:QUANT`` (downloaded into the
library, ``models/hub.py``). :func:`resolve_model` tries them in that order.

Two names matter. The **model id** is what API clients put in ``"model"``: the file stem, short
and stable across machines that hold the same file under the same name. The **identity** adds a
sha256 prefix, because two nodes may hold different files under the same stem (another
quantisation, a re-conversion); routing and layer splits must only pair identical files, and the
library and transfers name a model by its full sha256 alone. Hashing a multi-GB file takes
seconds, so it is lazy, done in the caller's worker thread, and cached on disk keyed by path, size
and mtime.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from meshllm.config import write_private
from meshllm.errors import MeshllmError
from meshllm.models.bundled import BUNDLED, DEFAULT_REF, bundled_model_path, bundled_model_sha256
from meshllm.models.metadata import GGUF_MAGIC, NotGGUF

if TYPE_CHECKING:
    from meshllm.models.hub import Report
    from meshllm.models.library import Library

SHORT_HASH = 12
"""Hex digits of sha256 in an identity: 48 bits, plenty to tell a handful of files apart."""


class ModelNotFound(MeshllmError):
    """A model reference names no readable file."""

    hint = ("pass a .gguf path, a name or id from `meshllm models list`, hf:ORG/REPO/FILE.gguf, "
            "or a bundled model: `default` (SmolLM2-135M-Instruct) or `gemma` (Gemma 3 270M)")


@dataclass(frozen=True)
class ModelRef:
    """A resolved model: its file, API id and (once hashed) content hash."""

    path: Path
    model_id: str
    sha256: str | None = None
    is_default: bool = False

    @property
    def identity(self) -> str:
        """``<model_id>@<sha256 prefix>``; just the id until the file has been hashed."""
        return f"{self.model_id}@{self.sha256[:SHORT_HASH]}" if self.sha256 else self.model_id

    def hashed(self, cache_file: Path | None = None) -> ModelRef:
        """This reference with ``sha256`` filled in (blocking: call it from a worker thread)."""
        if self.sha256:
            return self
        return replace(self, sha256=file_sha256(self.path, cache_file))


def model_id_for(path: Path) -> str:
    """The API id of a model file: its name without ``.gguf``."""
    return path.name[: -len(".gguf")] if path.name.lower().endswith(".gguf") else path.name


def resolve_model(spec: str | os.PathLike[str] | None = None, *, progress: bool = True,
                  library: Library | None = None, report: Report | None = None) -> ModelRef:
    """Turn a reference into a :class:`ModelRef`, checking the file is a GGUF.

    ``None``/``"default"`` is the default model and ``"gemma"``/``"smollm2"`` the other bundled
    names (``progress`` shows gemma's first-use assembly); a path
    that exists is used in place; ``hf:...`` is pulled into ``library`` (``report`` gets the
    download's progress, else huggingface_hub draws its bar); anything else is looked up in
    ``library`` by name or id. Raises :class:`ModelNotFound` when nothing matches (the node may
    then look for the model in the mesh).
    """
    if spec is None or str(spec) in BUNDLED:
        name = DEFAULT_REF if spec is None else str(spec)
        path = bundled_model_path(name, progress=progress)
        return ModelRef(path=path, model_id=model_id_for(path), sha256=bundled_model_sha256(name),
                        is_default=BUNDLED[name] == BUNDLED[DEFAULT_REF])
    text = str(spec)
    if text.startswith("hf:"):
        if library is None:
            raise ModelNotFound(f"{text}: Hugging Face references need the node's model library")
        from meshllm.models.hub import pull

        entry = pull(text, library, report=report)
        return ModelRef(path=entry.file, model_id=entry.name, sha256=entry.id)
    path = Path(text).expanduser()
    if not path.exists() and library is not None and not looks_like_path(text):
        entry = library.find(text)
        if entry is not None:
            library.touch(entry)
            return ModelRef(path=entry.file, model_id=entry.name, sha256=entry.id)
        raise ModelNotFound(f"no model {text!r} in the library, and no such file")
    if not path.is_file():
        raise ModelNotFound(f"model file {path} does not exist" if not path.exists() else f"{path} is not a file")
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelNotFound(f"cannot read model file {path}: {exc.strerror}") from exc
    if magic != GGUF_MAGIC:
        raise NotGGUF(f"{path} is not a GGUF file")
    return ModelRef(path=path.resolve(), model_id=model_id_for(path))


def looks_like_path(text: str) -> bool:
    """A reference with a folder separator or a ``.gguf`` suffix names a file, never a library entry."""
    return "/" in text or os.sep in text or text.lower().endswith(".gguf") or text.startswith(("~", "."))


def file_sha256(path: Path, cache_file: Path | None = None) -> str:
    """sha256 of a file, remembered in ``cache_file`` (JSON) under its path, size and mtime."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    cache = _read_cache(cache_file)
    if key in cache:
        return cache[key]
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    value = digest.hexdigest()
    if cache_file is not None:
        cache[key] = value
        write_private(cache_file, json.dumps(cache, indent=0, sort_keys=True).encode())
    return value


def _read_cache(cache_file: Path | None) -> dict[str, str]:
    if cache_file is None or not cache_file.exists():
        return {}
    try:
        data = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}  # a damaged cache only costs a re-hash
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
