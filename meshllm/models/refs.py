"""Model references: what the user names (a GGUF path or ``default``) and how the mesh names it.

Two names matter. The **model id** is what API clients put in ``"model"``: the file stem, short
and stable across machines that hold the same file under the same name. The **identity** adds a
sha256 prefix, because two nodes may hold different files under the same stem (another
quantisation, a re-conversion); routing and layer splits must only pair identical files.
Hashing a multi-GB file takes seconds, so it is lazy, done in the caller's worker thread, and
can be cached on disk keyed by path, size and mtime.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

from meshllm.errors import MeshllmError
from meshllm.models.default import default_model_path, default_model_sha256
from meshllm.models.metadata import GGUF_MAGIC, NotGGUF

DEFAULT_REF = "default"
SHORT_HASH = 12
"""Hex digits of sha256 in an identity: 48 bits, plenty to tell a handful of files apart."""


class ModelNotFound(MeshllmError):
    """A model reference names no readable file."""

    hint = "pass the path of a .gguf file, or `default` for the bundled Gemma 3 270M"


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


def resolve_model(spec: str | os.PathLike[str] | None = None, *, progress: bool = True) -> ModelRef:
    """Turn ``None``/``"default"``/a path into a :class:`ModelRef`, checking the file is a GGUF.

    ``progress`` is passed to the default model's first-use assembly.
    """
    if spec is None or str(spec) == DEFAULT_REF:
        path = default_model_path(progress=progress)
        return ModelRef(path=path, model_id=model_id_for(path), sha256=default_model_sha256(), is_default=True)
    path = Path(spec).expanduser()
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
        tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=0, sort_keys=True))
        os.replace(tmp, cache_file)
    return value


def _read_cache(cache_file: Path | None) -> dict[str, str]:
    if cache_file is None or not cache_file.exists():
        return {}
    try:
        data = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}  # a damaged cache only costs a re-hash
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
