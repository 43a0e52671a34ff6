"""Conventions every command shares: ``--home``, ``--json``, one-line errors and exit codes.

Exit codes: 0 ok, 1 runtime failure (any :class:`~meshllm.errors.MeshllmError`), 2 usage error
(click's own). A command never shows a traceback: :class:`MeshllmGroup` turns meshllm errors
into one line plus an optional hint, and anything unexpected into one line that says how to get
the traceback (``MESHLLM_DEBUG=1``).
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from meshllm.config import ensure_home, resolve_home
from meshllm.errors import MeshllmError

F = TypeVar("F", bound=Callable[..., Any])


class CommandFailed(click.ClickException):
    """A meshllm error on its way to the terminal as one line (exit code 1)."""

    exit_code = 1

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.message}", err=True)
        if self.hint:
            click.echo(f"  hint: {self.hint}", err=True)


class MeshllmGroup(click.Group):
    """A click group that maps errors raised by its commands to one clean line."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except MeshllmError as exc:
            raise CommandFailed(str(exc), exc.hint) from None
        except (click.ClickException, click.exceptions.Exit, click.exceptions.Abort, KeyboardInterrupt):
            raise
        except Exception as exc:
            if os.environ.get("MESHLLM_DEBUG"):
                raise
            raise CommandFailed(f"internal error: {type(exc).__name__}: {exc}",
                                "run again with MESHLLM_DEBUG=1 for the traceback, and report it") from None


def home_option(func: F) -> F:
    """``--home DIR``: the node's folder (default ``$MESHLLM_HOME``, else ``~/.meshllm``)."""
    return click.option(
        "--home", "home", type=click.Path(file_okay=False, path_type=Path), default=None,
        help="Node folder (default: $MESHLLM_HOME, else ~/.meshllm).",
    )(func)


def json_option(func: F) -> F:
    """``--json``: print machine-readable JSON instead of text."""
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(func)


def home_dir(home: Path | None, create: bool = True) -> Path:
    """Resolve (and by default create) the home folder for a command; an existing one is checked and tightened."""
    return ensure_home(resolve_home(home), create=create)


def echo_json(data: Any) -> None:
    """Print ``data`` as indented JSON on stdout."""
    click.echo(json.dumps(data, indent=2, sort_keys=True, default=str))


def parse_duration(text: str) -> float:
    """Seconds in ``30s``, ``15m``, ``24h``, ``7d`` or a plain number of seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    raw = text.strip().lower()
    try:
        value = float(raw[:-1]) * units[raw[-1]] if raw and raw[-1] in units else float(raw)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a duration like 30m, 24h or 7d") from None
    if value <= 0:
        raise click.BadParameter(f"{text!r} must be positive")
    return value


def dht_multiaddrs(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    """Check ``--dht-bootstrap`` values have the shape ``/ip4/HOST/tcp/PORT/p2p/PEERID`` (usage error if not)."""
    for value in values:
        parts = value.split("/")
        ok = (len(parts) == 7 and parts[0] == "" and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6")
              and parts[3] == "tcp" and parts[4].isdigit() and 0 < int(parts[4]) < 65536 and parts[5] == "p2p"
              and bool(parts[2]) and bool(parts[6]))
        if not ok:
            raise click.BadParameter(f"{value!r} is not a DHT address like /ip4/HOST/tcp/PORT/p2p/PEERID")
    return values


class Gigabytes(click.ParamType):
    """A memory size in GB: a finite number from 0.01 to a million (click's FloatRange lets NaN through)."""

    name = "GB"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of gigabytes", param, ctx)
        if not math.isfinite(number) or not 0.01 <= number <= 1e6:
            self.fail(f"{value!r} must be a number of gigabytes from 0.01 to 1000000", param, ctx)
        return number


GIGABYTES = Gigabytes()


def check_api_url(_ctx: click.Context | None, _param: click.Parameter | None, value: str | None) -> str | None:
    """An ``--api`` value must be an http(s):// URL; a trailing ``/`` is dropped (None passes through)."""
    if value is None:
        return None
    if not value.startswith(("http://", "https://")):
        raise click.BadParameter(f"{value!r} is not an http:// or https:// URL")
    return value.rstrip("/")


def api_option(func: F | None = None, *, optional: bool = False) -> Any:
    """``--api URL`` of a running node, with the secret to send; the command gets ``api`` as a ``NodeApi``.

    Also adds ``--api-key`` (``$MESHLLM_API_KEY``) and ``--home``: without an API key the node's admin
    token is read from the home (``--home``, ``$MESHLLM_HOME``, ``~/.meshllm``). A command that
    declares a ``home`` parameter receives it too. ``optional``: no default URL; ``api`` is ``None``
    unless ``--api`` is given.
    """
    if func is None:
        return lambda f: api_option(f, optional=optional)
    from meshllm.cli.api_client import DEFAULT_API, NodeApi  # httpx: only for the commands that talk to a node

    wants_home = "home" in inspect.signature(func).parameters

    @functools.wraps(func)
    def wrapper(*args: Any, api: str | None, api_key: str | None, home: Path | None, **kwargs: Any) -> Any:
        if wants_home:
            kwargs["home"] = home
        node = None if api is None else NodeApi.for_cli(api, api_key, home)
        return func(*args, api=node, **kwargs)

    url_help = ("Ask the running node at this API URL (e.g. http://127.0.0.1:9337)." if optional
                else "The running node's API URL (also $MESHLLM_API).")
    options = [
        click.option("--api", default=None if optional else DEFAULT_API, envvar=None if optional else "MESHLLM_API",
                     show_default=not optional, metavar="URL", callback=check_api_url, help=url_help),
        click.option("--api-key", default=None, envvar="MESHLLM_API_KEY", metavar="KEY",
                     help="Secret to send (also $MESHLLM_API_KEY; default: the admin token in --home)."),
        home_option,
    ]
    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def ask_passphrase(label: str, *, env: str, what: str, confirm: bool) -> str:
    """A passphrase from ``$env``, else a hidden prompt (``label``) when stdin is a terminal, else a clear error."""
    from meshllm.identity.keystore import obtain_passphrase

    def prompt(again: bool) -> str:
        return str(click.prompt(label, hide_input=True, confirmation_prompt=again, err=True))

    return obtain_passphrase(confirm=confirm, prompt=prompt if sys.stdin.isatty() else None, env=env, what=what)


def mesh_passphrase(confirm: bool) -> str:
    """The mesh key's passphrase: ``$MESHLLM_MESH_PASSPHRASE``, else a hidden prompt on a terminal."""
    from meshllm.mesh.admission import MESH_KEY_WHAT, MESH_PASSPHRASE_ENV

    return ask_passphrase("Mesh key passphrase", env=MESH_PASSPHRASE_ENV, what=MESH_KEY_WHAT, confirm=confirm)


def load_mesh_key(folder: Path) -> Any:
    """The ``MeshKey`` in ``folder`` (``None`` if absent), asking for its passphrase only when it is encrypted."""
    from meshllm.mesh.admission import MeshKey

    stored = MeshKey.stored(folder)
    if stored is None:
        return None
    return MeshKey.load(folder, mesh_passphrase(confirm=False) if stored[1] else None)


def iso_utc(ts: float) -> str:
    """A Unix time as ISO 8601 UTC to the second, ending in ``Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))
