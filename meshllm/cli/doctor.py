"""``meshllm doctor``: what is wrong with this install, this home and the running node, and how to fix it.

Each check gives one line: ``ok``, ``warn`` (worth knowing, not broken), ``fail`` (with a fix) or
``skip`` (nothing to check, e.g. no peers). The command exits 1 when any check fails. The checks
read; none changes anything (the home is not created or tightened, the library index is not
rewritten).

Checks on this machine: the llama-cpp-python build and the GPU backend it found, the home's
ownership and mode, each secret file's mode and the node key itself, ``config.toml``, the trust
store, the API and mesh ports (free, or held by this node), disk space and the model library's
budget, the library's model files (``--verify-models`` hashes them). With a node running (``--api``):
each peer's reachability over UDP, this node's observed address and NAT reachability, and the
clock skew each peer's signed record allows to bound.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import socket
import stat
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import click

from meshllm.cli.api_client import DEFAULT_API, NodeApi
from meshllm.cli.common import api_option, echo_json, json_option
from meshllm.config import (
    ADMIN_TOKEN_FILE,
    DEFAULT_API_PORT,
    MESH_KEY_FILE,
    NODE_KEY_FILE,
    OWNER_KEYSTORE_FILE,
    TRUST_FILE,
    Config,
    load_config,
    resolve_home,
)
from meshllm.errors import MeshllmError

Outcome = Literal["ok", "warn", "fail", "skip"]
SECRETS = (NODE_KEY_FILE, ADMIN_TOKEN_FILE, MESH_KEY_FILE, OWNER_KEYSTORE_FILE, TRUST_FILE)
"""Files of the home that other users must not read or replace."""
MIN_FREE_BYTES = 1 << 30
"""Less free disk than this under the home fails: a model download or a stage file would not fit."""
CLOCK_SKEW_S = 60.0
"""Records signed further in the future than this are refused by peers (meshllm.identity.signing)."""


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    name: str
    outcome: Outcome
    detail: str
    fix: str = ""


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


# ---- this machine --------------------------------------------------------------------------------

def check_install() -> Iterator[Check]:
    """llama-cpp-python imports, and which compute devices its ggml found (a GPU or the CPU only)."""
    try:
        import llama_cpp
    except Exception as exc:  # a broken native build raises OSError, ImportError, or worse
        yield Check("llama-cpp", "fail", f"llama-cpp-python does not import: {type(exc).__name__}: {exc}",
                    "run ./install.sh again (it builds llama-cpp-python for this CPU; set CMAKE_ARGS for a GPU)")
        return
    from meshllm.engine.capacity import compute_devices

    gpus = [d for d in compute_devices() if d.kind != "cpu"]
    backend = ", ".join(f"{d.name} ({d.description})" for d in gpus) if gpus else "none found (CPU only)"
    yield Check("llama-cpp", "ok", f"llama-cpp-python {llama_cpp.__version__}; GPU backend: {backend}")


def check_home(home: Path) -> Iterator[Check]:
    """The home exists, is ours, and only we can enter it; its secret files are ours alone."""
    if not home.is_dir():
        yield Check("home", "fail", f"no home folder at {home}",
                    "start a node once (`meshllm serve`), or pass --home / set $MESHLLM_HOME")
        return
    info = home.stat()
    if info.st_uid != os.geteuid():
        yield Check("home", "fail", f"{home} belongs to another user (uid {info.st_uid})",
                    "use a home folder of your own: --home DIR")
    elif info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        yield Check("home", "fail", f"{home} is open to other users (mode {_mode(home):o})", f"chmod 700 {home}")
    else:
        yield Check("home", "ok", f"{home} (mode 700)")
    for name in SECRETS:
        path = home / name
        if not path.exists():
            if name == NODE_KEY_FILE:
                yield Check(name, "warn", f"no node key yet at {path}", "a node creates it at its first start")
            continue
        if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            yield Check(name, "fail", f"{path} is readable by other users (mode {_mode(path):o})",
                        f"chmod 600 {path} if it is still secret, else replace it")
            continue
        yield from _parse(name, home, path)


def _parse(name: str, home: Path, path: Path) -> Iterator[Check]:
    """A secret file with a safe mode: check that it also reads as what it is."""
    from meshllm.identity.keys import NodeKey
    from meshllm.identity.trust import TrustStore

    try:
        if name == NODE_KEY_FILE:
            yield Check(name, "ok", f"node id {NodeKey.load(home).node_id[:16]}... (mode 600)")
        elif name == TRUST_FILE:
            store = TrustStore.load(home)
            yield Check("trust store", "ok", f"policy {store.data.policy}, {len(store.data.owners)} trusted owner(s)")
        else:
            yield Check(name, "ok", f"{path} (mode {_mode(path):o})")
    except MeshllmError as exc:
        yield Check(name, "fail", str(exc), exc.hint or f"restore {path} from a backup, or delete it")


def check_config(home: Path) -> Iterator[Check]:
    try:
        load_config(home)
    except MeshllmError as exc:
        yield Check("config", "fail", str(exc), exc.hint or "fix or delete the file")
        return
    found = (home / "config.toml").exists()
    yield Check("config", "ok", "config.toml readable" if found else "defaults (no config.toml)")


def port_holder(kind: Literal["tcp", "udp"], host: str, port: int) -> str | None:
    """Why ``port`` cannot be bound (None: it is free); the socket is closed at once."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM if kind == "tcp" else socket.SOCK_DGRAM)
    try:
        if kind == "tcp":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the node binds it
        sock.bind((host, port))
    except OSError as exc:
        return "in use by another program" if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
    finally:
        sock.close()
    return None


def check_ports(api_port: int, mesh_port: int, status: dict[str, Any] | None) -> Iterator[Check]:
    """The API (TCP) and mesh (UDP) ports: held by the running node, or free for one to start."""
    held = set()
    if status is not None:
        held = {_port(status.get("api_url", "")), _port(status.get("mesh_addr", ""))}
    for name, kind, host, port, flag in (("api port", "tcp", "127.0.0.1", api_port, "--port"),
                                         ("mesh port", "udp", "0.0.0.0", mesh_port, "--mesh-port")):
        if port == 0:
            yield Check(name, "skip", "port 0: the node picks a free one")
        elif port in held:
            yield Check(name, "ok", f"{kind.upper()} {port} is this node's")
        elif (why := port_holder(kind, host, port)) is not None:  # type: ignore[arg-type]
            yield Check(name, "fail", f"{kind.upper()} port {port} is {why}",
                        f"stop what holds it, or choose another: meshllm serve {flag} N (or {name.replace(' ', '_')} "
                        "in config.toml)")
        else:
            yield Check(name, "ok", f"{kind.upper()} {port} is free")


def _first(*ports: int | None) -> int:
    return next(p for p in ports if p is not None)


def _port(addr: str) -> int | None:
    tail = addr.rstrip("/").rsplit(":", 1)
    return int(tail[1]) if len(tail) == 2 and tail[1].isdigit() else None


def check_disk(home: Path, config: Config) -> Iterator[Check]:
    """Free space where the home is, and the library's own files against its budget."""
    from meshllm.models.library import Library

    where = home if home.exists() else home.parent
    free = shutil.disk_usage(where).free
    if free < MIN_FREE_BYTES:
        yield Check("disk", "fail", f"{free / 1e9:.2f} GB free under {where}",
                    "free some space, or move the home (--home) to a larger disk")
    else:
        yield Check("disk", "ok", f"{free / 1e9:.1f} GB free under {where}")
    if config.models_disk_budget_gb is not None and home.exists():
        used = Library.for_home(home).disk_bytes()
        budget = config.models_disk_budget_gb * 1e9
        outcome: Outcome = "fail" if used > budget else "ok"
        yield Check("disk budget", outcome, f"models take {used / 1e9:.2f} of {budget / 1e9:.2f} GB",
                    "raise models_disk_budget_gb in config.toml or remove models: meshllm models rm REF"
                    if outcome == "fail" else "")


def check_models(home: Path, deep: bool) -> Iterator[Check]:
    """Every file the model library indexed is still there, unchanged, a GGUF (and, deep, hashes to its id)."""
    from meshllm.models.library import Library

    if not home.exists():
        return
    count, problems = Library.for_home(home).check(deep)
    for entry, why in problems:
        yield Check(f"model {entry.name}", "fail", why,
                    f"fetch it again (meshllm models pull {entry.source or entry.name}) or forget it "
                    f"(meshllm models rm {entry.short})")
    if not problems:
        how = "hashes match their ids" if deep else "sizes and times as indexed (--verify-models hashes them)"
        yield Check("models", "ok" if count else "skip", f"{count} library file(s): {how}" if count else
                    "the model library is empty")


# ---- the running node ----------------------------------------------------------------------------

def check_node(api: NodeApi) -> tuple[Check, dict[str, Any] | None]:
    try:
        status = api.get_json("/api/status", timeout=5.0)
    except MeshllmError as exc:
        return Check("node", "warn", f"not running at {api.url} ({exc})", "start it: meshllm serve"), None
    if not isinstance(status, dict):
        return Check("node", "fail", f"{api.url} did not answer with a node status", "check --api"), None
    return Check("node", "ok", f"{status.get('name')} ({str(status.get('node_id'))[:16]}...) in "
                               f"{status.get('mesh_id')}, API {status.get('api_url')}"), status


def check_peers(status: dict[str, Any], now: float) -> Iterator[Check]:
    """Each peer's state (UDP reachability), this node's NAT view, and the clock skew peers' records bound."""
    peers = status.get("peers") or []
    if not peers:
        yield Check("peers", "skip", "no peers yet: UDP reachability and clock skew need one")
    alive = [p for p in peers if p.get("state") == "alive"]
    for peer in peers:
        label = f"peer {peer.get('name') or str(peer.get('node_id'))[:8]}"
        if peer.get("state") != "alive":
            yield Check(label, "fail", f"{peer.get('state')}: not answering over UDP at {peer.get('addr') or '?'}",
                        f"check that {peer.get('name') or 'it'} is running and that UDP to its address is not "
                        "blocked (firewall, NAT); `meshllm status` shows its path")
    if peers:
        direct = sum(1 for p in alive if p.get("path") == "direct")
        yield Check("udp", "ok" if alive else "fail", f"{len(alive)} of {len(peers)} peer(s) reachable, "
                    f"{direct} directly", "" if alive else "check this node's firewall for UDP on its mesh port")
    nat = status.get("nat") or {}
    reach, observed = nat.get("reachability", "unknown"), ", ".join(nat.get("observed") or []) or "none yet"
    if reach == "private":
        yield Check("nat", "warn", f"behind a NAT: peers see this node at {observed}",
                    "peers reach it through relays and hole punching; forward the mesh port and pass --announce "
                    "HOST:PORT for direct paths")
    else:
        yield Check("nat", "ok" if reach == "public" else "skip", f"reachability {reach}; observed at {observed}")
    ages = [now - float(p["signed_at"]) for p in alive if p.get("signed_at")]
    ahead = [p for p in alive if p.get("signed_at") and float(p["signed_at"]) - now > CLOCK_SKEW_S]
    for peer in ahead:
        yield Check(f"clock {peer.get('name')}", "fail",
                    f"{peer.get('name')} signs records {float(peer['signed_at']) - now:.0f} s in this machine's future",
                    "sync both clocks (NTP: timedatectl set-ntp true)")
    if ages and not ahead:
        yield Check("clock", "ok", f"within {CLOCK_SKEW_S:.0f} s of {len(ages)} peer(s) (newest record "
                                   f"{min(ages):+.0f} s old)")


def run_checks(home: Path, api: NodeApi, api_port: int | None, mesh_port: int | None,
               deep: bool) -> list[Check]:
    config = Config()
    checks = list(check_install())
    checks += check_home(home)
    if home.exists():
        checks += check_config(home)
        with contextlib.suppress(MeshllmError):
            config = load_config(home)
    if api.url == DEFAULT_API and config.api_port != DEFAULT_API_PORT:  # the node this home's config starts
        api = NodeApi(f"http://127.0.0.1:{config.api_port}", api.secret, api.source)
    node, status = check_node(api)
    checks.append(node)
    # a running node's own ports, unless others are named; without one, those it would start on
    running = (_port(status.get("api_url", "")), _port(status.get("mesh_addr", ""))) if status else (None, None)
    checks += check_ports(_first(api_port, running[0], config.api_port),
                          _first(mesh_port, running[1], config.mesh_port), status)
    checks += check_disk(home, config)
    checks += check_models(home, deep)
    if status is not None:
        checks += check_peers(status, time.time())
    return checks


MARKS = {"ok": ("ok", "green"), "warn": ("warn", "yellow"), "fail": ("FAIL", "red"), "skip": ("skip", "bright_black")}


@click.command("doctor")
@api_option
@json_option
@click.option("--port", "api_port", type=click.IntRange(0, 65535), default=None,
              help="API port to check (default: config.toml's, else 9337).")
@click.option("--mesh-port", type=click.IntRange(0, 65535), default=None,
              help="Mesh UDP port to check (default: config.toml's, else 9338).")
@click.option("--verify-models", is_flag=True, help="Hash every model file against its id (slow for large models).")
def doctor(api: NodeApi, home: Path | None, as_json: bool, api_port: int | None, mesh_port: int | None,
           verify_models: bool) -> None:
    """Check this install, the node's home and the running node; a fix for each failure (exit 1 if any)."""
    checks = run_checks(resolve_home(home), api, api_port, mesh_port, verify_models)
    failed = [c for c in checks if c.outcome == "fail"]
    if as_json:
        echo_json({"ok": not failed, "checks": [asdict(c) for c in checks]})
    else:
        width = max(len(c.name) for c in checks)
        for c in checks:
            mark, colour = MARKS[c.outcome]
            click.echo(f"{click.style(f'{mark:<4}', fg=colour)} {c.name:<{width}}  {c.detail}")
            if c.fix and c.outcome == "fail":
                click.echo(f"     {'':<{width}}  fix: {c.fix}")
        click.echo(f"{len(failed)} problem(s) found" if failed else "no problems found")
    if failed:
        raise SystemExit(1)
