"""``meshllm service install|uninstall|status``: keep a node running as the user's service.

On Linux a systemd **user** unit (``~/.config/systemd/user/meshllm.service``): started at login,
or at boot once lingering is on (``loginctl enable-linger``), restarted when it fails, its log in
the journal (``journalctl --user -u meshllm``). On macOS a launchd agent
(``~/Library/LaunchAgents/dev.meshllm.node.plist``), kept alive after a failure, its log in
``~/Library/Logs/meshllm/``. Either runs ``meshllm serve`` with the home and the flags given after
``--``, with the Python that runs this command, so a virtual environment keeps working.

The unit text is built by pure functions (:func:`systemd_unit`, :func:`launchd_plist`) from a
:class:`ServiceSpec`; ``--dry-run`` prints it and changes nothing.
"""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from meshllm.cli.common import F, home_option
from meshllm.config import resolve_home
from meshllm.errors import MeshllmError

LAUNCHD_LABEL = "dev.meshllm.node"
DEFAULT_UNIT = "meshllm"
SECRET_FLAGS = frozenset({"--api-key"})
"""Flags whose value must not be written into a unit file others may read: use ``--api-key-file``."""


class ServiceError(MeshllmError):
    """The service manager is missing or refused a step."""


@dataclass(frozen=True)
class ServiceSpec:
    """What the service runs: this Python's ``meshllm serve`` for ``home`` with ``args``."""

    name: str
    home: Path
    args: tuple[str, ...] = ()
    python: str = sys.executable

    @property
    def command(self) -> list[str]:
        return [self.python, "-m", "meshllm", "serve", "--home", str(self.home), *self.args]


def _systemd_quote(arg: str) -> str:
    """One ``ExecStart`` word: specifiers (``%``) and variables (``$``) doubled, quoted when needed."""
    text = arg.replace("%", "%%").replace("$", "$$")
    if text and not any(c in text for c in ' \t"\'\\;'):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def systemd_unit(spec: ServiceSpec) -> str:
    """The systemd user unit running ``spec``."""
    exec_start = " ".join(_systemd_quote(a) for a in spec.command)
    home = _systemd_quote(f"MESHLLM_HOME={spec.home}")
    where = str(spec.home).replace("%", "%%")
    return f"""\
# Written by `meshllm service install`; `meshllm service uninstall` removes it.
[Unit]
Description=meshllm node ({where})
Documentation=man:systemd.service(5)
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
Environment={home}
Environment=PYTHONUNBUFFERED=1
ExecStart={exec_start}
Restart=on-failure
RestartSec=5
KillSignal=SIGTERM
TimeoutStopSec=30
StandardOutput=journal
StandardError=journal
SyslogIdentifier={spec.name}

[Install]
WantedBy=default.target
"""


def launchd_plist(spec: ServiceSpec, logs: Path) -> bytes:
    """The launchd agent running ``spec``; its output goes to ``logs``."""
    return plistlib.dumps({
        "Label": LAUNCHD_LABEL if spec.name == DEFAULT_UNIT else f"{LAUNCHD_LABEL}.{spec.name}",
        "ProgramArguments": spec.command,
        "EnvironmentVariables": {"MESHLLM_HOME": str(spec.home), "PYTHONUNBUFFERED": "1"},
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": 5,
        "StandardOutPath": str(logs / f"{spec.name}.log"),
        "StandardErrorPath": str(logs / f"{spec.name}.log"),
    })


@dataclass(frozen=True)
class Platform:
    """Where a platform keeps the service file and which tool manages it."""

    kind: str  # "systemd" or "launchd"

    def path(self, name: str) -> Path:
        if self.kind == "systemd":
            base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
            return base / "systemd" / "user" / f"{name}.service"
        label = LAUNCHD_LABEL if name == DEFAULT_UNIT else f"{LAUNCHD_LABEL}.{name}"
        return Path.home() / "Library" / "LaunchAgents" / f"{label}.plist"

    def render(self, spec: ServiceSpec) -> bytes:
        if self.kind == "systemd":
            return systemd_unit(spec).encode()
        return launchd_plist(spec, Path.home() / "Library" / "Logs" / "meshllm")


def current_platform(choice: str | None) -> Platform:
    """``--platform``, else this machine's: launchd on macOS, systemd elsewhere."""
    if choice:
        return Platform("launchd" if choice == "macos" else "systemd")
    return Platform("launchd" if sys.platform == "darwin" else "systemd")


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a service-manager command (bounded); a failure is a :class:`ServiceError` naming it."""
    if shutil.which(cmd[0]) is None:
        raise ServiceError(f"{cmd[0]} is not available on this machine",
                           hint="use --dry-run to print the service file and install it by hand")
    try:
        done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise ServiceError(f"`{' '.join(cmd)}` did not finish within 60 s") from None
    if check and done.returncode != 0:
        raise ServiceError(f"`{' '.join(cmd)}` failed: {(done.stderr or done.stdout).strip()[:300]}")
    return done


def _check_args(args: tuple[str, ...]) -> None:
    """Refuse flags that do not belong in a unit file, then parse the rest as ``meshllm serve`` does."""
    from meshllm.cli.serve import serve

    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in SECRET_FLAGS:
            raise click.UsageError(f"{flag} would be written into the service file in the clear; "
                                   "use --api-key-file FILE (mode 0600) instead")
        if flag == "--home":
            raise click.UsageError("give --home before --, to `meshllm service install` itself")
    try:
        serve.make_context("meshllm serve", list(args))
    except click.UsageError as exc:
        raise click.UsageError(f"the flags after -- are not valid for `meshllm serve`: {exc.format_message()}"
                               ) from None


def _warn_if_locked(home: Path, args: tuple[str, ...]) -> None:
    """A service cannot type a passphrase: say so when the node it runs would need the encrypted mesh key."""
    from meshllm.mesh.admission import MESH_PASSPHRASE_ENV, MeshKey

    joining = any(a.split("=", 1)[0] == "--join" for a in args)
    stored = None if joining or not home.is_dir() else MeshKey.stored(home)
    if stored is not None and stored[1]:
        click.echo(f"warning: the mesh key in {home} is encrypted and a service cannot ask for its passphrase; "
                   f"give it {MESH_PASSPHRASE_ENV} (systemd: `systemctl --user edit` with an Environment= line in a "
                   "file only you can read), or decrypt it: meshllm mesh decrypt", err=True)


@click.group("service")
def service() -> None:
    """Run the node as a service of this user: systemd on Linux, launchd on macOS."""


def unit_options(func: F) -> F:
    """``--unit NAME`` and ``--platform``, shared by the three subcommands."""
    func = click.option("--unit", default=DEFAULT_UNIT, show_default=True, metavar="NAME",
                        help="Service name (several nodes: one unit and --home each).")(func)
    return click.option("--platform", type=click.Choice(["linux", "macos"]), default=None,
                        help="Write the other platform's file (with --dry-run).")(func)


@service.command("install", context_settings={"ignore_unknown_options": True})
@home_option
@unit_options
@click.option("--dry-run", is_flag=True, help="Print the service file; change nothing.")
@click.argument("serve_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- SERVE FLAGS]")
def install(home: Path | None, unit: str, platform: str | None, dry_run: bool, serve_args: tuple[str, ...]) -> None:
    """Install and start a service running `meshllm serve` with this home and SERVE FLAGS.

    Example: meshllm service install -- --model hf:ORG/REPO:Q4_K_M --name alpha

    The flags after -- are checked as `meshllm serve` would parse them before anything is written.
    """
    _check_args(serve_args)
    target = current_platform(platform)
    spec = ServiceSpec(unit, resolve_home(home).resolve(), serve_args)
    text = target.render(spec)
    _warn_if_locked(spec.home, serve_args)
    if dry_run:
        click.echo(text.decode(), nl=False)
        return
    if platform and target != current_platform(None):
        raise click.UsageError("--platform for another system works with --dry-run only")
    path = target.path(unit)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text)
    if target.kind == "systemd":
        _run("systemctl", "--user", "daemon-reload")
        _run("systemctl", "--user", "enable", "--now", f"{unit}.service")
        click.echo(f"installed and started {path}")
        click.echo(f"  logs: journalctl --user -u {unit} -f")
        click.echo(f"  to start at boot without logging in: loginctl enable-linger {os.environ.get('USER', '$USER')}")
    else:
        (Path.home() / "Library" / "Logs" / "meshllm").mkdir(parents=True, exist_ok=True)
        _run("launchctl", "bootstrap", f"gui/{os.getuid()}", str(path))
        click.echo(f"installed and started {path}")
        click.echo(f"  logs: {Path.home() / 'Library' / 'Logs' / 'meshllm' / (unit + '.log')}")


@service.command("uninstall")
@unit_options
def uninstall(unit: str, platform: str | None) -> None:
    """Stop the service and remove its file."""
    target = current_platform(platform)
    path = target.path(unit)
    if not path.exists():
        raise ServiceError(f"no service {unit!r} is installed ({path} does not exist)")
    if target.kind == "systemd":
        _run("systemctl", "--user", "disable", "--now", f"{unit}.service", check=False)
        path.unlink()
        _run("systemctl", "--user", "daemon-reload", check=False)
    else:
        _run("launchctl", "bootout", f"gui/{os.getuid()}", str(path), check=False)
        path.unlink()
    click.echo(f"stopped and removed {path}")


@service.command("status")
@unit_options
def status(unit: str, platform: str | None) -> None:
    """Whether the service is installed and running (exit 1 when it is not running)."""
    target = current_platform(platform)
    path = target.path(unit)
    if not path.exists():
        raise ServiceError(f"no service {unit!r} is installed ({path} does not exist)",
                           hint="install it with `meshllm service install`")
    click.echo(f"installed: {path}")
    if target.kind == "systemd":
        done = _run("systemctl", "--user", "status", "--no-pager", "--lines=5", f"{unit}.service", check=False)
        label = "active" if done.returncode == 0 else "not running"
    else:
        done = _run("launchctl", "print", f"gui/{os.getuid()}/{path.stem}", check=False)
        label = "active" if done.returncode == 0 and "state = running" in done.stdout else "not running"
    click.echo(done.stdout.rstrip() or done.stderr.rstrip())
    click.echo(f"state: {label}")
    if label != "active":
        raise SystemExit(1)
