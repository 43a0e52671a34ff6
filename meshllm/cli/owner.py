"""``meshllm owner NODE load|unload|drain|config|status``: steer your nodes with commands signed by the owner key.

The command is sealed here, in the CLI process: signed with the owner key from the keystore in
``--home`` (passphrase from ``$MESHLLM_OWNER_PASSPHRASE`` or a prompt) and encrypted to NODE. The
running node at ``--api`` (usually your own, in the same home) only carries it through the mesh
(``POST /api/owner/relay``) to NODE, hop by hop where they are not connected, and hands back NODE's
signed result, which is checked here too: signed by NODE, fresh, and answering this very command.
NODE executes it only if it carries a certificate from this owner and trusts this owner
(docs/identity.md, "Owner commands").
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from meshllm.api.owner_routes import RELAY_MARGIN_S, b64decode, b64encode
from meshllm.cli.api_client import NodeApi
from meshllm.cli.common import MeshllmGroup, api_option, ask_passphrase, echo_json, home_dir, json_option
from meshllm.config import OWNER_KEYSTORE_FILE
from meshllm.errors import MeshllmError
from meshllm.identity.keystore import OWNER_KEYSTORE, PASSPHRASE_ENV, unlock_keystore
from meshllm.owner.commands import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S, OwnerCommand, open_result, pick_node, seal_command


class Refused(MeshllmError):
    """The node refused or could not carry out the command (exit code 1)."""


def _options(func: Any) -> Any:
    func = click.option("--timeout", type=click.FloatRange(1.0, MAX_TIMEOUT_S), default=DEFAULT_TIMEOUT_S,
                        show_default=True, help="Seconds the node may take (a load, or requests finishing "
                                                "before an unload).")(func)
    return api_option(json_option(func))


@click.group(cls=MeshllmGroup)
@click.argument("node")
@click.pass_context
def owner(ctx: click.Context, node: str) -> None:
    """Commands to NODE (its id, name or an id prefix), signed with the owner key in --home."""
    ctx.obj = node


@owner.command("load")
@click.argument("model")
@_options
@click.pass_obj
def load(node: str, model: str, api: NodeApi, as_json: bool, timeout: float, home: Path | None) -> None:
    """Load MODEL (a path or `default`, as NODE resolves it) and serve it; the mesh lists it within seconds."""
    _run(api, home, node, OwnerCommand(op="load", model=model, timeout_s=timeout), as_json)


@owner.command("unload")
@click.argument("model")
@_options
@click.pass_obj
def unload(node: str, model: str, api: NodeApi, as_json: bool, timeout: float, home: Path | None) -> None:
    """Stop serving MODEL: no new requests reach it, those running finish (up to --timeout), then it is freed."""
    _run(api, home, node, OwnerCommand(op="unload", model=model, timeout_s=timeout), as_json)


@owner.command("drain")
@_options
@click.pass_obj
def drain(node: str, api: NodeApi, as_json: bool, timeout: float, home: Path | None) -> None:
    """Unload every model NODE serves, each after its requests finish; pause its standby controller."""
    _run(api, home, node, OwnerCommand(op="drain", timeout_s=timeout), as_json)


@owner.command("config")
@click.argument("setting", metavar="KEY=VALUE")
@_options
@click.pass_obj
def config(node: str, setting: str, api: NodeApi, as_json: bool, timeout: float, home: Path | None) -> None:
    """Change a runtime setting of NODE: name, standby (on|off), standby_idle_s."""
    key, sep, value = setting.partition("=")
    if not sep or not key.strip():
        raise click.BadParameter(f"{setting!r} is not KEY=VALUE", param_hint="KEY=VALUE")
    _run(api, home, node, OwnerCommand(op="config", key=key.strip(), value=value, timeout_s=timeout), as_json)


@owner.command("status")
@_options
@click.pass_obj
def status(node: str, api: NodeApi, as_json: bool, timeout: float, home: Path | None) -> None:
    """What NODE serves (requests in flight, idle time), its standby decisions and certificate."""
    _run(api, home, node, OwnerCommand(op="status", timeout_s=timeout), as_json)


def _run(api: NodeApi, home: Path | None, node: str, command: OwnerCommand, as_json: bool) -> None:
    """Seal ``command`` for ``node``, relay it through the node at ``api``, check and print the answer."""
    snapshot = api.get_json("/api/status")
    members = [(p["node_id"], p.get("name", "")) for p in snapshot.get("peers", [])
               if p.get("state") in ("alive", "suspect")]
    target = pick_node(node, [(snapshot["node_id"], snapshot.get("name", "")), *members])
    passphrase = ask_passphrase("Owner passphrase", env=PASSPHRASE_ENV, what=OWNER_KEYSTORE, confirm=False)
    owner_key = unlock_keystore(home_dir(home) / OWNER_KEYSTORE_FILE, passphrase)
    envelope = seal_command(owner_key, target, command, time.time())
    wait = command.timeout_s + RELAY_MARGIN_S
    answer = api.post_json("/api/owner/relay", {"envelope": b64encode(envelope), "timeout_s": wait},
                           timeout=wait + 5.0)
    result = open_result(owner_key, b64decode(answer["result"], "result"), envelope, target, time.time())
    name = dict([(snapshot["node_id"], snapshot.get("name", "")), *members]).get(target) or target[:8]
    out = {"node": target, "name": name, "ok": result.ok, "code": result.code, "message": result.message,
           "data": result.data}
    if as_json:
        echo_json(out)
    elif result.ok:
        click.echo(f"{name}: {result.message}")
        if command.op == "status":
            _print_status(result.data)
    if not result.ok:
        raise Refused(f"{name} refused: {result.code}: {result.message}")


def _print_status(data: dict[str, Any]) -> None:
    expires = data.get("certificate_expires")
    click.echo(f"  node {data.get('node_id', '?')[:16]}… meshllm {data.get('version', '?')}, "
               f"up {data.get('uptime_s', 0):.0f} s, certificate "
               f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime(expires)) + ' UTC' if expires else 'none'}")
    for m in data.get("models", []):
        tag = f" (standby, idle {m['idle_s']:g} s)" if m.get("standby") else ""
        click.echo(f"  serves {m['model']}{tag}: {m['running']} running, {m['queued']} queued, "
                   f"{m['tok_s']:g} tok/s")
    for m in data.get("draining", []):
        click.echo(f"  draining {m['model']}: {m['in_flight']} in flight")
    standby = data.get("standby")
    if standby:
        state = "on" if standby.get("enabled") else "paused"
        click.echo(f"  standby {state}: library {', '.join(standby.get('candidates', [])) or '-'}; "
                   f"serving {', '.join(standby.get('serving', [])) or 'nothing'}")
        for w in standby.get("waiting", []):
            click.echo(f"    {w['model']}: {w['reason']} for {w['for_s']:g} s")
