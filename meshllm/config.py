"""Where a node keeps its files, and its defaults.

The home folder is ``--home``, else ``$MESHLLM_HOME``, else ``~/.meshllm``. It holds the node key,
the owner keystore, the trust store, mesh keys, the admin token and ``config.toml`` (all optional;
defaults below). Everything in it is private to the user running the node: the folder is kept at
mode 0700 and every secret file at 0600, and a secret that other users can read is refused.
"""

from __future__ import annotations

import base64
import logging
import os
import secrets
import stat
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshllm.errors import ConfigError

if TYPE_CHECKING:  # config sits below the engines: models/ writes through write_private at import
    from meshllm.engine.recommended import Recommended

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
MIN_UPLOAD_MB_S = 1.0
"""The lowest ``model_upload_limit_mb_s``: below it a requester would take a holder's paced stream for a
stalled one (a 1 MiB chunk, shared by a few streams, must arrive within the transfer's stall deadline)."""
ADMIN_TOKEN_FILE = "admin.token"
"""The bearer token that authorises management calls to the node's API (see :func:`load_or_create_admin_token`)."""
ADMIN_TOKEN_BYTES = 32

log = logging.getLogger(__name__)


def resolve_home(home: str | os.PathLike[str] | None = None) -> Path:
    """The home folder to use: explicit, else ``$MESHLLM_HOME``, else ``~/.meshllm``."""
    if home is not None:
        return Path(home).expanduser()
    env = os.environ.get("MESHLLM_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".meshllm"


def ensure_home(home: Path, create: bool = True) -> Path:
    """Create the home folder (mode 0700) if missing; tighten an existing one; fail clearly if unusable.

    ``create=False`` leaves a missing home missing (commands that only read it), but still tightens
    and checks one that exists.

    A home that other users can enter lets them read the node's public files and, if writable,
    replace its keys or trust store. One created loosely (``mkdir`` under a permissive umask) is
    tightened to 0700 with a warning; one owned by another user is refused, since its owner could
    loosen it again at any time.
    """
    if not create and not home.exists():
        return home
    try:
        home.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create home folder {home}: {exc.strerror}",
                          hint="pass --home DIR or set MESHLLM_HOME to a writable folder") from exc
    if not home.is_dir():
        raise ConfigError(f"home {home} is not a folder", hint="pass --home DIR")
    info = home.stat()
    if info.st_uid != os.geteuid():
        raise ConfigError(f"home folder {home} belongs to another user (uid {info.st_uid})",
                          hint="use a home folder of your own: --home DIR or MESHLLM_HOME")
    loose = info.st_mode & (stat.S_IRWXG | stat.S_IRWXO)
    if loose:
        home.chmod(0o700)
        log.warning("tightened home folder %s from mode %o to 700: other users could read or replace its files",
                    home, info.st_mode & 0o777)
    return home


def _private_temp(path: Path, data: bytes) -> Path:
    """A fsynced temporary file (mode 0600) holding ``data`` beside ``path``, named uniquely per call.

    Unique per call, not per process: two threads of one node writing the same file (two peers
    asking for one manifest at once) must not rename each other's temporary file away.
    """
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` atomically with mode 0600 (temporary file in the same folder, then rename)."""
    tmp = _private_temp(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_private(path: Path, what: str) -> bytes:
    """The bytes of a secret file; :class:`ConfigError` if other users can access it or it cannot be read.

    A loose mode is refused, not repaired: it means the secret may already be known to someone
    else, and only the operator can decide whether it still is (``chmod 600``) or must be replaced.
    Raises FileNotFoundError when the file does not exist (callers decide what absence means).
    """
    info = path.stat()
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{what} {path} is accessible by other users (mode {info.st_mode & 0o777:o})",
                          hint=f"run `chmod 600 {path}` if it is still secret, else delete it")
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from exc


def create_private(path: Path, data: bytes) -> bool:
    """Write ``data`` at ``path`` (mode 0600) only if nothing is there yet; ``False`` if it already was.

    Race-free: the data goes to a private temporary file that is hard-linked into place, which fails
    if another process created the file first (that one then wins, whole, never half-written).
    """
    tmp = _private_temp(path, data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    return True


def load_or_create_admin_token(home: Path) -> str:
    """The node's admin token, created (random, mode 0600) at first start and reused after.

    Whoever can read ``$MESHLLM_HOME/admin.token`` (the user running the node, through the CLI or
    the console) may make management calls; nobody else can. A token file that other users can
    read is no longer a secret, and a garbled one is no token: either is replaced by a fresh token
    (with a warning) rather than used.
    """
    path = ensure_home(home) / ADMIN_TOKEN_FILE
    try:
        token = _token_text(read_private(path, "admin token"))
        if token is not None:
            return token
        log.warning("admin token file %s is malformed; writing a new one", path)
    except FileNotFoundError:
        fresh = _new_token()
        if create_private(path, fresh.encode() + b"\n"):
            return fresh
        return load_or_create_admin_token(home)  # another process created it first: use theirs
    except ConfigError as exc:
        log.warning("%s; writing a new admin token", exc)
    fresh = _new_token()
    write_private(path, fresh.encode() + b"\n")
    return fresh


def read_admin_token(home: Path) -> str | None:
    """The admin token in ``home`` if this user can read it, else ``None`` (for clients such as the CLI)."""
    try:
        return _token_text((home / ADMIN_TOKEN_FILE).read_bytes())
    except OSError:
        return None


def _new_token() -> str:
    return base64.urlsafe_b64encode(secrets.token_bytes(ADMIN_TOKEN_BYTES)).decode().rstrip("=")


def _token_text(data: bytes) -> str | None:
    """The token in a token file, or ``None`` when the file is empty or garbled."""
    text = data.decode("ascii", "replace").strip()
    if len(text) < 16 or not all(c.isalnum() or c in "-_" for c in text):
        return None
    return text


DHT_BOOTSTRAP_ENV = "MESHLLM_DHT_BOOTSTRAP"
"""DHT bootstrap multiaddrs, separated by commas or spaces (``none``: no DHT); over ``config.toml``."""
DEFAULT_DHT_BOOTSTRAP: tuple[str, ...] = (
    "/ip4/104.131.131.82/tcp/4001/p2p/QmaCpDMGvV2BGHeYERUEnRQAwe3N8SzbUtfsmvsqQLuvuJ",
)
"""The public IPFS Amino DHT's long-standing bootstrap peer: where a mesh lookup starts when nothing
else is set (``--dht-bootstrap``, ``$MESHLLM_DHT_BOOTSTRAP``, ``dht_bootstrap`` in ``config.toml``).
Used only by commands that look a mesh up (``join MESH-ID``, ``serve --auto``, ``discover``), never
to start a node's DHT unasked."""


def dht_bootstrap(option: tuple[str, ...] | list[str], config: Config, *, default: bool) -> tuple[list[str], str]:
    """DHT bootstrap peers and where they came from: ``--dht-bootstrap``, else ``$MESHLLM_DHT_BOOTSTRAP``,
    else ``dht_bootstrap`` in ``config.toml`` (an empty list there means none), else, with ``default``,
    :data:`DEFAULT_DHT_BOOTSTRAP`."""
    if option:
        return list(option), "--dht-bootstrap"
    env = os.environ.get(DHT_BOOTSTRAP_ENV)
    if env is not None:
        text = env.strip()
        peers = [] if text.lower() in ("", "none") else [p for p in text.replace(",", " ").split() if p]
        return peers, f"${DHT_BOOTSTRAP_ENV}"
    if config.dht_bootstrap is not None:
        return list(config.dht_bootstrap), "dht_bootstrap in config.toml"
    return (list(DEFAULT_DHT_BOOTSTRAP), "the default bootstrap list") if default else ([], "nothing set")


@dataclass(frozen=True)
class Config:
    """Settings from ``config.toml``; every field has a working default."""

    api_port: int = DEFAULT_API_PORT
    mesh_port: int = DEFAULT_MESH_PORT
    name: str = ""
    dht_bootstrap: tuple[str, ...] | None = None
    """DHT bootstrap multiaddrs (None: not set, so lookups use :data:`DEFAULT_DHT_BOOTSTRAP`; empty: none)."""
    model_dirs: tuple[str, ...] = ()
    """Folders whose GGUFs the model library indexes in place (never deletes)."""
    models_disk_budget_gb: float | None = None
    """Most disk the library's own files (downloads, fetched models and stage files) may take."""
    model_upload_limit_mb_s: float | None = None
    """Most MB/s this node sends model files to peers, every transfer together (None: no cap)."""
    speculate: str = "auto"
    """Speculative decoding: ``auto``, ``on`` or ``off`` (``meshllm serve --speculate``)."""
    split_audit: float | None = None
    """Share of split requests a coordinator audits (``meshllm serve --split-audit``); None: the default."""
    models: dict[str, Recommended] = field(default_factory=dict)
    """``[models.NAME]`` sections: a model's recommended sampling by model id or bundled reference
    (``meshllm.engine.recommended``), for what requests leave out."""


SPECULATE_MODES = ("auto", "on", "off")


def load_config(home: Path) -> Config:
    """Read ``config.toml`` from the home folder; missing file means defaults."""
    path = home / CONFIG_FILE
    if not path.exists():
        return Config()
    try:
        raw: dict[str, Any] = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}", hint="fix or delete the file") from exc
    known = {"api_port", "mesh_port", "name", "dht_bootstrap", "model_dirs", "models_disk_budget_gb", "speculate",
             "split_audit", "models", "model_upload_limit_mb_s"}
    unknown = set(raw) - known
    if unknown:
        raise ConfigError(f"{path}: unknown settings {sorted(unknown)}", hint=f"known settings: {sorted(known)}")
    speculate = raw.get("speculate", "auto")
    if speculate not in SPECULATE_MODES:
        raise ConfigError(f"{path}: speculate = {speculate!r} is not one of {', '.join(SPECULATE_MODES)}")
    try:
        return Config(
            api_port=int(raw.get("api_port", DEFAULT_API_PORT)),
            mesh_port=int(raw.get("mesh_port", DEFAULT_MESH_PORT)),
            name=str(raw.get("name", "")),
            dht_bootstrap=tuple(str(a) for a in raw["dht_bootstrap"]) if "dht_bootstrap" in raw else None,
            model_dirs=tuple(str(d) for d in raw.get("model_dirs", ())),
            models_disk_budget_gb=_budget(raw.get("models_disk_budget_gb")),
            model_upload_limit_mb_s=_upload(raw.get("model_upload_limit_mb_s")),
            speculate=speculate,
            split_audit=_rate(raw.get("split_audit")),
            models=_models(raw.get("models", {})),
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path}: {exc}") from exc


def _models(value: Any) -> dict[str, Recommended]:
    if not isinstance(value, dict):
        raise ValueError("models must be a table of [models.NAME] sections")
    from meshllm.engine.recommended import from_config  # not at import: see the TYPE_CHECKING import above

    return {str(name): from_config(section, str(name)) for name, section in value.items()}


def _rate(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise ValueError(f"split_audit must be a share between 0 and 1, not {value!r}")
    return float(value)


def _upload(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < MIN_UPLOAD_MB_S:
        raise ValueError(f"model_upload_limit_mb_s must be a number of MB/s of at least {MIN_UPLOAD_MB_S}, "
                         f"not {value!r}")
    return float(value)


def _budget(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"models_disk_budget_gb must be a positive number of GB, not {value!r}")
    return float(value)
