"""Where a node keeps its files, and its defaults.

The home folder is ``--home``, else ``$MESHLLM_HOME``, else ``~/.meshllm``. It holds the node key,
the owner keystore, the trust store, mesh keys and ``config.toml`` (all optional; defaults below).
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshllm.errors import ConfigError

DEFAULT_API_PORT = 9337
DEFAULT_MESH_PORT = 9338
NODE_KEY_FILE = "node.key"
OWNER_KEYSTORE_FILE = "owner.keystore"
NODE_CERT_FILE = "node.cert"
TRUST_FILE = "trust.json"
MESH_KEY_FILE = "mesh.key"
REVOCATIONS_FILE = "revocations.msgpack"
MODEL_HASHES_FILE = "model-hashes.json"
CONFIG_FILE = "config.toml"


def resolve_home(home: str | os.PathLike[str] | None = None) -> Path:
    """The home folder to use: explicit, else ``$MESHLLM_HOME``, else ``~/.meshllm``."""
    if home is not None:
        return Path(home).expanduser()
    env = os.environ.get("MESHLLM_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".meshllm"


def ensure_home(home: Path) -> Path:
    """Create the home folder (mode 0700) if missing; fail clearly if it cannot be used."""
    try:
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create home folder {home}: {exc.strerror}",
                          hint="pass --home DIR or set MESHLLM_HOME to a writable folder") from exc
    if not home.is_dir():
        raise ConfigError(f"home {home} is not a folder", hint="pass --home DIR")
    return home


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` atomically with mode 0600 (temp file in the same folder, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class Config:
    """Settings from ``config.toml``; every field has a working default."""

    api_port: int = DEFAULT_API_PORT
    mesh_port: int = DEFAULT_MESH_PORT
    name: str = ""
    dht_bootstrap: tuple[str, ...] = ()


def load_config(home: Path) -> Config:
    """Read ``config.toml`` from the home folder; missing file means defaults."""
    path = home / CONFIG_FILE
    if not path.exists():
        return Config()
    try:
        raw: dict[str, Any] = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}", hint="fix or delete the file") from exc
    known = {"api_port", "mesh_port", "name", "dht_bootstrap"}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"{path}: unknown settings {sorted(unknown)}", hint=f"known settings: {sorted(known)}")
    try:
        return Config(
            api_port=int(raw.get("api_port", DEFAULT_API_PORT)),
            mesh_port=int(raw.get("mesh_port", DEFAULT_MESH_PORT)),
            name=str(raw.get("name", "")),
            dht_bootstrap=tuple(str(a) for a in raw.get("dht_bootstrap", ())),
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc
